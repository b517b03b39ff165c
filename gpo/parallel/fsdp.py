"""Fully sharded data parallel training for gpo: Lightning's FSDP2 strategy with transformer-block shard units."""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Literal

import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from torch import Tensor, nn
from typing_extensions import override

MixedPrecision = Literal["auto", "bf16", "none"]


def decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of ``model``'s transformer blocks (``LlamaDecoderLayer``, ``Qwen2MoeDecoderLayer``, ...): the
    modules transformers declares unsplittable (``_no_split_modules``) that occur in ``model``, else the class of
    the blocks of its decoder (``get_decoder().layers``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(module) for module in model.modules() if type(module).__name__ in names}
    if not classes and hasattr(model, "get_decoder"):
        classes = {type(layer) for layer in getattr(model.get_decoder(), "layers", ())}
    if not classes:
        raise ValueError(
            f"{type(model).__name__} declares no transformer block class (_no_split_modules) and has no "
            "get_decoder().layers: FSDP needs the blocks to shard one by one."
        )
    return classes


class FullyShardedStrategy(ModelParallelStrategy):
    """FSDP2 over all processes, each transformer block sharded on its own.

    FSDP2 (``torch.distributed.fsdp.fully_shard``) over all processes: each transformer block of the policy is
    one shard unit (gathered for its forward and backward, resharded after), the rest (embeddings, final norm,
    head) is the root unit. Parameters, gradients and optimiser state are sharded; checkpoints are folders with
    one shard per process (``torch.distributed.checkpoint``), resumed by the same strategy on the same number of
    processes. GPOModule applies it to the policy, and to the frozen reference copy (KL with full fine-tuning) with
    the same settings, in ``configure_model``. Runs on CPU with gloo as well as on GPUs with NCCL.

    Args:
        mixed_precision: ``bf16``: blocks compute in bfloat16, gradients are reduced in float32 and the sharded
            parameters stay in the dtype they were loaded in; ``none``: no casting; ``auto``: ``bf16`` on CUDA,
            ``none`` on CPU (gloo reduces no bfloat16 on every platform).
        activation_checkpointing: recompute each block's activations in the backward pass (transformers'
            non-reentrant gradient checkpointing): less memory for one more forward of every block.
        reshard_after_forward: free the gathered parameters of a block after its forward (less memory; the
            backward gathers them again).
        save_distributed_checkpoint: ``True``: each process saves its own shards; ``False``: rank 0 saves the
            whole model to one file.
        process_group_backend: ``nccl``, ``gloo`` (default: ``nccl`` on CUDA, ``gloo`` on CPU).
    """

    def __init__(
        self,
        *,
        mixed_precision: MixedPrecision = "auto",
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
    ) -> None:
        if mixed_precision not in ("auto", "bf16", "none"):
            raise ValueError(f"mixed_precision={mixed_precision!r} is not valid; choose 'auto', 'bf16' or 'none'.")
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
        )
        self.mixed_precision = mixed_precision
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = reshard_after_forward

    @override
    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # one data-parallel dimension over every process of every node
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def shard(self, model: nn.Module, *, trainable: bool = True) -> None:
        """Apply ``fully_shard`` to each transformer block of ``model`` (a transformers causal LM, possibly with
        LoRA layers inside), then to ``model`` itself, the root unit (embeddings, final norm, output layer);
        ``trainable=False`` (a frozen reference): no activation checkpointing. A model already sharded is left as it
        is. The root must be what is called: FSDP2 gathers the root unit only in ``model``'s own forward."""
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if isinstance(model, FSDPModule):
            return
        if trainable and self.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy = MixedPrecisionPolicy()
        if self.mixed_precision == "bf16" or (self.mixed_precision == "auto" and self.root_device.type == "cuda"):
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        options = {"mesh": self.device_mesh["data_parallel"], "mp_policy": policy}
        classes = tuple(decoder_layer_classes(model))
        for block in [m for m in model.modules() if isinstance(m, classes)]:
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **options)
        fully_shard(model, **options)
        model._is_fsdp_managed_module = True  # read by transformers' generate (synced_gpus) and gpo.models.scorer


def is_sharded(strategy: Strategy) -> bool:
    """Whether ``strategy`` is gpo's FSDP2 strategy (parameters are DTensor shards)."""
    return isinstance(strategy, FullyShardedStrategy)


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters of an FSDP2 root unit (a root stays gathered after its forward, for the
    backward that usually follows; a frozen reference has none). Anything else is left as it is."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def sampling_mode(model: nn.Module) -> AbstractContextManager:
    """How to run ``model`` without gradients: in inference mode (no version counters, no view tracking: about 6% of a
    small model's sampling time), but for an FSDP2 module under ``no_grad``: its gathered parameters keep version
    counters, which inference mode does not allow."""
    from torch.distributed.fsdp import FSDPModule

    return torch.no_grad() if isinstance(model, FSDPModule) else torch.inference_mode()


def check_strategy(strategy: Strategy) -> None:
    """Refuse Lightning's FSDP1 strategy (``--trainer.strategy fsdp``): gpo clips the gradient norm of DTensor
    shards or of whole tensors, not of FSDP1's flat shards, and shards its reference model with FSDP2 only."""
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "trainer.strategy fsdp (Lightning's FSDPStrategy, FSDP1) is not supported by gpo; use FSDP2: "
            "--config configs/fsdp.yaml (trainer.strategy gpo.parallel.fsdp.FullyShardedStrategy)."
        )


def check_sampler_process(strategy: Strategy, sampler_process: bool) -> None:
    """Refuse pipelined rollouts sampled in a worker process (``HFEngine`` with ``max_off_policy_steps >= 1``) under
    FSDP2: the worker would copy the policy's shards (DTensors), which it has no process group to gather."""
    if sampler_process and is_sharded(strategy):
        raise ValueError(
            "model.max_off_policy_steps >= 1 with HFEngine samples in a worker process from a copy of the policy, "
            "which FSDP2 (gpo.parallel.fsdp.FullyShardedStrategy) shards across processes: set "
            "model.max_off_policy_steps: 0, or pipeline a VLLMServerEngine, or train with DDP."
        )


def check_same_count(count: int, what: str, device: torch.device) -> None:
    """Raise on every rank when the ranks would run different numbers of forward passes (``what``): under FSDP each
    forward and backward is a collective, and a rank that runs one more than the others waits for ever."""
    from gpo.parallel import collectives

    low = int(collectives.reduce_over_ranks(torch.tensor(count, device=device), "min"))
    high = int(collectives.reduce_over_ranks(torch.tensor(count, device=device), "max"))
    if low != high:
        raise RuntimeError(
            f"under FSDP every process must run the same number of {what}, but they run {low} to {high}: give every "
            "rank the same number of rows (e.g. no filtering that keeps different numbers of groups per rank), or "
            "set model.optim.micro_batch_size to null."
        )


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """Scale the gradients so their global 2-norm ``sqrt(sum_p ||g_p||^2)`` is at most ``max_norm``; returns the
    norm before clipping. Whole tensors: ``torch.nn.utils.clip_grad_norm_`` itself. DTensor shards (FSDP2): the
    norm of the local shards is reduced over the ranks (``full_tensor``) before scaling, as in torchtitan."""
    from torch.distributed.tensor import DTensor

    parameters = [p for p in parameters if p.grad is not None]
    if not any(isinstance(p.grad, DTensor) for p in parameters):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    if math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
