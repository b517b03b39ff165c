"""What the tests that train share: a tiny model with sort-digits prompts on disk, a GPOModule on them, and a quiet
Lightning Trainer."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L

from gpo.rewards import positional_match
from gpo.rollout import HFEngine, Sampling
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from gpo.train.data import PromptDataModule
from gpo.train.module import GPOModule
from gpo.train.optimization import Optimization


def write_assets(root: Path, *, examples: int = 500, arch: str = "llama") -> tuple[str, str]:
    """A tiny random model (seed 0) in ``root/model`` and ``examples`` sort-digits prompts in ``root/train.jsonl``."""
    model = save_tiny_model(root / "model", arch, seed=0)
    data = write_jsonl(make_task("sort_digits", examples, seed=0), root / "train.jsonl")
    return str(model), str(data)


def tiny_module(model: str, rewards=(positional_match,), **kwargs) -> GPOModule:
    """A GPOModule on ``model``: groups of 4, 4-token completions from ``HFEngine``, lr 1e-3, unless ``kwargs`` say
    otherwise."""
    defaults = {
        "group_size": 4,
        "engine": HFEngine(sampling=Sampling(max_new_tokens=4)),
        "optim": Optimization(lr=1e-3),
    }
    return GPOModule(model, list(rewards), **{**defaults, **kwargs})


def quiet_trainer(max_steps: int, callbacks=(), **kwargs) -> L.Trainer:
    """A Trainer without logger, checkpoints, progress bar or model summary (each can be turned back on)."""
    warnings.filterwarnings("ignore", module="lightning")
    settings = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return L.Trainer(
        max_steps=max_steps, callbacks=list(callbacks), enable_model_summary=False, **{**settings, **kwargs}
    )


def prompts(model: str, data: str, prompts_per_step: int = 4, **kwargs) -> PromptDataModule:
    return PromptDataModule(data, tokenizer=model, prompts_per_step=prompts_per_step, **kwargs)
