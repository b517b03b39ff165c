"""gpo.parallel.fsdp without processes: which modules become FSDP units, and what is refused."""

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

from gpo.parallel.fsdp import (
    FullyShardedStrategy,
    check_sampler_process,
    check_strategy,
    clip_grad_norm,
    decoder_layer_classes,
)
from gpo.testing import tiny_model


@pytest.mark.parametrize(
    ("arch", "block"),
    [("llama", "LlamaDecoderLayer"), ("qwen2", "Qwen2DecoderLayer"), ("qwen2_moe", "Qwen2MoeDecoderLayer")],
)
def test_the_shard_units_are_the_decoder_layers(arch, block):
    model = tiny_model(arch)
    assert {c.__name__ for c in decoder_layer_classes(model)} == {block}
    assert sum(isinstance(m, tuple(decoder_layer_classes(model))) for m in model.modules()) == len(model.model.layers)


def test_a_model_without_declared_blocks_is_refused():
    with pytest.raises(ValueError, match="no transformer block class"):
        decoder_layer_classes(torch.nn.Linear(2, 2))


def test_lightnings_fsdp1_strategy_is_refused_with_the_fsdp2_config_named():
    with pytest.raises(ValueError, match=r"configs/fsdp\.yaml"):
        check_strategy(FSDPStrategy())
    check_strategy(FullyShardedStrategy())  # no error


def test_pipelined_sampling_in_a_worker_process_is_refused_under_fsdp2():
    with pytest.raises(ValueError, match=r"model\.max_off_policy_steps: 0"):
        check_sampler_process(FullyShardedStrategy(), sampler_process=True)
    check_sampler_process(FullyShardedStrategy(), sampler_process=False)  # sampled in step: no copy to make
    check_sampler_process(DDPStrategy(), sampler_process=True)  # DDP: each rank's worker copies whole weights


def test_invalid_mixed_precision_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'auto', 'bf16' or 'none'"):
        FullyShardedStrategy(mixed_precision="fp8")


def test_the_trainer_takes_the_strategy_on_cpu():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FullyShardedStrategy(), logger=False)
    assert isinstance(trainer.strategy, FullyShardedStrategy)


def test_clipping_whole_tensors_is_torchs_own():
    """Norm of gradients (3, 4) and (12,): sqrt(9 + 16 + 144) = 13; clipped to 6.5 they halve."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    assert float(clip_grad_norm([a, b], 6.5)) == pytest.approx(13.0)
    torch.testing.assert_close(a.grad, torch.tensor([1.5, 2.0]))
    torch.testing.assert_close(b.grad, torch.tensor([6.0]))
