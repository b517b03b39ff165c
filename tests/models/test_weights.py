"""gpo.models.weights: full weights under checkpoint names; tied weights under both names; LoRA merged aside
(equal to peft's merge, trained model untouched); FSDP2 (DTensor) and FSDP1 parameters gathered on a one-process
gloo group."""

import copy

import pytest
import torch
import torch.distributed as dist

from gpo.models.loading import LoraSettings, add_lora
from gpo.models.weights import checkpoint_name, checkpoint_weights, full_parameters
from gpo.testing import tiny_model
from tests.ports import free_port


@pytest.fixture
def one_process_group():
    """A default gloo process group of one process; an in-process vLLM engine of an earlier test already made one."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def assert_equal_weights(weights, expected):
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert type(weights[name]) is torch.Tensor and torch.equal(weights[name], tensor), name


def test_full_weights_are_the_state_dict_with_tied_weights_under_both_names():
    model = tiny_model()
    weights = checkpoint_weights(model)
    assert "lm_head.weight" in weights and "model.embed_tokens.weight" in weights
    assert_equal_weights(weights, model.state_dict())


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.0._fsdp_wrapped_module.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("model.layers.1.mlp.up_proj.base_layer.weight", "model.layers.1.mlp.up_proj.weight"),
        ("_orig_mod.model.norm.weight", "model.norm.weight"),
        ("model.layers.0._checkpoint_wrapped_module.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
        ("lm_head.modules_to_save.default.weight", "lm_head.weight"),
    ],
)
def test_checkpoint_name_removes_wrapper_segments(name, expected):
    assert checkpoint_name(name) == expected


def trained(policy):
    """As after training: B (zero at initialisation, which would merge to nothing) and the copies peft trains in
    place of a ``modules_to_save`` module changed."""
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name or ".modules_to_save." in name:
                parameter.normal_(0, 0.1)
    return policy


def test_lora_weights_are_merged_aside_like_peft_merge_and_unload():
    policy = trained(add_lora(tiny_model(), LoraSettings(r=4, alpha=8, dropout=0.0)))
    before = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
    weights = checkpoint_weights(policy)
    merged = copy.deepcopy(policy).merge_and_unload()
    assert_equal_weights(weights, merged.state_dict())
    assert not torch.equal(
        weights["model.layers.0.self_attn.q_proj.weight"], tiny_model().model.layers[0].self_attn.q_proj.weight
    )
    assert all(torch.equal(before[name], tensor) for name, tensor in policy.state_dict().items())
    assert not any(tensor.requires_grad for tensor in weights.values())  # no autograd graph kept with them


def test_every_active_adapter_is_merged_where_it_adapts_and_a_saved_module_by_its_trained_copy():
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["norm"]), "a")
    policy.add_adapter("b", LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    policy.base_model.set_adapter(["a", "b"])
    trained(policy)
    merged = copy.deepcopy(policy).merge_and_unload()  # adds the deltas in another order: equal to rounding
    torch.testing.assert_close(checkpoint_weights(policy), merged.state_dict())


def test_a_bfloat16_policy_with_its_adapter_in_float32_gives_bfloat16_weights():
    torch.manual_seed(0)
    policy = trained(add_lora(tiny_model().to(torch.bfloat16), LoraSettings(r=4, alpha=8, dropout=0.0)))
    assert policy.base_model.model.model.layers[0].self_attn.q_proj.lora_B.default.weight.dtype == torch.float32
    merged = copy.deepcopy(policy).merge_and_unload()
    # dtypes and values: the float32 delta added, then rounded once (rounded before it was added, about 1.6% of the
    # elements came out one bfloat16 step away, and the engine sampled other weights than gpo export wrote)
    torch.testing.assert_close(checkpoint_weights(policy), merged.state_dict(), atol=0, rtol=0)


def test_a_dora_adapter_is_refused_naming_the_layer():
    """DoRA's magnitude vector does not merge as B A does: its merged weights would be wrong, unseen."""
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match=r"q_proj: DoRA adapters cannot be merged for the rollout engine; use plain"):
        checkpoint_weights(policy)


@pytest.mark.usefixtures("one_process_group")
def test_fsdp2_dtensor_parameters_are_gathered():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_model()
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert type(next(model.parameters())).__name__ == "DTensor"
    assert_equal_weights(checkpoint_weights(model), expected)


@pytest.mark.usefixtures("one_process_group")
def test_fsdp1_parameters_are_summoned_and_their_wrapper_names_removed():
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = tiny_model()
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    wrapped = FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), device_id=torch.device("cpu")
    )
    assert any("_fsdp_wrapped_module" in name for name, _ in wrapped.named_parameters())
    with full_parameters(wrapped):
        weights = checkpoint_weights(wrapped.module)
    assert_equal_weights(weights, expected)
