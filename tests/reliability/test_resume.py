"""Exact resume: a run killed mid-step (SIGKILL) or stopped by SIGTERM and resumed with ``--ckpt_path last`` ends with
bitwise the same weights, optimiser state and step as a run that was never interrupted."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpo.callbacks.resume_checkpoint import SIGTERM_EXIT_CODE
from gpo.cli import main
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from gpo.train.checkpointing import CheckpointError
from tests.reliability import faults

REPO = Path(__file__).resolve().parents[2]

# 20 prompts in batches of 4: 5 batches per epoch; 2 minibatches x 2 PPO epochs: 4 optimiser steps per batch, so
# 36 steps are 9 batches (the run crosses an epoch boundary) and a checkpoint is written every 2 batches. The
# second PPO epoch shuffles with the global torch generator, the schedule warms up then decays: everything a
# resume has to restore takes part.
CONFIG = """
seed_everything: 3
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 36
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  limit_val_batches: 0
  callbacks:
    - class_path: gpo.callbacks.ResumeCheckpoint
      init_args:
        every_n_train_steps: 8
    - class_path: tests.reliability.faults.CountBatches
{extra_callbacks}export: none
model:
  policy: {model}
  rewards: [tests.reliability.faults.stall_on_cue]
  group_size: 4
  algorithm: {{class_path: gpo.algo.GRPO, init_args: {{ppo_clip: {{}}}}}}
  entropy: {entropy}
  engine: {{class_path: gpo.rollout.HFEngine, init_args: {{sampling: {{max_new_tokens: 4}}}}}}
  max_off_policy_steps: {lag}
  optim: {{lr: 1.0e-3, number_of_minibatches: 2, ppo_epochs: 2, lr_schedule: cosine, warmup_steps: 4}}
data:
  path: {train}
  prompts_per_step: 4
