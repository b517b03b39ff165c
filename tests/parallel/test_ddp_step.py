"""Under Lightning's DDP (2 processes, CPU, gloo) a training step on a global batch gives the loss and the parameter
update of one process training on that whole batch: the prompts are sharded, the batch statistics are global."""

import pytest
import torch
import torch.multiprocessing as mp

from tests.parallel import ddp_step
from tests.ports import free_port

# float32: the ranks sum the same terms in another order (all-reduce of averaged gradients, gathered rewards)
RTOL, ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], object]:
    """Every case run by two DDP processes: each rank's results, and the assets' folder."""
    root = tmp_path_factory.mktemp("ddp")
    ddp_step.write_assets(root)
    mp.spawn(ddp_step.worker, args=(free_port(), str(root), str(root)), nprocs=ddp_step.WORLD_SIZE, join=True)
    return [torch.load(root / f"rank{r}.pt", weights_only=True) for r in range(ddp_step.WORLD_SIZE)], root


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def assert_same_step(ddp: dict, single: dict) -> None:
    assert ddp["loss"] == pytest.approx(single["loss"], rel=RTOL, abs=ATOL)
    for name, update in single["update"].items():
        torch.testing.assert_close(ddp["update"][name], update, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", list(ddp_step.CASES))
def test_a_ddp_step_equals_one_process_on_the_global_batch(ranks, case):
    results, root = ranks
    single = ddp_step.step(case, root, devices=1)
    assert max_difference(single["update"], {k: torch.zeros_like(v) for k, v in single["update"].items()}) > 1e-3
    for rank in results:  # both ranks hold the same weights after the step
        assert_same_step(rank[case], single)


@pytest.mark.parametrize(
    ("naive", "case"),
    [("naive_normaliser", "grpo_token_mean"), ("naive_advantage", "reinforce_pp")],
)
def test_without_the_global_statistics_the_step_differs(ranks, naive, case):
    """Controls: dividing by each rank's own token count, or whitening the advantages over each rank's own rows,
    moves the update far outside the tolerance the equivalence holds to."""
    results, root = ranks
    single = ddp_step.step(case, root, devices=1)
    assert max_difference(results[0][naive]["update"], single["update"]) > 100 * ATOL + RTOL * max_difference(
        single["update"], {k: torch.zeros_like(v) for k, v in single["update"].items()}
    )
