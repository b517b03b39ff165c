"""Loading the policy for training (from a folder, a hub id or a GGUF model): full fine-tuning, LoRA, or QLoRA (4-bit
base + LoRA, GPU only)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import huggingface_hub
import torch
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TokenizersBackend,
)
from transformers.pytorch_utils import Conv1D

from gpo.models import gguf_cache
from gpo.suggest import closest_file, did_you_mean

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "gpt2", "Qwen/Qwen3-4B"
HUB_TIMEOUT_S = 5.0  # the one request asking the hub whether a model id exists
TrainerMode = Literal["full", "lora", "qlora"]
DType = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapter settings (peft).

    Args:
        r: rank of the update matrices.
        alpha: scaling numerator (the update is scaled by ``alpha / r``).
        dropout: dropout on the adapter input, active only in the gradient pass (sampling and old/reference
            log-probs run without dropout).
        target_modules: module names to adapt; None adapts every linear layer except the output layer.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.1
    target_modules: list[str] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"model.lora.r={self.r} must be >= 1 (16 is usual).")
        if not self.alpha > 0:
            raise ValueError(f"model.lora.alpha={self.alpha} must be > 0 (the update is scaled by alpha / r).")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora.dropout={self.dropout} must be in [0, 1) (0 disables it).")


def check_pretrained_folder(path: str, field: str, kind: Literal["model", "tokenizer"]) -> None:
    """Refuse a local ``path`` that does not exist or lacks ``kind``'s files, and a hub id (``org/name``) that is
    neither in the hub cache nor known to the hub (``check_hub_id``). A GGUF model (``gpo.models.gguf_cache``) is
    checked for its file and, until it has been converted, for the ``gguf`` package; it carries both the model and
    its tokenizer."""
    if gguf_cache.is_gguf_source(path):
        if not gguf_cache.cached_folder(gguf_cache.gguf_file(path, field)).is_dir():
            gguf_cache.require_gguf(path, field)
        return
    folder = Path(path).expanduser()
    if not folder.exists():
        if _HUB_ID.match(path):
            check_hub_id(path, field, kind)
            return
        guess = closest_file(folder)
        target = (f"{field} at a folder written by save_pretrained (`gpo tiny DIR` writes a tiny one to DIR/model), "
                  "a .gguf file, or a GGUF model shipped in a package (package:file.gguf); relative paths start from "
                  "the working directory.")  # fmt: skip
        missing = f"{field}={path!r}: no such folder (looked for {folder.absolute()})"
        raise FileNotFoundError(
            f"{missing}; {guess} Otherwise point {target}" if guess else f"{missing}. Point {target}"
        )
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{field}={path!r} is a file, not a .gguf model; give the folder that holds it (save_pretrained's)."
        )
    if kind == "model" and not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{field}={path!r} has no config.json, so it is not a transformers model folder; point {field} at the "
            f"folder written by model.save_pretrained."
        )
    if kind == "tokenizer" and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{field}={path!r} holds no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}); save the "
            "tokenizer into that folder with tokenizer.save_pretrained(folder)."
        )


#: The HTTP errors of the client the hub library talks through (httpx's before huggingface_hub 2, httpx2's since; a
#: failed connection is one): the base its own ``HfHubHTTPError`` extends, so that gpo imports neither package.
HUB_CLIENT_ERROR = HfHubHTTPError.__mro__[1]


def check_hub_id(path: str, field: str, kind: Literal["model", "tokenizer"]) -> None:
    """Refuse at once a hub id that the local hub cache does not hold and the hub does not know, asked once with
    a ``HUB_TIMEOUT_S`` limit: a misspelt local folder often looks like a hub id, and transformers would retry the
    hub for about a minute before failing. Offline (``HF_HUB_OFFLINE=1``) only the cache is looked at."""
    wanted = ("config.json",) if kind == "model" else TOKENIZER_FILES
    try:
        if any(isinstance(huggingface_hub.try_to_load_from_cache(path, name), str) for name in wanted):
            return
    except HFValidationError:
        raise FileNotFoundError(_not_found(path, field, "is not a valid hub id either")) from None
    if huggingface_hub.is_offline_mode():
        raise FileNotFoundError(
            _not_found(path, field, "is not in the hub cache, and the hub is off (HF_HUB_OFFLINE is set)")
        )
    try:
        huggingface_hub.model_info(path, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return  # it exists: the download says what access it needs
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            _not_found(path, field, "no model on the hub has that id (a private one needs HF_TOKEN)")
        ) from None
    except HfHubHTTPError:
        return  # the hub answered with another error (a 5xx, a rate limit): the download retries it
    except (OSError, HUB_CLIENT_ERROR) as err:
        reason = f"the hub could not be reached to look it up ({type(err).__name__}: {err})"
        raise FileNotFoundError(_not_found(path, field, reason)) from None


def _not_found(path: str, field: str, reason: str) -> str:
    """The message for a ``path`` that is no local folder and cannot be loaded from the hub, for ``reason``."""
    return (
        f"{field}={path!r} is not a local folder (looked for {Path(path).absolute()}) and {reason}; point it at a "
        f"folder written by save_pretrained (`gpo tiny DIR` writes a tiny one to DIR/model), a .gguf file, or a GGUF "
        f"model shipped in a package (package:file.gguf)."
    )


def pretrained_path(path: str, field: str) -> str:
    """What ``from_pretrained`` loads for ``path``: the converted folder of a GGUF model (converting it on first
    use), a local folder as an absolute path (the model remembers it as its ``name_or_path``, which an exported LoRA
    adapter's ``base_model_name_or_path`` records: a relative one would load only from the run's working directory),
    else ``path`` itself (a hub id)."""
    if gguf_cache.is_gguf_source(path):
        return str(gguf_cache.converted_folder(path, field))
    return str(Path(path).resolve()) if Path(path).is_dir() else path


def load_tokenizer(path: str, field: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``path`` (a folder, hub id or GGUF model) as it was saved; ``field`` names the config key in
    errors.

    transformers 5 picks the tokenizer class from the model type, and some classes rebuild the pipeline from the
    vocabulary alone: every ``qwen2`` folder gets ``Qwen2Tokenizer``'s byte-level BPE, which drops the spaces of a
    character vocabulary. Where the pipeline built differs from the folder's ``tokenizer.json`` (model type,
    normaliser, pre-tokeniser or decoder), that file is loaded as saved instead, so training, ``ExportPolicy`` and
    ``gpo export`` keep the tokenizer the folder holds.
    """
    source = pretrained_path(path, field)
    tokenizer = AutoTokenizer.from_pretrained(source)
    saved = Path(source, "tokenizer.json")
    if isinstance(tokenizer, TokenizersBackend) and saved.is_file():
        built = _pipeline(json.loads(tokenizer.backend_tokenizer.to_str()))
        if built != _pipeline(json.loads(saved.read_text(encoding="utf-8"))):
            return TokenizersBackend.from_pretrained(source)
    return tokenizer


