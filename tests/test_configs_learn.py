"""The shipped configs of parts outside the presets (masks, KL and entropy controls, reward mixing, distillation) each
train the quickstart task from the random tiny model with the reward rising (``gpo fit --config quickstart --config
NAME``, as a user runs them)."""

import statistics
from pathlib import Path

import pytest

from gpo.cli import main
from gpo.plot import find_metrics_csv, read_metrics
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PARTS = ["adaptive_entropy", "deepseek_v32", "gdpo", "icepop", "intellect2", "kl_k3plus", "m2po", "top_entropy",
         "two_grpo", "distill"]  # fmt: skip
STEPS = 200
# the loss sees a fifth of the tokens, so it learns slower (0.02 -> 0.28 by step 500 here)
LONGER = {"top_entropy": 500}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs_learn")
    model = save_tiny_model(root / "model", "llama", seed=0, hidden_size=64, num_layers=2)
    data = write_jsonl(make_task("sort_digits", 2000, seed=0), root / "train.jsonl")
    return root, str(model), str(data)


def fit(assets, name: str, config: str | None = None, *extra: str, steps: int = STEPS) -> list[float]:
    """``reward/mean`` every 10 steps of a quickstart run (in ``root/name``) with ``config`` on top."""
    root, model, data = assets
    out = root / name
    configs = ["--config=quickstart", *([f"--config={CONFIGS / config}.yaml"] if config else [])]
    main(["fit", *configs, f"--model.policy={model}", f"--data.path={data}", "--data.val_path=null",
          f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={out}", "--trainer.enable_progress_bar=false",
          *extra])  # fmt: skip
    return read_metrics(find_metrics_csv(out))["reward/mean"][1].tolist()


@pytest.fixture(scope="module")
def teacher(assets):
    """The quickstart's model after 300 GRPO steps, exported as a folder."""
    fit(assets, "teacher", steps=300)
    return next((assets[0] / "teacher").rglob("export"))


def test_every_part_config_has_a_learning_test():
    presets = {p.stem for p in CONFIGS.glob("*.yaml")} - set(PARTS)
    # the presets learn in tests/train/test_presets_learn.py; the rest set up runs, not objectives
    assert presets == {"cispo", "dapo", "dppo", "dr_grpo", "dro", "gmpo", "gopo", "grpo", "gspo", "maxrl",
                       "reinforce_pp", "rloo", "rspo", "sapo", "vespo", "quickstart", "quickstart_vllm", "callbacks",
                       "fsdp", "multiturn", "smollm2_arithmetic", "smollm2_arithmetic_vllm"}  # fmt: skip


@pytest.mark.parametrize("name", PARTS)
def test_reward_rises_with_the_config(assets, request, name):
    extra = (f"--model.teacher={request.getfixturevalue('teacher')}",) if name == "distill" else ()
    rewards = fit(assets, name, name, *extra, steps=LONGER.get(name, STEPS))
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
    # from about 0.03, every config reached 0.26 or more in the measured run (deepseek_v32 the lowest)
    assert last > first + 0.1, (first, last, rewards)
