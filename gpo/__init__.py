"""gpo: group-based policy optimisation (GRPO and its family) for language models on PyTorch Lightning."""

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, homes: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that imports each exported name from its home module on first use
    (PEP 562), so importing the package costs nothing its user does not take."""

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__


def lazy_dir(namespace: Mapping[str, object], homes: Mapping[str, str]) -> Callable[[], list[str]]:
    """A module ``__dir__`` (PEP 562) that lists the names ``lazy_exports`` imports on first use beside those of
    ``namespace`` (the module's ``globals()``), so ``dir()``, tab completion and ``help()`` show them."""

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __dir__


_HOMES = {
    "GPOModule": "gpo.train.module",
    "Optimization": "gpo.train.optimization",
    "PromptDataModule": "gpo.train.data",
}
__all__ = sorted(_HOMES)

__getattr__ = lazy_exports("gpo", _HOMES)
__dir__ = lazy_dir(globals(), _HOMES)
