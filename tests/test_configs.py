"""Every YAML under configs/ parses, instantiates and trains a few steps with the quickstart's tiny model."""

from pathlib import Path

import pytest

from gpo.cli import main
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from tests.vllm_engines import vllm_marks

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EXTRAS = sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "quickstart.yaml")  # presets and callbacks
# quickstart_vllm.yaml is trained whole, under the same conditions, by tests/test_quickstart_vllm.py
PRESETS = [pytest.param(p, id=p.stem, marks=vllm_marks if "vllm" in p.stem else ())
           for p in EXTRAS if p.name != "quickstart_vllm.yaml"]  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    dense = save_tiny_model(root / "llama", "llama")
    moe = save_tiny_model(root / "moe", "qwen2_moe")
    data = write_jsonl(make_task("sort_digits", 64), root / "train.jsonl")
    return root, str(dense), str(moe), str(data)


def run_fit(assets, *configs: Path, steps: int = 2, policy: str | None = None, extra: tuple[str, ...] = ()):
    root, dense, _, data = assets
    args = ["fit", *(f"--config={c}" for c in configs)]
    args += [f"--model.policy={policy or dense}", f"--data.path={data}", "--data.val_path=null"]
    # once an epoch: the quickstart validates every 200 steps, these runs are shorter
    args += ["--trainer.val_check_interval=1.0", "--trainer.check_val_every_n_epoch=1"]
    # A folder per run: sharded checkpoints are folders, and a fresh run refuses an earlier run's checkpoint.
    run = "-".join([*(Path(c).stem for c in configs), *(["custom"] if extra else [])])
    args += [f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={root / 'runs' / run}"]
    main([*args, "--trainer.enable_progress_bar=false", *extra])


def test_there_is_a_config_per_preset():
    from gpo.algo import ALGORITHMS

    assert set(ALGORITHMS) <= {p.stem for p in EXTRAS}


@pytest.mark.parametrize("preset", PRESETS)
def test_config_trains_a_few_steps_on_top_of_the_quickstart(assets, preset):
    policy = assets[2] if preset.stem == "rspo" else None
    teacher = (f"--model.teacher={assets[1]}",) if preset.stem == "distill" else ()  # the config's is a placeholder
    run_fit(assets, CONFIGS / "quickstart.yaml", preset, policy=policy, extra=teacher)


def test_quickstart_saves_its_resolved_config(assets):
    run_fit(assets, CONFIGS / "quickstart.yaml", steps=1)
    saved = max((assets[0] / "runs").rglob("config.yaml"), key=lambda p: p.stat().st_mtime).read_text()
    assert "positional_match" in saved
    # trainer settings outside the focused help's few are saved too: the run can be made again from this file
    assert "check_val_every_n_epoch: 1" in saved and "enable_progress_bar: false" in saved, saved


def test_parts_by_short_class_name_or_import_path(assets):
    extra = ("--model.algorithm=Custom", "--model.algorithm.gate=ClipGate", "--model.algorithm.gate.clip_high=0.3")
    extra += ("--model.algorithm.aggregator=gpo.algo.TokenMean", "--model.algorithm.advantage=RankAdvantage")
    run_fit(assets, CONFIGS / "quickstart.yaml", extra=extra)
    saved = max((assets[0] / "runs").rglob("config.yaml"), key=lambda p: p.stat().st_mtime).read_text()
    assert "class_path: gpo.algo.Custom" in saved
    assert "class_path: gpo.algo.ClipGate" in saved and "clip_high: 0.3" in saved
    assert "class_path: gpo.algo.TokenMean" in saved and "class_path: gpo.algo.RankAdvantage" in saved


# ---- every part the README names, built from YAML alone ----------------------------------------------------------

PARTS = {
    "advantage": ["GroupNormAdvantage", "LeaveOneOutAdvantage", "BatchWhitenedAdvantage", "RankAdvantage"],
    "gate": ["NoGate", "ClipGate", "CISPOGate", "SequenceClipGate", "SoftGate", "GeometricMeanGate",
             "RouterShiftGate", "VESPOGate"],
    "aggregator": ["TokenMean", "SequenceMean", "SequenceSum"],
}  # fmt: skip


def build(assets, tmp_path, yaml_text: str):
    """The GPOModule and Trainer ``gpo fit`` builds from the quickstart plus ``yaml_text`` (nothing is trained)."""
    from gpo.cli import GPOCLI
    from gpo.train.data import PromptDataModule
    from gpo.train.module import GPOModule

    _, dense, _, data = assets
    extra = tmp_path / "extra.yaml"
    extra.write_text(yaml_text)
    args = ["--config", str(CONFIGS / "quickstart.yaml"), "--config", str(extra), f"--model.policy={dense}"]
    args += [f"--data.path={data}", "--data.val_path=null", f"--trainer.default_root_dir={tmp_path}"]
    cli = GPOCLI(GPOModule, PromptDataModule, args=args, run=False)
    return cli.model, cli.trainer


@pytest.mark.parametrize(("slot", "name"), [(slot, name) for slot, names in PARTS.items() for name in names])
def test_each_algorithm_part_is_reachable_from_yaml(assets, tmp_path, slot, name):
    module, _ = build(
        assets, tmp_path, f"model:\n  algorithm:\n    class_path: Custom\n    init_args:\n      {slot}: {name}\n"
    )
    part = {"advantage": module.credit.advantage, "gate": module.learner.objective.gate,
            "aggregator": module.learner.objective.aggregator}[slot]  # fmt: skip
    assert type(part).__name__ == name


def test_the_other_named_parts_are_reachable_from_yaml(assets, tmp_path):
    module, trainer = build(
        assets,
        tmp_path,
        """
model:
  algorithm:
    class_path: Custom
    init_args:
      aggregator: {class_path: ConstantNorm, init_args: {max_length: 4}}
      gate: {class_path: DivergenceMaskGate, init_args: {mode: binary_tv, threshold: 0.2}}
  rewards:
    - gpo.rewards.positional_match
    - gpo.rewards.exact_match
    - gpo.rewards.math_answer
    - {class_path: gpo.rewards.RegexFormat, init_args: {pattern: "^[0-9]+$"}}
    - {class_path: gpo.rewards.LengthPenalty, init_args: {max_tokens: 3}}
    - {class_path: gpo.rewards.SoftOverlongPunishment, init_args: {max_length: 4, cache_length: 2}}
    - {class_path: gpo.rewards.DuplicatePenalty, init_args: {penalty: -0.5}}
  mixer: {class_path: GroupNormalizedSum, init_args: {weights: [1, 1, 1, 1, 1, 1, 1]}}
  kl: {beta: 0.05, estimator: k2, placement: reward}
  entropy: {coef: 0.01}
  correction: {mode: mis, level: sequence, cap: 3.0}
  token_weights: [OverlongFilter, ReferenceProbWeight]
trainer:
  callbacks:
    - gpo.callbacks.DynamicSampling
    - gpo.callbacks.DifficultyFilter
    - gpo.callbacks.RolloutMonitor
    - gpo.callbacks.CompletionSamples
""",
    )
    objective = module.learner.objective
    assert type(objective.aggregator).__name__ == "ConstantNorm" and objective.gate.mode == "binary_tv"
    names = [type(fn).__name__ if not hasattr(fn, "__code__") else fn.__name__ for fn in module.collector.rewards]
    assert names[3:] == ["RegexFormat", "LengthPenalty", "SoftOverlongPunishment", "DuplicatePenalty"]
    assert type(module.collector.mixer).__name__ == "GroupNormalizedSum"
    assert module.learner.reward_kl.estimator == "k2" and objective.entropy.coef == 0.01
    assert module.learner.correction.mode == "mis"
    assert [type(w).__name__ for w in objective.dropping + objective.scaling] == [
        "OverlongFilter",
        "ReferenceProbWeight",
    ]
    assert module.scorer.reference is not None  # ReferenceProbWeight and the KL need the reference
    names = {type(c).__name__ for c in trainer.callbacks}
    assert {"DynamicSampling", "DifficultyFilter", "RolloutMonitor", "CompletionSamples", "ExportPolicy"} <= names


def test_multi_turn_parts_are_reachable_from_yaml(assets, tmp_path):
    module, _ = build(
        assets,
        tmp_path,
        """
model:
  rewards:
    - gpo.rewards.env_reward
    - {class_path: gpo.rewards.JudgeReward, init_args: {judge_url: "http://127.0.0.1:1", kind: event}}
    - {class_path: gpo.rewards.JudgeReward, init_args: {judge_url: "http://127.0.0.1:1", kind: outcome}}
  mixer: {class_path: EnvEventOutcomeBlend, init_args: {env: 1.0, event: 0.5, outcome: 0.5}}
  step_rewards: {mode: env_sparse, beta: 0.5}
  engine:
    class_path: gpo.rollout.MultiTurnEngine
    init_args:
      engine: {class_path: gpo.rollout.HFEngine, init_args: {sampling: {max_new_tokens: 2}}}
      env: {class_path: gpo.envs.NumberGuess}
      max_turns: 3
""",
    )
    assert type(module.engine).__name__ == "MultiTurnEngine" and module.engine.sampling.max_new_tokens == 6
    assert module.credit.step_rewards.mode == "env_sparse"
    assert type(module.collector.mixer).__name__ == "EnvEventOutcomeBlend"


def test_a_served_teacher_is_reachable_from_yaml(assets, tmp_path):
    module, _ = build(
        assets,
        tmp_path,
        """
model:
  distill: {coef: 0.5}
  teacher:
    class_path: gpo.models.teacher.ServerTeacher
    init_args: {base_url: ["http://127.0.0.1:8101", "http://127.0.0.1:8102/"], retry_max_s: 5}
""",
    )
    teacher = module.learner.teacher
    assert type(teacher).__name__ == "ServerTeacher" and teacher.model is None
    assert teacher.servers.urls == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert teacher.servers.retries.retry_max_s == 5 and module.learner.objective.distill.coef == 0.5
