"""The wheel holds every module of gpo/, the repository's callbacks/ as gpo.callbacks, its configs/ as gpo.configs and
the ``gpo`` command (.ci/run installs the wheel in a fresh environment and runs the quickstart from it); every package
gpo imports when its modules load is installed with gpo, not only beside it."""

import ast
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["setup.py", "pyproject.toml", "README.md", "gpo", "callbacks", "configs"]  # as .ci/run copies them


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:  # a copy, so that the repository gets no build/ folder
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, src / name)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, src]
    subprocess.run(command, check=True, capture_output=True)
    (built,) = dist.glob("gpo-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_holds_every_module_the_callbacks_and_the_configs(wheel):
    names = set(wheel.namelist())
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "gpo").rglob("*.py") if "__pycache__" not in p.parts}
    assert modules <= names, sorted(modules - names)
    callbacks = {f"gpo/callbacks/{p.name}" for p in (REPO / "callbacks").glob("*.py")}
    assert callbacks <= names, sorted(callbacks - names)
    configs = {f"gpo/configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")} | {"gpo/configs/__init__.py"}
    assert configs <= names, sorted(configs - names)


def test_the_wheel_installs_the_gpo_command(wheel):
    (entry_points,) = [name for name in wheel.namelist() if name.endswith(".dist-info/entry_points.txt")]
    assert "gpo = gpo.cli:run" in wheel.read(entry_points).decode()


def loaded_imports(statements: list[ast.stmt]) -> Iterator[str]:
    """The top-level names of the absolute imports that run when a module loads: in its statements and the blocks
    they hold, class bodies included, but not in functions (gpo imports optional packages such as vLLM there), under
    ``if TYPE_CHECKING:`` or in a ``try`` that catches ImportError (an optional import)."""
    for node in statements:
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split(".")[0]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from loaded_imports(node.orelse)
        elif isinstance(node, ast.Try) and any(_catches_import_error(handler) for handler in node.handlers):
            continue
        else:
            for block in ("body", "orelse", "finalbody", "handlers", "cases"):
                yield from loaded_imports(getattr(node, block, []))


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    return handler.type is not None and "ImportError" in ast.unparse(handler.type)


def test_every_package_gpo_imports_on_load_is_one_of_its_own_requirements():
    """A package that another requirement happens to bring (vLLM brought httpx, which gpo imported) would stop
    ``import gpo...`` for a user whose install resolves without it: what gpo imports, it declares."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib (Python 3.11+) reads pyproject.toml")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {canonicalize_name(Requirement(line).name) for line in project["dependencies"]}
    owners, missing = importlib.metadata.packages_distributions(), {}
    for path in sorted([*(REPO / "gpo").rglob("*.py"), *(REPO / "callbacks").rglob("*.py")]):
        for module in loaded_imports(ast.parse(path.read_text()).body):
            if module in ("gpo", "__future__") or module in sys.stdlib_module_names:
                continue
            if not {canonicalize_name(d) for d in owners.get(module, [module])} & declared:
                missing.setdefault(module, path.relative_to(REPO).as_posix())
    assert not missing, f"imported when gpo loads but not in pyproject.toml's dependencies: {missing}"
