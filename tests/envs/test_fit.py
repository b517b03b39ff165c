"""``gpo fit --config configs/multiturn.yaml``: the episode reward rises; task app and judges plug into the same run."""

import csv
from pathlib import Path

import pytest
import torch

from gpo.cli import main, run
from gpo.envs import NumberGuess
from gpo.envs.number_guess_prompts import prompt
from gpo.envs.task_app import make_app as make_task_app
from gpo.rewards.judge_app import make_app as make_judge
from gpo.tasks import write_jsonl
from gpo.testing import save_tiny_model
from tests.envs.servers import serve

MULTITURN = Path(__file__).resolve().parents[2] / "configs/multiturn.yaml"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    save_tiny_model(root / "model", "llama")
    write_jsonl([{"prompt": prompt(1, 4)}] * 512, root / "train.jsonl")
    return root


def fit(root: Path, out: str, steps: int, *extra: str, command=main) -> list[dict[str, str]]:
    args = ["fit", f"--config={MULTITURN}", *extra, f"--model.policy={root / 'model'}"]
    args += [f"--data.path={root / 'train.jsonl'}", "--data.val_path=null", "--trainer.val_check_interval=1.0"]
    args += [f"--trainer.max_steps={steps}", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false"]
    args += ["--trainer.enable_checkpointing=false", "--export=none", f"--trainer.default_root_dir={root / out}"]
    command(args)
    metrics = next((root / out).rglob("metrics.csv"))
    return [row for row in csv.DictReader(metrics.open()) if row.get("reward/mean")]


def test_the_episode_reward_rises(assets):
    # A secret in 1-4, 3 guesses: the random tiny model wins ~5% of episodes at first.
    game = ["--model.engine.init_args.env.init_args.high=4", "--model.engine.init_args.max_turns=3"]
    rows = fit(assets, "rise", 50, *game)
    rewards = [float(row["reward/mean"]) for row in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert len(rewards) == 50 and last > first + 0.12, f"reward per step: {[round(r, 2) for r in rewards]}"


def test_a_task_app_that_is_down_is_one_line_naming_it_not_a_traceback(assets, capsys):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = ["--model.engine.init_args.env=gpo.envs.TaskApp", f"--model.engine.init_args.env.task_url=http://127.0.0.1:{port}",
           "--model.engine.init_args.env.health_max_wait_s=0.5"]  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        fit(assets, "down", 1, *app, command=run)  # what the gpo command prints
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert f"gpo fit: error: task app at task_url=http://127.0.0.1:{port}" in err and "health_max_wait_s" in err


def test_a_task_app_and_judges_blend_through_the_mixer(assets, tmp_path):
    with serve(make_task_app(NumberGuess(high=4))) as task_url, serve(make_judge()) as judge_url:
        overrides = tmp_path / "http.yaml"
        overrides.write_text(f"""
model:
  rewards:
    - gpo.rewards.env_reward
    - class_path: gpo.rewards.JudgeReward
      init_args: {{judge_url: "{judge_url}", kind: event, max_concurrency: 4}}
    - class_path: gpo.rewards.JudgeReward
      init_args: {{judge_url: "{judge_url}", kind: outcome}}
  mixer:
    class_path: gpo.algo.EnvEventOutcomeBlend
    init_args: {{env: 1.0, event: 0.5, outcome: 2.0}}
  engine:
    init_args:
      env:
        class_path: gpo.envs.TaskApp
        init_args: {{task_url: "{task_url}", timeout_s: 10}}
      max_concurrent_rollouts: 8
""")
        rows = fit(assets, "http", 2, f"--config={overrides}")
    for row in rows:
        env, event, outcome = (float(row[f"reward/{name}"]) for name in ("env_reward", "judge_event", "judge_outcome"))
        assert float(row["reward/mean"]) == pytest.approx(env + 0.5 * event + 2.0 * outcome, abs=1e-5)
        assert outcome == pytest.approx(env)  # the reference judge's outcome: the last turn won, as env_return says


def test_step_rewards_add_each_turns_advantage_to_its_tokens(assets, monkeypatch):
    from gpo.algo import StepRewards
    from gpo.train.learner import Learner

    seen = []
    update = Learner.update

    def capture(self, rollout, adv, mask, backend):
        seen.append((rollout, adv.clone(), mask.clone()))
        return update(self, rollout, adv, mask, backend)

    monkeypatch.setattr(Learner, "update", capture)
    stepwise = ["--model.step_rewards.mode=decision_stepwise", "--model.algorithm=GRPO"]
    fit(
        assets,
        "stepwise",
        2,
        "--model.engine.init_args.env.init_args.high=4",
        *stepwise,
        "--model.algorithm.ppo_clip.clip_low=0.4",
    )
    varies = False
    for rollout, adv, mask in seen:
        turn_adv = StepRewards(mode="decision_stepwise")(rollout.turn_rewards, rollout.group, rollout.turn_index)
        sequence_part = (adv - turn_adv * mask) * mask  # what is left: one sequence advantage per row
        for row in range(len(rollout)):
            on = mask[row].bool()
            assert torch.allclose(sequence_part[row][on], sequence_part[row][on][:1].expand(int(on.sum())))
            varies |= bool(turn_adv[row][on].unique().numel() > 1)
    assert varies, "no episode had turns with different credit: the check above proved nothing"
