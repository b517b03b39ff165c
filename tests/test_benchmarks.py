"""The scripts under ``benchmarks/`` still run at their smallest sizes, and their flags mean what they say."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(BENCHMARKS / name), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def test_dynamic_sampling_curves_runs_and_prints_its_tables():
    done = run_script("dynamic_sampling_curves.py", "--steps", "2", "--window", "1", "--eval-samples", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    for section in ("On-policy reward", "Held-out reward (64 prompts, sampled x1 and greedy)", "Cost"):
        assert section in done.stdout


def parse_with_preset(monkeypatch, *argv: str) -> argparse.Namespace:
    """The command line ``argv`` parsed by the shared workload arguments and ``--preset``, as the scripts build it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", ["bench", *argv])
    from workload import add_preset_argument, add_workload_arguments

    parser = argparse.ArgumentParser(prog="bench")
    add_workload_arguments(parser)
    add_preset_argument(parser)
    return parser.parse_args()


def test_preset_sets_the_sizes_in_either_spelling_and_explicit_flags_win(monkeypatch):
    for argv in (["--preset", "quickstart"], ["--preset=quickstart"]):
        args = parse_with_preset(monkeypatch, *argv)
        assert (args.hidden_size, args.num_layers, args.max_new_tokens, args.lr) == (64, 2, 4, 1e-3)
    assert parse_with_preset(monkeypatch, "--hidden-size", "32", "--preset=quickstart").hidden_size == 32
    assert parse_with_preset(monkeypatch).hidden_size == 256


def test_preset_without_a_value_or_unknown_is_a_usage_error(monkeypatch, capsys):
    for argv in (["--preset"], ["--preset", "huge"], ["--preset=huge"]):
        with pytest.raises(SystemExit) as exit:
            parse_with_preset(monkeypatch, *argv)
        assert exit.value.code == 2
        assert "--preset" in capsys.readouterr().err


def test_step_time_refuses_fewer_measured_steps_than_its_report_needs(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import step_time

    monkeypatch.setattr(sys, "argv", ["step_time.py", "--steps", "1"])
    with pytest.raises(SystemExit) as exit:
        step_time.parse_args()
    assert exit.value.code == 2 and "--steps" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--steps", "1", "--profile", "5"])  # no table: one step is enough
    assert step_time.parse_args().steps == 1


def test_pipeline_refuses_no_warm_up_and_the_single_seed_flag(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import pipeline

    for argv in (["--warmup", "0"], ["--seed", "1"]):
        monkeypatch.setattr(sys, "argv", ["pipeline.py", *argv])
        with pytest.raises(SystemExit) as exit:
            pipeline.parse_args()
        assert exit.value.code == 2 and argv[0] in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["pipeline.py", "--seeds", "3", "--warmup", "1"])
    assert pipeline.parse_args().seeds == [3]