def _pipeline(tokenizer_json: dict) -> tuple:
    """What turns text into ids and back in a ``tokenizer.json``, its vocabulary aside."""
    parts = ("normalizer", "pre_tokenizer", "decoder")
    return (tokenizer_json["model"].get("type"), *(tokenizer_json.get(part) for part in parts))


def check_trainer_mode(mode: str) -> None:
    """Refuse unknown modes, and QLoRA where it cannot run, before any weights are loaded."""
    if mode not in ("full", "lora", "qlora"):
        raise ValueError(f"model.trainer_mode={mode!r} is not valid; choose 'full', 'lora' or 'qlora'.")
    if mode == "qlora":
        if not torch.cuda.is_available():
            raise ValueError(
                "model.trainer_mode='qlora' needs a CUDA GPU (4-bit bitsandbytes kernels); on CPU use "
                "trainer_mode='lora'."
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("model.trainer_mode='qlora' needs bitsandbytes: pip install bitsandbytes.")


def load_policy(
    path: str, *, dtype: DType, mode: TrainerMode, lora: LoraSettings | None, field: str = "model.policy"
) -> PreTrainedModel:
    """The trainable policy: the model itself (``full``) or a peft model with a LoRA adapter. ``path`` is a
    transformers folder, a hub id, or a GGUF model (loaded from its converted folder, see ``pretrained_path``);
    ``field`` names the setting in error messages."""
    check_trainer_mode(mode)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"model.dtype={dtype!r} is not valid; choose 'float32', 'bfloat16' or 'float16'.")
    kwargs = {"dtype": getattr(torch, dtype)}
    if mode == "qlora":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=getattr(torch, dtype)
        )
    source = pretrained_path(path, field)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as err:
        if Path(path).exists():
            raise
        raise FileNotFoundError(_not_found(path, field, f"could not be loaded as a hub model id ({err})")) from err
    return model if mode == "full" else add_lora(model, lora or LoraSettings(), quantized=mode == "qlora")


