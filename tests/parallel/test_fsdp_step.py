"""gpo's FSDP2 strategy on CPU (2 processes, gloo): a training step equals one process's step on the global batch,
and a run checkpointed as per-process shards resumes to end exactly like the run never stopped."""

import pytest
import torch
import torch.multiprocessing as mp

from tests.parallel import ddp_step, fsdp_step
from tests.parallel.test_ddp_step import assert_same_step, max_difference
from tests.ports import free_port


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], object]:
    root = tmp_path_factory.mktemp("fsdp")
    ddp_step.write_assets(root)
    mp.spawn(fsdp_step.worker, args=(free_port(), str(root), str(root)), nprocs=ddp_step.WORLD_SIZE, join=True)
    return [torch.load(root / f"rank{r}.pt", weights_only=True) for r in range(ddp_step.WORLD_SIZE)], root


@pytest.mark.parametrize("case", list(ddp_step.CASES))
def test_an_fsdp_step_equals_one_process_on_the_global_batch(ranks, case):
    results, root = ranks
    single = ddp_step.step(case, root, devices=1)
    assert max_difference(single["update"], {k: torch.zeros_like(v) for k, v in single["update"].items()}) > 1e-3
    for rank in results:
        assert rank[case]["sharded"]  # the policy's parameters were DTensor shards, not replicas
        assert_same_step(rank[case], single)


def test_a_run_resumed_from_a_sharded_checkpoint_ends_like_the_run_never_stopped(ranks):
    results, root = ranks
    (checkpoint,) = (root / "checkpoints").glob(f"step{fsdp_step.CHECKPOINT_STEP:06d}.ckpt")
    assert checkpoint.is_dir() and len(list(checkpoint.glob("*.distcp"))) == ddp_step.WORLD_SIZE  # one shard each
    for rank in results:
        resumed, never_stopped = rank["resumed"], rank["never_stopped"]
        assert resumed["global_step"] == never_stopped["global_step"] == fsdp_step.RESUME_STEPS
        assert resumed["reference_sharded"]
        for name, tensor in never_stopped["params"].items():
            torch.testing.assert_close(resumed["params"][name], tensor, rtol=0, atol=0, msg=name)
