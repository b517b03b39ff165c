"""One seed sets the whole experiment: ``seed_everything`` alone changes the data order, the validation split, the
rollout sampling seeds and a LoRA adapter's initial weights; the same seed replays them all; ``data.seed`` and
``model.seed`` override it; no two purposes share a stream."""

import lightning as L
import pytest
import torch

from gpo.models.loading import LoraSettings, load_policy
from gpo.rollout import HFEngine
from gpo.seeds import stream_seed
from gpo.train.data import EpochOrder, PromptDraws, PromptLoader, collate
from tests.tiny import prompts, quiet_trainer, tiny_module, write_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return write_assets(tmp_path_factory.mktemp("seeds"), examples=40)


@pytest.fixture
def run_seed(monkeypatch):
    """``seed_everything``, with the run seed it exports (``PL_GLOBAL_SEED``) put back after the test."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    return L.seed_everything


def streams(assets, monkeypatch, *, data_seed=None, model_seed=None) -> dict[str, list]:
    """What a 3-step run draws: the prompts of each step, the seed of each sampling call, the held-out rows."""
    model, train = assets
    sampled = []
    generate = HFEngine.generate

    def spy(self, prompt_ids, n, *, seed=None, **kwargs):
        sampled.append((prompt_ids, seed))
        return generate(self, prompt_ids, n, seed=seed, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", spy)
    module = tiny_module(model, seed=model_seed)
    data = prompts(model, train, val_size=8, seed=data_seed)
    quiet_trainer(3, limit_val_batches=0).fit(module, data)
    return {
        "prompts": [ids for ids, _ in sampled],
        "seeds": [seed for _, seed in sampled],
        "held_out": [row["prompt"] for row in data.val_rows],
    }


def test_seed_everything_alone_sets_data_order_split_and_sampling(assets, monkeypatch, run_seed):
    run_seed(1)
    first = streams(assets, monkeypatch)
    run_seed(1)
    assert streams(assets, monkeypatch) == first  # the same seed replays every stream
    run_seed(2)
    other = streams(assets, monkeypatch)
    assert len(first["seeds"]) == 3 and None not in first["seeds"]
    for stream in ("prompts", "seeds", "held_out"):
        assert other[stream] != first[stream], stream


def test_data_seed_and_model_seed_override_the_run_seed(assets, monkeypatch, run_seed):
    run_seed(1)
    chosen = streams(assets, monkeypatch, data_seed=7, model_seed=7)
    run_seed(2)
    assert streams(assets, monkeypatch, data_seed=7, model_seed=7) == chosen
    run_seed(7)
    assert streams(assets, monkeypatch) == chosen  # the override is the run seed it names, no other derivation


def test_a_lora_adapter_starts_from_the_run_seed(assets, run_seed):
    def adapter(seed: int) -> dict[str, torch.Tensor]:
        run_seed(seed)
        policy = load_policy(assets[0], dtype="float32", mode="lora", lora=LoraSettings(r=2))
        return {name: p.detach().clone() for name, p in policy.named_parameters() if p.requires_grad}

    first, again, other = adapter(1), adapter(1), adapter(2)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert any(not torch.equal(first[name], other[name]) for name in first)


def test_no_two_purposes_share_a_stream():
    # With `seed + epoch` (as before) data seed 0's epoch 1 was data seed 1's epoch 0, and the extra draws' pass k
    # replayed training epoch k + 1: every purpose now hashes its own name in.
    rows = [{"prompt_ids": [i], "prompt": str(i)} for i in range(64)]
    assert EpochOrder(64, 0).order(1) != EpochOrder(64, 1).order(0)
    loader = PromptLoader(rows, 64, seed=3, batches_trained=lambda: 0)  # one batch per pass
    draws = PromptDraws(loader, seed=3)
    extra_passes = [next(draws)["prompt"] for _ in range(3)]
    epochs = [[rows[i]["prompt"] for i in loader.order.order(epoch)] for epoch in range(4)]
    assert not any(drawn in epochs for drawn in extra_passes)
    purposes = [("rollout", 0, 0, 0), ("data/order", 0), ("data/val_split",), ("data/draws", 0), ("data/workers",)]
    assert len({stream_seed(name, 3, *rest) for name, *rest in purposes}) == len(purposes)


def test_extra_draws_from_an_iterable_dataset_go_on_through_it_then_start_again():
    class Numbers(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(5))

    draws = PromptDraws(torch.utils.data.DataLoader(Numbers(), batch_size=2), seed=3)
    assert [next(draws).tolist() for _ in range(5)] == [[0, 1], [2, 3], [4], [0, 1], [2, 3]]
    assert draws.drawn == 5


def test_extra_draws_pass_over_the_dataset_whatever_the_loaders_own_sampler_draws():
    """The passes are over the dataset's rows: a loader whose sampler draws more (8 of 4 rows, with replacement)
    must not make a draw run past the end of a pass (a StopIteration there ends Lightning's epoch)."""
    rows = [{"prompt_ids": [i], "prompt": str(i)} for i in range(4)]
    sampler = torch.utils.data.RandomSampler(rows, replacement=True, num_samples=8)
    draws = PromptDraws(torch.utils.data.DataLoader(rows, batch_size=2, sampler=sampler, collate_fn=collate), seed=3)
    passes = [sorted(p for _ in range(2) for p in next(draws)["prompt"]) for _ in range(3)]
    assert passes == [["0", "1", "2", "3"]] * 3
