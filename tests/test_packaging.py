"""The wheel holds every module of gpo/, the repository's callbacks/ as gpo.callbacks, its configs/ as gpo.configs and
the ``gpo`` command (.ci/run installs the wheel in a fresh environment and runs the quickstart from it)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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