"""


# DynamicSampling draws extra prompt batches (their position is part of the checkpoint) and has state of its own.
DYNAMIC_SAMPLING = "    - class_path: gpo.callbacks.DynamicSampling\n      init_args: {max_rounds: 3}\n"
# The adaptive entropy coefficient is objective state: it climbs by 0.001 a batch (the target is never reached).
ADAPTIVE_ENTROPY = "{adaptive: {target: 100.0, step: 0.001}}"


# Pipelined rollouts (max_off_policy_steps: 1) with DynamicSampling: a rollout collected ahead is part of the
# checkpoint, the extra draws go through the sampler's queue; the first batch only fills the pipeline.
LAG = {"plain": 0, "dynamic_sampling": 0, "pipelined": 1}


@pytest.fixture(scope="module", params=list(LAG))
def config(tmp_path_factory, request) -> Path:
    root = tmp_path_factory.mktemp("resume")
    save_tiny_model(root / "model", "llama", seed=0)
    write_jsonl(make_task("sort_digits", 20, seed=0), root / "train.jsonl")
    path = root / "config.yaml"
    extra = DYNAMIC_SAMPLING if request.param != "plain" else ""
    entropy = "{coef: 0.01}" if request.param == "dynamic_sampling" else ADAPTIVE_ENTROPY
    path.write_text(CONFIG.format(model=root / "model", train=root / "train.jsonl", extra_callbacks=extra,
                                  entropy=entropy, lag=LAG[request.param]))  # fmt: skip
    return path


def lag(config: Path) -> int:
    return int(next(line for line in config.read_text().splitlines() if "max_off_policy_steps" in line).split()[-1])


def fit_in_process(config: Path, root: Path, *extra: str) -> None:
    main(["fit", f"--config={config}", f"--trainer.default_root_dir={root}", *extra])


def fit_in_subprocess(config: Path, root: Path, cue: Path, stall_s: float) -> subprocess.Popen:
    env = {**os.environ, "GPO_FAULT_CUE": str(cue), "GPO_FAULT_STALL_S": str(stall_s), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "gpo.cli", "fit", f"--config={config}", f"--trainer.default_root_dir={root}"]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"the run ended before {path.name} appeared: {process.stderr.read().decode()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def interrupt_after_first_checkpoint(config: Path, root: Path, how: signal.Signals) -> tuple[int, int, bool]:
    """Start a run, wait for its first checkpoint, cue a stall inside the next step's reward call, send ``how``.

    SIGKILL lands mid-step (the reward stalls for minutes); SIGTERM and Ctrl-C land mid-step too, and the step
    (stalling for a second) finishes before the run stops. Returns the process's exit code, the checkpoint's step and
    whether the checkpoint was written after the signal."""
    cue, last = root / "cue", root / "checkpoints/last.ckpt"
    process = fit_in_subprocess(config, root, cue, stall_s=600 if how == signal.SIGKILL else 1)
    wait_for(last, process)
    cue.touch()
    wait_for(Path(f"{cue}.hit"), process)
    signalled = time.time()
    process.send_signal(how)
    code = process.wait(timeout=120)
    return code, load(root)["global_step"], last.stat().st_mtime > signalled


def batches_done(checkpoint: dict) -> int:
    return checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"]


def resume_and_check_only_the_rest_trains(config: Path, root: Path, uninterrupted: dict) -> None:
    before, done = faults.BATCHES[0], batches_done(load(root))
    fit_in_process(config, root, "--ckpt_path=last")
    assert done > 0 and faults.BATCHES[0] - before == batches_done(uninterrupted) - done  # the rest, not a restart


def load(root: Path) -> dict:
    return torch.load(root / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)


def assert_same_run(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"]
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
    for (_, sa), (_, sb) in zip(
        a["optimizer_states"][0]["state"].items(), b["optimizer_states"][0]["state"].items(), strict=True
    ):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a["lr_schedulers"] == b["lr_schedulers"]
    assert a["gpo"]["objective"] == b["gpo"]["objective"]


@pytest.fixture(scope="module")
def uninterrupted(config, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("whole")
    fit_in_process(config, root)
    return load(root)


def test_uninterrupted_run_checkpoints_its_last_step(config, uninterrupted):
    assert uninterrupted["global_step"] == 36
    assert uninterrupted["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] >= 1  # crossed an epoch
    adaptive = uninterrupted["gpo"]["objective"].get("entropy")
    if adaptive is not None:  # one climb per batch trained (the pipeline's filling batches train nothing)
        assert adaptive["value"] == pytest.approx(0.001 * (batches_done(uninterrupted) - lag(config)))


def test_sigkill_mid_step_then_resume_gives_bitwise_the_same_weights(config, tmp_path, uninterrupted):
    code, step, _ = interrupt_after_first_checkpoint(config, tmp_path, signal.SIGKILL)
    assert code == -signal.SIGKILL and 0 < step < 36
    resume_and_check_only_the_rest_trains(config, tmp_path, uninterrupted)
    assert_same_run(load(tmp_path), uninterrupted)
    version = tmp_path / "lightning_logs/version_0"
    assert not (tmp_path / "lightning_logs/version_1").exists()  # the resumed run logs into the same folder
    rows = csv.DictReader((version / "metrics.csv").open())
    steps = [int(row["step"]) for row in rows if row.get("reward/mean")]
    trained = range(lag(config), batches_done(uninterrupted))  # after the batches that only fill the pipeline
    assert steps == list(trained)  # every batch once: none lost, none logged twice


def test_sigterm_checkpoints_the_finished_step_exits_143_and_resumes_exactly(config, tmp_path, uninterrupted):
    code, step, saved_at_the_signal = interrupt_after_first_checkpoint(config, tmp_path, signal.SIGTERM)
    assert code == SIGTERM_EXIT_CODE and saved_at_the_signal
    assert step % 4 == 0 and 8 <= step < 36  # stopped after a whole batch (4 optimiser steps), before the end
    resume_and_check_only_the_rest_trains(config, tmp_path, uninterrupted)
    assert_same_run(load(tmp_path), uninterrupted)


def test_a_finished_run_extended_to_more_steps_equals_one_run_of_that_length(config, tmp_path):
    constant = "--model.optim.lr_schedule=constant"  # a decaying schedule depends on max_steps by design
    fit_in_process(config, tmp_path / "whole", constant)
    fit_in_process(config, tmp_path / "extended", constant, "--trainer.max_steps=20")
    fit_in_process(config, tmp_path / "extended", constant, "--ckpt_path=last")
    assert_same_run(load(tmp_path / "extended"), load(tmp_path / "whole"))


def test_a_damaged_checkpoint_is_refused_with_the_file_named(config, tmp_path, uninterrupted):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save(uninterrupted, folder / "last.ckpt")
    data = (folder / "last.ckpt").read_bytes()
    (folder / "last.ckpt").write_bytes(data[: len(data) // 2])  # truncated, as by a crash without atomic writes
    with pytest.raises(CheckpointError, match=r"last\.ckpt is damaged and was not loaded"):
        fit_in_process(config, tmp_path, "--ckpt_path=last")
