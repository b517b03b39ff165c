"""Every YAML under configs/ parses, instantiates and trains a few steps with the quickstart's tiny model."""

from pathlib import Path

import pytest

from gpo.cli import main
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from tests.vllm_engines import vllm_marks

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EXTRAS = sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "quickstart.yaml")  # presets and callbacks
PRESETS = [pytest.param(p, id=p.stem, marks=vllm_marks if "vllm" in p.stem else ()) for p in EXTRAS]


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
    args += ["--trainer.val_check_interval=1.0"]  # the quickstart validates every 200 steps; these runs are shorter
    run = "-".join(Path(c).stem for c in configs)  # a folder per run: sharded checkpoints are folders, not files
    args += [f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={root / 'runs' / run}"]
    main([*args, "--trainer.enable_progress_bar=false", *extra])


def test_there_is_a_config_per_preset():
    from gpo.algo import ALGORITHMS

    assert set(ALGORITHMS) <= {p.stem for p in EXTRAS}


@pytest.mark.parametrize("preset", PRESETS)
def test_config_trains_a_few_steps_on_top_of_the_quickstart(assets, preset):
    policy = assets[2] if preset.stem == "rspo" else None
    run_fit(assets, CONFIGS / "quickstart.yaml", preset, policy=policy)


def test_quickstart_saves_its_resolved_config(assets):
    run_fit(assets, CONFIGS / "quickstart.yaml", steps=1)
    saved = max((assets[0] / "runs").rglob("config.yaml"), key=lambda p: p.stat().st_mtime)
    assert "positional_match" in saved.read_text()


def test_parts_by_short_class_name_or_import_path(assets):
    extra = ("--model.gate=ClipGate", "--model.gate.clip_high=0.3", "--model.aggregator=gpo.algo.TokenMean")
    run_fit(assets, CONFIGS / "quickstart.yaml", extra=(*extra, "--model.advantage=RankAdvantage"))
    saved = max((assets[0] / "runs").rglob("config.yaml"), key=lambda p: p.stat().st_mtime).read_text()
    assert "class_path: gpo.algo.ClipGate" in saved and "clip_high: 0.3" in saved
    assert "gpo.algo.TokenMean" in saved and "gpo.algo.RankAdvantage" in saved
