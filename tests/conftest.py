import pytest
import torch

# Tiny models run fastest on one thread, and two threads on two busy cores can be many times slower.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Run every test in its own folder, so runs that default to the working directory never write the repo."""
    monkeypatch.chdir(tmp_path)
