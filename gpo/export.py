"""Saving the trained policy as a transformers folder (weights + tokenizer) that transformers and vLLM load."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Literal

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.models import is_peft

ExportMode = Literal["merged", "adapter", "none"]


def export_policy(
    policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: str | Path, *, merge: bool = True
) -> Path:
    """Write ``policy`` and ``tokenizer`` to ``folder`` with ``save_pretrained``; returns the folder.

    A LoRA policy is saved merged into its base weights (``merge=True``: a plain model folder) or as the
    adapter alone (``merge=False``: load it with peft on top of the base model); the training model itself is
    left untouched. The folder appears whole or not at all: files go to a sibling temporary folder first.
    """
    folder = Path(folder)
    partial = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = policy
    if is_peft(policy) and merge:
        model = copy.deepcopy(policy).merge_and_unload()
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if folder.exists():
        previous = folder.with_name(f".{folder.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        folder.rename(previous)
        partial.rename(folder)
        shutil.rmtree(previous)
    else:
        partial.rename(folder)
    return folder
