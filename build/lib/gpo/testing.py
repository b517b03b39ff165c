"""Tiny models and tokenizers built locally, for tests, examples and the CPU quickstart (no hub access)."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

Architecture = Literal["llama", "qwen2", "qwen2_moe"]
PAD, EOS = "<pad>", "<|endoftext|>"
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per printable ASCII character, plus ``<pad>`` (0) and EOS (1)."""
    vocab = {token: i for i, token in enumerate([PAD, EOS, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=PAD)


def tiny_config(
    arch: Architecture = "llama", *, vocab_size: int, hidden_size: int = 64, num_layers: int = 2
) -> PretrainedConfig:
    """A small decoder config. Head size 32 (two heads at hidden 64), which vLLM's CPU kernels accept."""
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": hidden_size // 32,
        "num_key_value_heads": hidden_size // 32,
        "head_dim": 32,
        "max_position_embeddings": 256,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": None,
        "tie_word_embeddings": True,
    }
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            shared_expert_intermediate_size=hidden_size,
        )
    raise ValueError(f"arch={arch!r} is not valid; choose 'llama', 'qwen2' or 'qwen2_moe'.")


def tiny_model(arch: Architecture = "llama", *, seed: int = 0, **config_kwargs) -> PreTrainedModel:
    """A randomly initialised tiny causal LM sized for ``char_tokenizer``."""
    config = tiny_config(arch, vocab_size=len(char_tokenizer()), **config_kwargs)
    model_class = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM}[arch]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return model_class(config)


def save_tiny_model(path: str | Path, arch: Architecture = "llama", *, seed: int = 0, **config_kwargs) -> Path:
    """Write a tiny model and its tokenizer to ``path`` as a transformers folder; returns the path.

    Load it back with ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)``.
    The default ``llama`` architecture round-trips the character tokenizer exactly through ``AutoTokenizer``
    (transformers maps a ``qwen2`` folder to ``Qwen2Tokenizer``, which drops the spaces of a character
    vocabulary; load those with ``PreTrainedTokenizerFast.from_pretrained``).
    """
    path = Path(path)
    tiny_model(arch, seed=seed, **config_kwargs).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path