def prepared_policy(model: PreTrainedModel, mode: TrainerMode, lora: LoraSettings | None) -> PreTrainedModel:
    """A policy given loaded, made what ``mode`` trains: with ``lora``, a LoRA adapter added unless it is a peft model
    already (then its own adapter trains, as it does whatever ``mode`` says). ``qlora`` loads the base in 4 bits from
    its folder, so it needs one."""
    if mode == "qlora":
        raise ValueError("model.trainer_mode='qlora' loads the base model in 4 bits from its folder: give model.policy "
                         "as a folder, not a loaded model (or use trainer_mode: lora).")  # fmt: skip
    check_trainer_mode(mode)
    if mode == "lora" and not is_peft(model):
        return add_lora(model, lora or LoraSettings())
    return model


def add_lora(model: PreTrainedModel, settings: LoraSettings, *, quantized: bool = False) -> PreTrainedModel:
    """Wrap ``model`` in a peft model with a fresh LoRA adapter; only the adapter trains."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    check_target_modules(model, settings.target_modules)
    if quantized:
        model = prepare_model_for_kbit_training(model)
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules or "all-linear",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def check_target_modules(model: torch.nn.Module, targets: list[str] | None) -> None:
    """Refuse a ``model.lora.target_modules`` entry that names no module of ``model`` (as peft matches a name: the
    whole module path, or its last parts after a dot), listing the names its linear layers go by."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets or () if not any(name == t or name.endswith("." + t) for name in names)]
    if missing:
        layers = (nn.Linear, Conv1D)  # Conv1D: GPT-2's linear layers
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, layers)})
        guess = did_you_mean(missing[0], linear)
        raise ValueError(
            f"model.lora.target_modules: {missing} names no module of the model{'; ' + guess if guess else '.'} Its "
            f"linear layers are named {linear} (leave target_modules out to adapt them all but the output layer)."
        )


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def unwrap(model: PreTrainedModel) -> PreTrainedModel:
    """The transformers model to run: a peft model's base model with its adapter layers injected and active."""
    return model.get_base_model() if is_peft(model) else model


@contextlib.contextmanager
def training_mode(model: torch.nn.Module, training: bool) -> Iterator[torch.nn.Module]:
    """Run a block with ``model.train(training)``, restoring the previous mode afterwards. A model already in that
    mode is left alone: switching walks every submodule (milliseconds per call for a large model)."""
    was_training = model.training
    if was_training != training:
        model.train(training)
    try:
        yield model
    finally:
        if was_training != training:
            model.train(was_training)


@contextlib.contextmanager
def adapter_disabled(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """The reference policy of a LoRA run: the same weights with the adapter switched off (no second copy)."""
    with model.disable_adapter():
        yield unwrap(model)
