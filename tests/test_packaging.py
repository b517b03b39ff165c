"""The wheel holds every module of gpo/, the repository's callbacks/ as gpo.callbacks, its configs/ as gpo.configs and
the ``gpo`` command (.ci/run installs the wheel in a fresh environment and runs the quickstart from it); every package
gpo imports when its modules load is installed with gpo, not only beside it."""

import ast
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
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


def module_level_imports(folder: Path) -> dict[str, str]:
    """The top-level names of the absolute imports each module of ``folder`` runs when it loads (its own statements
    and their ``try`` blocks: not those inside functions, which gpo keeps for optional packages such as vLLM), with
    a file that imports each."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        for statement in ast.parse(path.read_text()).body:
            for node in statement.body if isinstance(statement, ast.Try) else [statement]:
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                found |= {name.split(".")[0]: path.relative_to(REPO).as_posix() for name in names}
    return found


def installed_with(distribution: str) -> set[str]:
    """``distribution`` and what its requirements pull in, recursively, without extras (as ``pip install`` does)."""
    seen, todo = set(), [canonicalize_name(distribution)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requirements = [Requirement(line) for line in importlib.metadata.requires(name) or []]
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here, so nothing gpo imports comes from it
        wanted = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
        todo += [canonicalize_name(r.name) for r in wanted]
    return seen


def test_every_package_gpo_imports_on_load_comes_with_gpos_own_requirements():
    """A package that only another install brings (vLLM brought httpx) would stop ``import gpo...`` for a user who
    installed gpo alone."""
    provided, owners = installed_with("gpo"), importlib.metadata.packages_distributions()
    imported = module_level_imports(REPO / "gpo") | module_level_imports(REPO / "callbacks")
    own = {"gpo", "__future__", *sys.stdlib_module_names}
    third_party = {module: where for module, where in imported.items() if module not in own}
    missing = {
        module: where for module, where in third_party.items()
        if not {canonicalize_name(d) for d in owners.get(module, [])} & provided
    }  # fmt: skip
    assert not missing, f"imported by gpo but not in its requirements' closure: {missing}"
