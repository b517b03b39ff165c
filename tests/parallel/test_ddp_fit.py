"""``gpo fit`` under Lightning's DDP strategy on CPU: 2 processes (gloo) train, checkpoint, and a run resumed from a
checkpoint written mid-run ends bitwise like the run that was never stopped."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model

REPO = Path(__file__).resolve().parents[2]
# What an in-process run in this pytest process (a single-process FSDP config, say) leaves in os.environ: inherited,
# they would make the subprocess believe an outside launcher started it (and wait for a second rank for ever), or
# reuse a port the first run still holds.
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                      "LOCAL_WORLD_SIZE")  # fmt: skip

# 20 prompts, 4 per step over 2 processes (2 each): 5 batches per epoch; 2 minibatches per batch, so 12 optimiser
# steps are 6 batches and cross an epoch boundary. DynamicSampling draws extra prompt batches from each rank's
# share, as many as that rank needs (so the ranks' counts differ and each must resume its own), and keeps global
# totals; all of it is part of the checkpoint.
CONFIG = """
seed_everything: 4
trainer:
  accelerator: cpu
  strategy: ddp
  devices: 2
  max_steps: 12
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  limit_val_batches: 0
  callbacks:
    - class_path: gpo.callbacks.ResumeCheckpoint
      init_args: {{every_n_train_steps: 4, save_top_k: -1}}
    - class_path: gpo.callbacks.DynamicSampling
      init_args: {{max_rounds: 2}}
model:
  policy: {root}/model
  rewards: [tests.parallel.ddp_step.even_digit_sum]
  group_size: 4
  max_off_policy_steps: {lag}
  algorithm: {{class_path: gpo.algo.GRPO, init_args: {{ppo_clip: {{}}}}}}
  entropy: {{coef: 0.01}}
  engine: {{class_path: gpo.rollout.HFEngine, init_args: {{sampling: {{max_new_tokens: 4}}}}}}
  optim: {{lr: 1.0e-3, number_of_minibatches: 2}}
data:
  path: {root}/train.jsonl
  prompts_per_step: 4
"""


@pytest.fixture(scope="module", params=[0, 1], ids=["synchronous", "pipelined"])
def config(tmp_path_factory, request) -> Path:
    """The run above, synchronous or with each rank's sampler one step ahead (``max_off_policy_steps: 1``: each rank
    has its own worker process, and its rollout collected ahead is part of the checkpoint)."""
    root = tmp_path_factory.mktemp("ddp_fit")
    save_tiny_model(root / "model", "llama", seed=0)
    write_jsonl(make_task("sort_digits", 20, seed=0), root / "train.jsonl")
    (root / "config.yaml").write_text(CONFIG.format(root=root, lag=request.param))
    return root / "config.yaml"


def fit(config: Path, root: Path, *extra: str) -> dict:
    """``gpo fit`` in a subprocess (Lightning starts the second rank); returns the last checkpoint."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable,
        "-m",
        "gpo.cli",
        "fit",
        f"--config={config}",
        f"--trainer.default_root_dir={root}",
        *extra,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return load(root / "checkpoints/last.ckpt")


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_a_ddp_run_resumed_from_a_mid_run_checkpoint_ends_like_the_run_never_stopped(config, tmp_path):
    """With gpo fit's default export, which rank 0 writes (its folder, asked on rank 0 alone, waited for a broadcast
    the other rank never joined: every DDP run ended in a crash after its last checkpoint)."""
    whole = fit(config, tmp_path / "whole")
    exported = load_file(tmp_path / "whole/lightning_logs/version_0/export/model.safetensors")
    trained = {key.removeprefix("policy."): tensor for key, tensor in whole["state_dict"].items()}
    assert exported and all(torch.equal(tensor, trained[name]) for name, tensor in exported.items())
    (tmp_path / "resumed/checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "whole/checkpoints/step000004.ckpt", tmp_path / "resumed/checkpoints/last.ckpt")
    drawn = [rank["extra_batches_drawn"] for rank in load(tmp_path / "resumed/checkpoints/last.ckpt")["gpo"]["ranks"]]
    assert drawn[0] != drawn[1], drawn  # the ranks drew different numbers of extra batches before the checkpoint
    resumed = fit(config, tmp_path / "resumed", "--ckpt_path=last")
    assert whole["global_step"] == resumed["global_step"] == 12
    assert whole["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] >= 1  # crossed an epoch
    for name, tensor in whole["state_dict"].items():
        assert torch.equal(tensor, resumed["state_dict"][name]), name
    for key, state in whole["optimizer_states"][0]["state"].items():
        assert all(torch.equal(state[k], resumed["optimizer_states"][0]["state"][key][k]) for k in state)
    totals = [state for name, state in whole["callbacks"].items() if name.startswith("DynamicSampling")]
    resumed_totals = [state for name, state in resumed["callbacks"].items() if name.startswith("DynamicSampling")]
    assert totals == resumed_totals and totals[0]["groups_kept"] > 0


def wait_for(path: Path, process: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def test_sigterm_to_rank_0_mid_step_stops_both_processes_after_it_with_a_checkpoint_and_143(tmp_path):
    """Rank 0 stalls in its reward while rank 1 waits in the step's next collective; SIGTERM reaches rank 0 alone.
    Lightning's handler broadcast from inside the signal handler there and the run hung; now the ranks agree at the
    batch's end, both write the checkpoint and stop, and the run resumes."""
    save_tiny_model(tmp_path / "model", "llama", seed=0)
    write_jsonl(make_task("sort_digits", 40, seed=0), tmp_path / "train.jsonl")
    config = CONFIG.format(root=tmp_path, lag=0).replace("max_steps: 12", "max_steps: 40")
    config = config.replace("tests.parallel.ddp_step.even_digit_sum", "tests.reliability.faults.stall_rank_0_on_cue")
    (tmp_path / "config.yaml").write_text(config)
    cue, run = tmp_path / "cue", tmp_path / "run"
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "GPO_FAULT_CUE": str(cue), "GPO_FAULT_STALL_S": "1"}  # fmt: skip
    command = [sys.executable, "-m", "gpo.cli", "fit", f"--config={tmp_path / 'config.yaml'}",
               f"--trainer.default_root_dir={run}"]  # fmt: skip
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_for(run / "checkpoints/last.ckpt", process, log)
        cue.touch()  # rank 0's next reward call stalls for a second
        wait_for(tmp_path / "cue.hit", process, log)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
    finally:
        process.kill()
    assert code == 143, log.read_text()[-3000:]
    stopped = load(run / "checkpoints/last.ckpt")["global_step"]
    assert 4 < stopped < 40  # after the step the signal interrupted, past the first periodic checkpoint
    assert fit(tmp_path / "config.yaml", run, "--ckpt_path=last")["global_step"] == 40
