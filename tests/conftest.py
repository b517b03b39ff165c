import pytest
import torch

# Tiny models run fastest on one thread, and two threads on two busy cores can be many times slower.
torch.set_num_threads(1)

#: The slowest test files, longest first (seconds of one worker on the 2-core machine, summed over their tests, at
#: 82c5f3e: 152, 124, 111, 81, 73, 57, 50, 44). They run before all others, so that under `-n 2 --dist loadfile`,
#: which hands out whole files in collection order (`--no-loadscope-reorder` in pyproject.toml), the two workers end
#: within a small file of each other instead of one of them running a long file alone at the end.
SLOWEST_FIRST = (
    "tests/parallel/test_ddp_fit.py",
    "tests/test_configs_learn.py",
    "tests/reliability/test_resume.py",
    "tests/models/test_smollm2.py",
    "tests/train/test_presets_learn.py",
    "tests/test_configs.py",
    "tests/rollout/test_vllm_server.py",
    "tests/test_quickstart_vllm.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: position for position, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Run every test in its own folder, so runs that default to the working directory never write the repo."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> tuple[str, str]:
    """A tiny random model and 500 sort-digits prompts, written once per test session (see tests/tiny.py)."""
    from tests.tiny import write_assets

    return write_assets(tmp_path_factory.mktemp("tiny"))
