"""Package discovery (the metadata is in pyproject.toml): every package under gpo/, found rather than listed, plus
the repository's callbacks/ folder installed as gpo.callbacks (there is no top-level ``callbacks`` package)."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["gpo", "gpo.*"]), "gpo.callbacks"],
    package_dir={"gpo.callbacks": "callbacks"},
)
