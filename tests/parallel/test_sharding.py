"""What DDP relies on, checked in one process: each rank's share of an epoch, the fields checked against the number
of processes, and the collectives that do nothing (and return their input) when torch.distributed is not set up."""

from types import SimpleNamespace

import pytest
import torch

from gpo.algo.objective import LOSS_TOKENS, MASK_TOKENS, combine_statistics
from gpo.callbacks import DynamicSampling
from gpo.parallel import collectives
from gpo.train.data import EpochOrder, PromptDataModule
from gpo.train.hooks import RolloutSource
from gpo.train.preflight import check_minibatches
from tests.ports import free_port


def share(size: int, rank: int, world_size: int, seed: int = 0) -> list[int]:
    return list(EpochOrder(size, seed, rank=rank, world_size=world_size))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_ranks_batches_together_are_the_single_process_batch_and_so_are_their_minibatches(world_size):
    size, prompts, minibatches = 24, 8, 2  # a global batch of 8 prompts: 8 / world_size per rank
    single, per_rank = share(size, 0, 1), prompts // world_size
    for b in range(size // prompts):
        batches = [share(size, r, world_size)[b * per_rank : (b + 1) * per_rank] for r in range(world_size)]
        assert sorted(row for batch in batches for row in batch) == sorted(single[b * prompts : (b + 1) * prompts])
        for k in range(minibatches):  # minibatch k of each rank's share, together: the single process's minibatch k
            parts = [torch.tensor(batch).chunk(minibatches)[k].tolist() for batch in batches]
            first = b * prompts + k * prompts // minibatches
            assert sorted(row for part in parts for row in part) == sorted(
                single[first : first + prompts // minibatches]
            )


def test_an_epoch_that_does_not_divide_is_padded_by_its_first_rows_so_every_rank_has_as_many():
    # 5 rows over 2 ranks: the permutation's first row is used twice, so each rank gets 3
    order, shares = share(5, 0, 1), [share(5, r, 2) for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == len(EpochOrder(5, 0, rank=1, world_size=2)) == 3
    assert sorted(shares[0] + shares[1]) == sorted([*order, order[0]])


def test_a_resumed_share_skips_the_rows_done_once_then_replays_whole_epochs():
    sampler = EpochOrder(12, 3, rank=1, world_size=2)
    sampler.resume(epoch=2, rows_done=4)
    sampler.set_epoch(2)
    whole = EpochOrder(12, 3, rank=1, world_size=2)
    whole.set_epoch(2)
    assert list(sampler) == list(whole)[4:] and list(sampler) == list(whole)


def test_prompts_per_step_that_does_not_split_over_the_processes_is_refused_naming_the_fields(tmp_path):
    data = PromptDataModule(str(tmp_path / "train.jsonl"), tokenizer="unused", prompts_per_step=4)
    data.trainer = SimpleNamespace(world_size=3)
    with pytest.raises(ValueError, match=r"data.prompts_per_step=4 is the global batch.*3 processes"):
        data.setup("fit")


def test_minibatches_that_do_not_divide_a_ranks_share_are_refused_with_the_valid_counts():
    check_minibatches(prompts_per_step=4, group_size=3, number_of_minibatches=4, ranks=1)  # 12 rows: fine
    with pytest.raises(ValueError, match=r"number_of_minibatches=4 .* 4 / 2 x 3 = 6 .* \[1, 2, 3, 6\]"):
        check_minibatches(prompts_per_step=4, group_size=3, number_of_minibatches=4, ranks=2)


class Draws(RolloutSource):
    def draw_rollout(self):
        raise AssertionError("setup draws nothing")


def test_dynamic_sampling_num_groups_is_global_and_must_split_over_the_processes():
    DynamicSampling(num_groups=4).setup(SimpleNamespace(world_size=2), Draws(), "fit")
    with pytest.raises(ValueError, match=r"num_groups=3 is global.*2 processes"):
        DynamicSampling(num_groups=3).setup(SimpleNamespace(world_size=2), Draws(), "fit")


def test_without_a_process_group_every_collective_returns_its_input():
    assert not collectives.is_distributed() and collectives.world_size() == 1 and collectives.rank() == 0
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    gathered, rows = collectives.gather_rows(x)
    assert gathered is x and rows == slice(0, 3)
    assert collectives.reduce_over_ranks(x, "sum") is x and collectives.ddp_normaliser(x) is x
    assert collectives.mean_over_ranks(x) is x
    metrics = {"loss": torch.tensor(1.5)}
    assert collectives.sum_metrics(metrics) is metrics
    assert collectives.gather_objects("a") == ["a"]
    for rows, parts in ((7, 3), (10, 4), (12, 5), (8, 4), (3, 3)):  # tensor_split's split, as under DDP
        order = torch.arange(rows)
        bounds = collectives.minibatch_bounds(rows, parts)
        assert [order[a:b].tolist() for a, b in bounds] == [p.tolist() for p in order.tensor_split(parts)]
    assert collectives.minibatch_bounds(3, 4) == [(0, 1), (1, 2), (2, 3)]  # fewer rows than parts: one row each
    assert collectives.minibatch_bounds(0, 2) == []
    assert collectives.every_rank_holds(1, 4) and not collectives.every_rank_holds(0, 1)


def test_a_single_process_step_is_its_own_rows_with_the_completions_lengths_not_the_loss_masks():
    """``gather_step`` in one process: the rollout's own values, all rows; ``lengths`` counts each completion's tokens
    (what ``completion/len_mean`` reports), whatever the loss mask keeps (OverlongFilter drops truncated rows)."""
    from gpo.rollout.base import Rollout

    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    ids = torch.ones(3, 3, dtype=torch.long)
    rollout = Rollout(ids, ids, ids, completion_mask, torch.tensor([True, False, False]), torch.tensor([0, 0, 1]),
                      scores=torch.ones(3, 2), reward=torch.tensor([0.5, 1.0, 2.0]),
                      reward_kl=torch.tensor([0.1, 0.2, 0.3]))  # fmt: skip
    mask = completion_mask * torch.tensor([[0], [1], [1]])  # the truncated row out of the loss
    step, rows = collectives.gather_step(rollout, mask)
    assert rows == slice(0, 3) and step["mask"] is mask
    assert step["lengths"].tolist() == [3, 2, 1] and step["truncated"].tolist() == [1.0, 0.0, 0.0]
    assert step["group"].tolist() == [0, 0, 1] and step["reward"] is rollout.reward
    assert step["scores"] is rollout.scores and step["reward_kl"] is rollout.reward_kl


def test_under_ddp_each_rank_splits_its_rows_into_exactly_the_minibatches_asked(monkeypatch):
    monkeypatch.setattr(collectives, "is_distributed", lambda: True)
    for rows, parts in ((7, 3), (10, 4), (3, 3)):  # tensor_split's split; each rank holds >= parts rows
        order = torch.arange(rows)
        bounds = collectives.minibatch_bounds(rows, parts)
        assert [order[a:b].tolist() for a, b in bounds] == [p.tolist() for p in order.tensor_split(parts)]


def reduce_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    metrics = {"loss": torch.tensor(float(rank)), "count": torch.tensor(2.0 * rank + 1)}
    result = {"sum": collectives.sum_metrics(metrics)}
    # rank 1's masks left no token in its gate's loss: its ratio statistics read 0; its entropy counts (2 tokens)
    stats = {LOSS_TOKENS: torch.tensor(6.0 - 6 * rank), MASK_TOKENS: torch.tensor(6.0 - 4 * rank),
             "ratio/min": torch.tensor(0.9 - 0.9 * rank), "ratio/mean": torch.tensor(1.0 - rank),
             "entropy": torch.tensor(1.0 + 3 * rank)}  # fmt: skip
    result["combined"] = combine_statistics(collectives.gather_metrics(stats))
    try:
        collectives.sum_metrics({"loss": torch.tensor(0.0)} if rank else metrics)
    except RuntimeError as error:
        result["mismatch"] = str(error)
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_metrics_reduce_over_two_processes_with_one_all_reduce_and_refuse_different_keys(tmp_path):
    torch.multiprocessing.spawn(reduce_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        # loss 0 and 1: sum 1; count 1 and 3: sum 4
        assert {k: float(v) for k, v in result["sum"].items()} == {"loss": 1.0, "count": 4.0}
        assert "every rank must log the same keys" in result["mismatch"]
        # the ranks combine as micro-batches do: a rank without loss tokens has no say in the statistics
        assert {k: float(v) for k, v in result["combined"].items()} == pytest.approx(
            {LOSS_TOKENS: 6.0, MASK_TOKENS: 8.0, "ratio/min": 0.9, "ratio/mean": 1.0, "entropy": (6 * 1 + 2 * 4) / 8}
        )
