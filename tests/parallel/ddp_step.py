"""One GPOModule training step on a fixed rollout, taken by one process or by two under Lightning's DDP on CPU (gloo).

The rollout engine's completions depend on the prompt alone, never on the seed, so two ranks sampling their shares
of a global batch produce exactly the rows one process produces for the whole batch. The optimiser is plain SGD:
its update is ``-lr`` times the gradient, so comparing updates compares gradients (Adam's first step is about
``-lr * sign(g)``, blind to a gradient's scale, which is what a wrong normaliser gets wrong).
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import lightning as L
import torch

from gpo.algo import BatchWhitenedAdvantage, ClipGate, Custom, SequenceMean, TokenMean
from gpo.rollout.base import Rollout, RolloutEngine, Sampling
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from gpo.train.data import PromptDataModule
from gpo.train.module import GPOModule
from gpo.train.optimization import Optimization

LR = 0.5
PROMPTS_PER_STEP, GROUP_SIZE, WORLD_SIZE = 4, 4, 2
EOS, FIRST_DIGIT = 1, 2  # char_tokenizer ids: <pad> 0, EOS 1, then the digits


def digit_sum(prompts, completions, **_) -> list[float]:
    """A reward that varies within a group: the completion's digit sum mod 5, scaled to [0, 1]."""
    return [sum(int(c) for c in text if c.isdigit()) % 5 / 4 for text in completions]


def even_digit_sum(prompts, completions, **_) -> list[float]:
    """1 when the completion's digits add up to an even number: a tiny random policy's groups are often uniform."""
    return [float(sum(int(c) for c in text if c.isdigit()) % 2 == 0) for text in completions]


class FixedEngine(RolloutEngine):
    """Sample ``k`` of prompt ``p`` is a function of ``(p, k)`` alone: ``1 + (sum(p) + k) % 4`` digits, then EOS
    unless ``(sum(p) + k) % 3 == 0`` (those are cut off, truncated)."""

    shares_policy_weights = True
    sampling = Sampling(max_new_tokens=5)

    def generate(self, prompt_ids, n, *, greedy=False, seed=None, logprobs=False, sampling=None) -> Rollout:
        prompts, completions, truncated = [], [], []
        for p in prompt_ids:
            for k in range(n):
                s = sum(p) + k
                digits = [FIRST_DIGIT + (3 * sum(p) + 7 * k + 5 * j) % 10 for j in range(1 + (sum(p) + k * k) % 4)]
                prompts.append(p)
                completions.append(digits if s % 3 == 0 else [*digits, EOS])
                truncated.append(s % 3 == 0)
        width_p, width_t = max(map(len, prompts)), max(map(len, completions))
        return Rollout(
            prompt_ids=torch.tensor([[0] * (width_p - len(p)) + p for p in prompts]),
            prompt_mask=torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts]),
            completion_ids=torch.tensor([c + [0] * (width_t - len(c)) for c in completions]),
            completion_mask=torch.tensor([[1] * len(c) + [0] * (width_t - len(c)) for c in completions]),
            truncated=torch.tensor(truncated),
            group=torch.arange(len(prompt_ids)).repeat_interleave(n),
        )


class SGDModule(GPOModule):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD([p for p in self.policy.parameters() if p.requires_grad], lr=LR)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)}


CASES = {
    # GRPO's group-normalised advantage with the token-count normaliser
    "grpo_token_mean": {"algorithm": Custom(aggregator=TokenMean())},
    # REINFORCE++: group-centred rewards whitened over the whole batch; token-count normaliser
    "reinforce_pp": {"algorithm": Custom(advantage=BatchWhitenedAdvantage(), aggregator=TokenMean())},
    # two optimiser steps per batch (PPO clipping), micro-batches of 3 rows, sequence-count normaliser
    "two_minibatches": {
        "algorithm": Custom(gate=ClipGate(clip_low=0.4, clip_high=0.5), aggregator=SequenceMean()),
        "optim": {"number_of_minibatches": 2, "micro_batch_size": 3},
    },
}

# What a DDP run without the global statistics would do: each rank divides by its own normaliser, or computes the
# batch statistics of the advantage over its own rows only.
NAIVE = {
    "local_normaliser": ("gpo.parallel.collectives.ddp_normaliser", lambda local: local),
    "local_advantage_stats": ("gpo.parallel.collectives.gather_rows", lambda x: (x, slice(0, x.shape[0]))),
}


def write_assets(root: Path) -> None:
    save_tiny_model(root / "model", "llama", seed=0)
    write_jsonl(make_task("sort_digits", 16, seed=4), root / "train.jsonl")  # the ranks get 21 and 26 tokens


def sgd_module(case: str, root: Path) -> SGDModule:
    """The module of ``case``: plain SGD, no gradient clipping, old log-probs from the trainer."""
    kwargs = dict(CASES[case])
    optim = Optimization(lr=LR, max_grad_norm=None, **kwargs.pop("optim", {}))
    return SGDModule(
        str(root / "model"), [digit_sum], engine=FixedEngine(), group_size=GROUP_SIZE, optim=optim,
        old_logprobs="trainer", **kwargs,
    )  # fmt: skip


def step(case: str, root: Path, devices: int, naive: str | None = None) -> dict:
    """Take one training step of ``case``; returns the logged loss and the update of every parameter."""
    module = sgd_module(case, root)
    data = PromptDataModule(str(root / "train.jsonl"), tokenizer=str(root / "model"), prompts_per_step=PROMPTS_PER_STEP)
    before = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0,
    )  # fmt: skip
    with ExitStack() as patches:
        if naive is not None:
            patches.enter_context(mock.patch(*NAIVE[naive]))
        trainer.fit(module, data)
    update = {name: p.detach() - before[name] for name, p in module.policy.named_parameters()}
    return {"loss": float(trainer.callback_metrics["loss"]), "update": update}


def worker(rank: int, port: int, root: str, out: str) -> None:
    """One of ``WORLD_SIZE`` processes: every case, then the naive variants; results saved to ``out/rank<r>.pt``.

    The environment names the process group, so Lightning joins it instead of launching processes of its own."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD_SIZE), RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0",
    )  # fmt: skip
    torch.set_num_threads(1)
    results = {case: step(case, Path(root), WORLD_SIZE) for case in CASES}
    results["naive_normaliser"] = step("grpo_token_mean", Path(root), WORLD_SIZE, naive="local_normaliser")
    results["naive_advantage"] = step("reinforce_pp", Path(root), WORLD_SIZE, naive="local_advantage_stats")
    torch.save(results, Path(out) / f"rank{rank}.pt")
