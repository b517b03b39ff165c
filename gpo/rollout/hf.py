"""The embedded rollout engine: transformers' ``generate`` on the policy being trained. Runs anywhere."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import Tensor
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from gpo.logfilters import drop_messages
from gpo.models.loading import training_mode
from gpo.models.scorer import TokenScorer
from gpo.parallel.fsdp import sampling_mode
from gpo.rollout.base import Rollout, RolloutEngine, Sampling, pad_token_id, sampling_or_default

#: The settings of a transformers generation config that reshape the distribution ``generate`` samples from (or change
#: what it returns), at the value that leaves the policy's own softmax at the sampling temperature, the distribution
#: the trainer scores. ``generate`` takes every setting its config leaves unset from the checkpoint's
#: ``generation_config.json``, and checkpoints set some: Qwen2.5's instruct models a ``repetition_penalty`` of 1.05-1.1.
NEUTRAL_GENERATION = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "min_length": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "guidance_scale": 1.0, "penalty_alpha": 0.0, "renormalize_logits": False, "remove_invalid_values": False,
    "num_beams": 1, "num_return_sequences": 1, "return_dict_in_generate": False, "use_mtp": False,
    "token_healing": False,
}  # fmt: skip
#: Such settings that the engine cannot set neutral: they are off at None, which ``generate`` fills from the
#: checkpoint, or at the value given, which adds work at every token (``min_p=0``: a pass over the vocabulary;
#: ``min_new_tokens=0``: a minimum length, the prompt's). A checkpoint that sets one to any other value is refused.
REFUSED_GENERATION = {
    "min_new_tokens": 0, "min_p": 0.0, "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None, "top_h": None, "watermarking_config": None, "max_time": None,
    "stop_strings": None, "dola_layers": None, "prompt_lookup_num_tokens": None, "assistant_early_exit": None,
    "constraints": None, "force_words_ids": None,
}  # fmt: skip


def grouped_prompts(
    prompt_ids: list[list[int]], n: int, pad_id: int, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor, Tensor]:
    """Each prompt's token list ``n`` times in a row, as ``ids[B, P]`` left-padded with ``pad_id``, ``mask[B, P]``
    and ``group[B]`` (the prompt's index), ``B = n * len(prompt_ids)``, on ``device``. Built on the host from one row
    per prompt (building all ``B`` rows from lists took about three times as long), repeated there, and copied to the
    device as one flat buffer, of which the three are contiguous views: one transfer, no kernel on the device."""
    width = max(len(s) for s in prompt_ids)
    ids = [[pad_id] * (width - len(s)) + list(s) for s in prompt_ids]
    mask = [[0] * (width - len(s)) + [1] * len(s) for s in prompt_ids]
    rows = torch.tensor([ids, mask], dtype=torch.long).repeat_interleave(n, 1)  # [2, B, P]
    group = torch.arange(len(prompt_ids)).repeat_interleave(n)  # [B]
    flat = torch.cat([rows.view(-1), group]).to(device)  # [2 B P + B]
    size = rows[0].numel()
    return flat[:size].view(rows.shape[1:]), flat[size : 2 * size].view(rows.shape[1:]), flat[2 * size :]


def completion_mask(completion_ids: Tensor, eos_id: int) -> tuple[Tensor, Tensor]:
    """``mask[B, T]`` of generated tokens up to and including the first EOS, and ``truncated[B]`` (no EOS): with
    ``seen[t]`` the EOS tokens at positions ``<= t``, a token is kept while ``seen[t] <= is_eos[t]`` (0 before the
    first EOS, 1 on it, more than ``is_eos`` after it)."""
    is_eos = (completion_ids == eos_id).long()
    seen = is_eos.cumsum(1)  # [B, T]
    return (seen <= is_eos).long(), seen[:, -1] == 0


class HFEngine(RolloutEngine):
    """Sampling with ``model.generate`` (KV cache, EOS stopping), log-probs from one extra forward pass.

    The sampled tokens' log-probs (when asked for) come from one extra forward pass through the trainer's
    ``TokenScorer``, at the sampling temperature, so they equal the trainer's old-policy log-probs up to kernel
    nondeterminism.

    Args:
        sampling: temperature, top-p, top-k and the completion budget (``max_new_tokens``).
        batch_size: prompts x samples generated per ``generate`` call (None: all at once).
    """

    shares_policy_weights = True

    def __init__(self, *, sampling: Sampling | None = None, batch_size: int | None = None) -> None:
        self.sampling = sampling_or_default(sampling, "HFEngine")
        if batch_size is not None and batch_size < 1:
            raise ValueError(
                f"model.engine.init_args.batch_size={batch_size} must be >= 1, or null to generate in one call."
            )
        self.batch_size = batch_size
        self.policy: PreTrainedModel | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.scorer: TokenScorer | None = None

    def setup(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        check_generation_config(policy)
        # transformers warns at every generate call that max_new_tokens (the engine's budget) wins over a max_length
        # the checkpoint's generation config sets (Llama 2's chat models set 4096), and that its min_new_tokens wins
        # over the engine's min_length of 0: both as the engine means.
        drop_messages("transformers.generation.utils", "Both `max_new_tokens`", "Both `min_new_tokens`")
        self.policy, self.tokenizer = policy, tokenizer
        self.scorer = TokenScorer(policy, temperature=self.sampling.temperature)
        self.generation_configs: dict[tuple[Sampling, bool], GenerationConfig] = {}

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer)

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
        if self.policy is None:
            raise RuntimeError("HFEngine.generate called before setup(policy, tokenizer).")
        sampling = sampling or self.sampling
        device = self.policy.device
        ids, mask, group = grouped_prompts(prompt_ids, n, self.pad_id, device)  # [B, P], [B, P], [B]
        step = self.batch_size or ids.shape[0]
        rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else []) if seed is not None else None
        # Sampled in inference mode (no_grad under FSDP2), whose tensors may not be saved for backward: none leaves
        # this function, masked_fill below copies them.
        with rng or contextlib.nullcontext(), training_mode(self.policy, False), sampling_mode(self.policy):
            if seed is not None:
                seed_generator(seed, device)
            config = self._generation_config(sampling, greedy)
            chunks = [self._sample(ids[i : i + step], mask[i : i + step], config) for i in range(0, len(ids), step)]
        completion = chunks[0] if len(chunks) == 1 else _right_pad(chunks, self.pad_id)  # [B, T]
        completion_mask_, truncated = completion_mask(completion, self.eos_id)
        completion = completion.masked_fill(completion_mask_ == 0, self.pad_id)  # a normal tensor again
        rollout = Rollout(ids, mask, completion, completion_mask_, truncated, group)
        if logprobs:
            scorer = self.scorer
            if sampling.temperature != self.sampling.temperature:
                scorer = TokenScorer(self.policy, temperature=sampling.temperature)
            rollout.logp = scorer.policy_logp(rollout).masked_fill(completion_mask_ == 0, 0.0)
        return rollout

    def _generation_config(self, sampling: Sampling, greedy: bool) -> GenerationConfig:
        """The policy's own generation config (its token ids, cache settings) with ``sampling`` over it, every setting
        that would change the sampled distribution neutral (``NEUTRAL_GENERATION``) and the KV cache on, built once
        per setting: given none, every ``generate`` call rebuilds and re-validates one (about 2 ms each)."""
        key = (sampling, greedy)
        if key not in self.generation_configs:
            s, base = sampling, self.policy.generation_config
            config = copy.deepcopy(base) if base is not None else GenerationConfig()
            # use_cache: a checkpoint saved from a run with gradient checkpointing often has use_cache false in its
            # config, from which its generation config takes it: each token would re-run the whole sequence.
            config.update(**NEUTRAL_GENERATION, max_new_tokens=s.max_new_tokens, eos_token_id=self.eos_id,
                          pad_token_id=self.pad_id, use_cache=True)  # fmt: skip
            sampled = {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}
            config.update(**({"do_sample": False} if greedy else sampled))
            self.generation_configs[key] = config
        return self.generation_configs[key]

    def _sample(self, ids: Tensor, mask: Tensor, config: GenerationConfig) -> Tensor:
        return self.policy.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]


def check_generation_config(policy: PreTrainedModel) -> None:
    """Refuse a policy whose generation config sets one of ``REFUSED_GENERATION`` to a value that acts: ``generate``
    would apply it, and the completions would come from another distribution than the policy the trainer scores."""
    config = policy.generation_config
    values = {name: getattr(config, name) for name in REFUSED_GENERATION} if config is not None else {}
    active = {name: value for name, value in values.items() if value not in (None, REFUSED_GENERATION[name])}
    if active:
        settings = ", ".join(f"{name}={value!r}" for name, value in active.items())
        folder = f" ({policy.name_or_path})" if policy.name_or_path else ""
        raise ValueError(
            f"the policy's generation config sets {settings}, which transformers' generate would apply when HFEngine "
            "samples: the completions would not come from the policy the trainer scores. Remove it from the "
            f"generation_config.json of the policy's folder{folder}, or set it to None in the generation_config of a "
            "loaded policy."
        )


def seed_generator(seed: int, device: torch.device) -> None:
    """Seed the generator that samples on ``device`` (CPU: torch's default; CUDA: that device's). Unlike
    ``torch.manual_seed``, it queues no lazy seeding of devices that are not in use (each such call records a stack
    trace: several milliseconds per call on a CPU-only machine)."""
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)


def _right_pad(chunks: list[Tensor], pad_id: int) -> Tensor:
    width = max(c.shape[1] for c in chunks)
    padded = [torch.nn.functional.pad(c, (0, width - c.shape[1]), value=pad_id) for c in chunks]
    return torch.cat(padded, 0)
