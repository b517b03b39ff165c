import pytest
import torch

# Tiny models run fastest on one thread, and two threads on two busy cores can be many times slower.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Run every test in its own folder, so runs that default to the working directory never write the repo."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> tuple[str, str]:
    """A tiny random model and 500 sort-digits prompts, written once per test session (see tests/tiny.py)."""
    from tests.tiny import write_assets

    return write_assets(tmp_path_factory.mktemp("tiny"))
