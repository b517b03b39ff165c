"""The names a package imports on first use (``gpo.lazy_exports``) are listed by ``dir()``, so tab completion and
``help()`` show them before any is used."""

import importlib

import pytest


@pytest.mark.parametrize("package", ["gpo", "gpo.callbacks", "gpo.rollout"])
def test_dir_lists_every_name_imported_on_first_use(package):
    module = importlib.import_module(package)
    assert set(module.__all__) <= set(dir(module)), sorted(set(module.__all__) - set(dir(module)))
