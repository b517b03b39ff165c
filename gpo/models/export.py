"""Saving the trained policy as a transformers folder (weights + tokenizer) that transformers and vLLM load."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.models.loading import is_peft, unwrap

EXPORT_MARK = "gpo_export.json"  # in every folder an export writes: the mark of a folder a later export may replace


def check_export_folder(folder: str | Path, field: str) -> Path:
    """``folder`` as an absolute path, if an export may write it: absent, empty, or an earlier export (it holds
    ``EXPORT_MARK``), which the export replaces whole. Any other folder is refused (``field`` names the setting):
    replacing it would delete its files."""
    folder = Path(folder).resolve()
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{field}: {folder} is a file; give a folder to export into.")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / EXPORT_MARK).is_file():
        raise FileExistsError(
            f"{field}: {folder} holds files that no gpo export wrote, and an export replaces its folder whole: choose "
            "a new or empty folder."
        )
    return folder


def export_policy(
    policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: str | Path, *, merge: bool = True
) -> Path:
    """Write ``policy`` and ``tokenizer`` to ``folder`` with ``save_pretrained``; returns the folder.

    A LoRA policy is saved merged into its base weights (``merge=True``: a plain model folder) or as the
    adapter alone (``merge=False``: load it with peft on top of the base model); the training model itself is
    left untouched. The folder appears whole or not at all: files go to a sibling temporary folder first. An earlier
    export in ``folder`` is replaced; a folder holding anything else is refused (``check_export_folder``).
    ``tokenizer`` is saved as it is: load it with ``gpo.models.loading.load_tokenizer``, which keeps the pipeline
    of the folder's ``tokenizer.json``, and the exported folder tokenizes as the input folder did.
    """
    folder = check_export_folder(folder, "export folder")
    partial = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = policy
    if is_peft(policy) and merge:
        model = copy.deepcopy(policy).merge_and_unload()
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    mark = {"written_by": "gpo export", "adapter_only": is_peft(policy) and not merge}
    (partial / EXPORT_MARK).write_text(json.dumps(mark) + "\n", encoding="utf-8")
    if folder.exists():
        previous = folder.with_name(f".{folder.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        folder.rename(previous)
        partial.rename(folder)
        shutil.rmtree(previous)
    else:
        partial.rename(folder)
    return folder


def export_checkpoint(
    config: str | Path, checkpoint: str | Path, folder: str | Path, *, merge: bool = True, policy: str | None = None
) -> Path:
    """Export the policy of a Lightning checkpoint of a ``gpo fit`` run as a transformers folder.

    ``config`` is the run's saved ``config.yaml`` (it says which base model, trainer mode and LoRA settings
    to rebuild); ``policy`` overrides its ``model.policy`` path, e.g. when the run was started elsewhere.
    """
    from gpo.models.loading import LoraSettings, check_pretrained_folder, load_policy, load_tokenizer
    from gpo.train.checkpointing import load_checkpoint_file

    settings = _run_settings(Path(config))
    folder = check_export_folder(folder, "OUT")  # before the model loads
    if Path(checkpoint).is_dir():
        sharded = any(Path(checkpoint).glob("*.distcp"))
        raise ValueError(
            f"{checkpoint} is a folder of per-process shards (FSDP); gpo export reads a single-file checkpoint, which "
            "FSDP runs write with --trainer.strategy.init_args.save_distributed_checkpoint false."
            if sharded
            else f"{checkpoint} is a folder; give a .ckpt file (gpo export CONFIG CKPT OUT)."
        )
    if not Path(checkpoint).is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist (gpo export CONFIG CKPT OUT).")
    if not merge and settings.get("trainer_mode", "full") == "full":
        raise ValueError(f"--adapter: {config} trains the full model (trainer_mode: full), which has no adapter; "
                         "leave out --adapter.")  # fmt: skip
    path = policy or settings["policy"]
    try:
        check_pretrained_folder(path, "model.policy", "model")
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err} (gpo export: give the run's base model with --policy)") from None
    lora = LoraSettings(**settings["lora"]) if settings.get("lora") else None
    model = load_policy(
        path, dtype=settings.get("dtype", "float32"), mode=settings.get("trainer_mode", "full"), lora=lora
    )
    state = load_checkpoint_file(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    weights = {key.removeprefix("policy."): value for key, value in state.items() if key.startswith("policy.")}
    mismatch = f"{checkpoint} does not match the model {config} describes"
    fix = "give the config.yaml of the run that wrote the checkpoint (its lightning_logs/version_N/config.yaml)"
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as err:  # a weight of another shape: another LoRA rank, another model size
        shapes = [line.strip() for line in str(err).splitlines() if "size mismatch" in line]
        found = f"{len(shapes)} weights differ in shape, e.g. {shapes[0]}" if shapes else str(err).splitlines()[0]
        raise ValueError(f"{mismatch}: {found}; {fix}.") from None
    if unwrap(model).config.tie_word_embeddings:  # the output layer is the input embedding, saved once
        missing = [key for key in missing if not key.endswith("lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"{mismatch}: {len(missing)} weights missing (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. "
            f"{unexpected[:2]}); {fix}."
        )
    field = "model.tokenizer" if settings.get("tokenizer") else "model.policy"
    tokenizer = load_tokenizer(settings.get("tokenizer") or path, field)
    return export_policy(model, tokenizer, folder, merge=merge)


def _run_settings(config: Path) -> dict:
    """The ``model`` settings of a run's ``config.yaml``, or an error that says what ``gpo export`` expected."""
    import yaml

    usage = "gpo export takes the run's config.yaml, then a .ckpt file, then the folder to write"
    if config.suffix == ".ckpt":
        raise ValueError(f"{config} is a checkpoint, not a config: {usage} (gpo export CONFIG CKPT OUT).")
    try:
        settings = yaml.safe_load(config.read_text())
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"{config} is not a YAML config ({type(err).__name__}): {usage}.") from None
    if (
        not isinstance(settings, dict)
        or not isinstance(settings.get("model"), dict)
        or "policy" not in settings["model"]
    ):
        raise ValueError(f"{config} sets no model.policy: {usage} (lightning_logs/version_N/config.yaml).")
    return settings["model"]
