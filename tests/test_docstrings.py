"""Every class a user reaches with ``gpo fit --<key>.help CLASS`` opens its docstring with a one-line summary:
jsonargparse titles the class's settings with the docstring's first line alone."""

import importlib
import inspect

import pytest

#: The modules whose classes configs and docs name (parts, engines, callbacks, rewards, environments, settings).
MODULES = (
    "gpo.algo",
    "gpo.rollout",
    "gpo.rollout.vllm",
    "gpo.rollout.vllm_server",
    "gpo.callbacks",
    "gpo.rewards",
    "gpo.envs",
    "gpo.train.optimization",
    "gpo.train.evaluation",
    "gpo.models.loading",
    "gpo.parallel.fsdp",
)


def public_classes():
    for name in MODULES:
        module = importlib.import_module(name)
        for attribute in getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]:
            value = getattr(module, attribute, None)
            if inspect.isclass(value) and value.__module__.startswith("gpo"):
                yield pytest.param(value, id=f"{value.__module__}.{value.__qualname__}")


@pytest.mark.parametrize("cls", public_classes())
def test_a_public_class_opens_its_docstring_with_a_one_line_summary(cls):
    lines = (inspect.getdoc(cls) or "").splitlines()
    assert lines and lines[0].endswith(".") and (len(lines) == 1 or not lines[1]), lines[:2]
