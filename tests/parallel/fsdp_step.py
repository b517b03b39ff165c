"""GPOModule under gpo's FSDP2 strategy (2 processes, CPU, gloo): one training step per case of ``ddp_step``, and a
run of a few AdamW steps checkpointed as per-process shards and resumed from them.

The fixed engine, the SGD module and the cases are ``ddp_step``'s, so a step can be compared with one process
training on the whole batch (``ddp_step.step(case, root, devices=1)``).
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch

from gpo.callbacks import ResumeCheckpoint
from gpo.models.weights import full_tensor
from gpo.parallel.fsdp import FullyShardedStrategy
from gpo.train.data import PromptDataModule
from gpo.train.module import GPOModule
from gpo.train.optimization import Optimization
from tests.parallel.ddp_step import (
    CASES,
    GROUP_SIZE,
    PROMPTS_PER_STEP,
    WORLD_SIZE,
    FixedEngine,
    digit_sum,
    sgd_module,
)

RESUME_STEPS, CHECKPOINT_STEP = 3, 2


def trainer(max_steps: int, checkpoints: Path | None = None) -> L.Trainer:
    """2 processes under FSDP2; with ``checkpoints``, a sharded checkpoint every ``CHECKPOINT_STEP`` steps there."""
    callbacks = [ResumeCheckpoint(dirpath=checkpoints, every_n_train_steps=CHECKPOINT_STEP, save_top_k=-1)]
    return L.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=FullyShardedStrategy(), max_steps=max_steps,
        logger=False, enable_checkpointing=checkpoints is not None, callbacks=callbacks if checkpoints else None,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip


def data(root: Path) -> PromptDataModule:
    return PromptDataModule(str(root / "train.jsonl"), tokenizer=str(root / "model"), prompts_per_step=PROMPTS_PER_STEP)


def whole(module: GPOModule) -> dict[str, torch.Tensor]:
    """Every parameter of the policy gathered from its shards (a collective: every rank calls it)."""
    return {name: full_tensor(p.detach()).clone() for name, p in module.policy.named_parameters()}


def step(case: str, root: Path) -> dict:
    """``ddp_step.step`` under FSDP2: the logged loss, the update of every parameter, and whether it was sharded."""
    module = sgd_module(case, root)
    before = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
    fitted = trainer(1)
    fitted.fit(module, data(root))
    sharded = all(hasattr(p, "full_tensor") for p in module.policy.parameters())
    update = {name: p - before[name] for name, p in whole(module).items()}
    return {"loss": float(fitted.callback_metrics["loss"]), "update": update, "sharded": sharded}


def adamw_run(root: Path, max_steps: int, *, checkpoints: Path | None = None, resume: Path | None = None) -> dict:
    """``max_steps`` AdamW steps with gradient clipping and a KL reference copy (sharded too), optionally writing
    checkpoints to ``checkpoints`` or resuming from one; returns the policy's whole parameters."""
    from torch.distributed.fsdp import FSDPModule

    from gpo.algo import KLPenalty

    module = GPOModule(
        str(root / "model"), [digit_sum], engine=FixedEngine(), group_size=GROUP_SIZE,
        optim=Optimization(lr=1e-2, max_grad_norm=0.5), kl=KLPenalty(beta=0.1),
    )  # fmt: skip
    fitted = trainer(max_steps, checkpoints)
    fitted.fit(module, data(root), ckpt_path=str(resume) if resume else None)
    reference_sharded = isinstance(module.scorer.reference, FSDPModule) and all(
        hasattr(p, "full_tensor") for p in module.scorer.reference.parameters()
    )  # resharded after use: DTensor shards
    return {"params": whole(module), "global_step": fitted.global_step, "reference_sharded": reference_sharded}


def worker(rank: int, port: int, root: str, out: str) -> None:
    """One of ``WORLD_SIZE`` processes: every case, then a run writing sharded checkpoints and a run resumed from
    its mid-run checkpoint; results saved to ``out/rank<r>.pt``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD_SIZE), RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0",
    )  # fmt: skip
    torch.set_num_threads(1)
    root = Path(root)
    results = {case: step(case, root) for case in CASES}
    results["never_stopped"] = adamw_run(root, RESUME_STEPS, checkpoints=root / "checkpoints")
    results["resumed"] = adamw_run(
        root, RESUME_STEPS, resume=next((root / "checkpoints").glob(f"step{CHECKPOINT_STEP:06d}.ckpt"))
    )
    torch.save(results, Path(out) / f"rank{rank}.pt")
