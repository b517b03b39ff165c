"""gpo: group-based policy optimisation (GRPO and its family) for language models on PyTorch Lightning."""

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, homes: dict[str, str], namespace: Mapping[str, object] | None = None
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """A package's ``__getattr__``, ``__dir__`` and ``__all__`` (PEP 562) for the names ``homes`` maps to the modules
    that define them: each is imported on first use, so importing ``package`` costs nothing its user does not take,
    and ``dir()``, tab completion and ``help()`` list them beside the names of ``namespace`` (its ``globals()``)."""

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)

    def __dir__() -> list[str]:
        return sorted({*(namespace or {}), *homes})

    return __getattr__, __dir__, sorted(homes)


__getattr__, __dir__, __all__ = lazy_exports(
    "gpo",
    {"GPOModule": "gpo.train.module", "Optimization": "gpo.train.optimization", "PromptDataModule": "gpo.train.data"},
    globals(),
)
