"""Package discovery (the metadata is in pyproject.toml): every package under gpo/, found rather than listed, plus
two of the repository's top-level folders installed inside gpo: callbacks/ as gpo.callbacks (there is no top-level
``callbacks`` package) and configs/ as gpo.configs (the shipped YAML presets, which ``gpo fit --config NAME`` finds by
name)."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["gpo", "gpo.*"]), "gpo.callbacks", "gpo.configs"],
    package_dir={"gpo.callbacks": "callbacks", "gpo.configs": "configs"},
    package_data={"gpo.configs": ["*.yaml"]},
)
