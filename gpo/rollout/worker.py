"""ProcessEngine: an engine that samples from the trained policy (``HFEngine``) run in a process of its own, on a copy
of the policy's weights, so that sampling and training each get their own cores."""

from __future__ import annotations

import contextlib
import copy
import multiprocessing.forkserver
import os
import resource
import threading
import traceback
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.rollout.base import Rollout, RolloutEngine, Sampling

POLL_S = 0.2  # how often a waiting caller checks that the worker is still alive


class RolloutWorkerDied(RuntimeError):
    """The worker process ended while the trainer waited on it."""


class ProcessEngine(RolloutEngine):
    """Runs ``engine`` (one that samples from the module it is set up with, such as ``HFEngine``) in a worker process,
    on a copy of the policy that both processes map: in shared memory on the CPU, through CUDA IPC on a GPU.

    The worker starts at the first ``generate`` or ``update_weights``, with a copy of the policy made where the
    policy is then: Lightning moves the policy to its device after ``setup``, so a GPU run's worker samples on that
    GPU. ``update_weights`` copies new values of the trainable parameters into the copy (names as in the policy's
    ``named_parameters``), which the worker sees as soon as the copy is done: call it only between ``generate``
    calls, from the thread that calls ``generate`` (the rollout pipeline does both from its sampler thread). Rollouts
    come back on the CPU, sampled under the caller's autocast (Lightning's mixed precision). A worker that dies is
    reported (pid and exit code) instead of waited on. Workers are forked from a server process that ``setup``
    starts (``start_forkserver``).

    Args:
        engine: the engine to run in the worker; it must share the policy's weights (``shares_policy_weights``).
        threads: torch threads of the worker process.
    """

    shares_policy_weights = False

    def __init__(self, engine: RolloutEngine, *, threads: int = 1) -> None:
        if not engine.shares_policy_weights:
            raise ValueError(f"ProcessEngine runs engines that sample from the policy, not {type(engine).__name__}.")
        if threads < 1:
            raise ValueError(f"threads={threads} must be >= 1 (torch threads of the rollout worker).")
        self.engine, self.threads, self.sampling, self.episodic = engine, threads, engine.sampling, engine.episodic
        self.policy: PreTrainedModel | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.copy: PreTrainedModel | None = None  # the worker's policy; kept here while the worker maps it
        self.parameters: dict[str, Tensor] = {}
        self.cuda_devices: set[torch.device] = set()  # where the copy's parameters are, on a GPU
        self.process: Any = None
        self.connection: Connection | None = None

    def setup(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.policy, self.tokenizer = policy, tokenizer
        start_forkserver()

    def _start(self) -> None:
        if self.policy is None:
            raise RuntimeError("ProcessEngine used before setup(policy, tokenizer), or after close().")
        tensors = [*self.policy.parameters(), *self.policy.buffers()]
        if not any(tensor.is_cuda for tensor in tensors):  # a file per shared tensor, and its duplicate in transit
            allow_open_files(2 * len(tensors))
        copied = copy.deepcopy(self.policy).requires_grad_(False)
        # The worker maps these very storages (CPU: shared memory; CUDA: IPC handles): an update is a copy, not a
        # transfer.
        copied.share_memory()
        context = torch.multiprocessing.get_context("forkserver")
        connection, child = context.Pipe()
        process = context.Process(
            target=serve, args=(self.engine, self.tokenizer, self.threads, dict(os.environ), child),
            name="gpo-rollout-worker", daemon=True,
        )  # fmt: skip
        process.start()
        child.close()
        self.copy, self.parameters = copied, dict(copied.named_parameters())
        self.cuda_devices = {p.device for p in self.parameters.values() if p.device.type == "cuda"}
        self.process, self.connection = process, connection  # started: calls go to it from here on
        # The copy goes through the pipe, not with the process's arguments: forkserver passes those at most 256 file
        # descriptors, one per CPU tensor (a 30-layer model has more), the pipe any number (see allow_open_files).
        try:
            self._call("setup", copied)
        except BaseException:
            self.close()  # a worker that was never set up takes no other request
            raise

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        *,
        greedy: bool = False,
        seed: int | None = None,
        logprobs: bool = True,
        sampling: Sampling | None = None,
    ) -> Rollout:
        return self._call("generate", prompt_ids, n, greedy=greedy, seed=seed, logprobs=logprobs, sampling=sampling)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        if self.process is None:
            self._start()
        for name, tensor in named_tensors:
            if name not in self.parameters:
                raise KeyError(f"ProcessEngine.update_weights: the policy has no parameter {name!r}.")
            self.parameters[name].copy_(tensor)
        for device in self.cuda_devices:  # the copies are queued on this process's stream: done before the worker reads
            torch.cuda.synchronize(device)

    def close(self) -> None:
        """Stop the worker (it finishes nothing pending: callers stop calling first)."""
        self.policy = None
        if self.process is None:
            return
        if self.process.is_alive():
            with contextlib.suppress(OSError):  # a worker that just died: nothing to tell it
                self.connection.send(None)
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.connection.close()
        self.process = self.connection = self.copy = None
        self.parameters, self.cuda_devices = {}, set()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.process is None:
            self._start()
        try:
            self.connection.send((method, args, kwargs, autocast_state()))
            while not self.connection.poll(POLL_S):
                if not self.process.is_alive():
                    raise EOFError
            status, value = self.connection.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as err:
            self.process.join(timeout=5)
            raise RolloutWorkerDied(
                f"the rollout worker process (pid {self.process.pid}) ended with exit code {self.process.exitcode} "
                f"during {method}; the run stops (see its output above for the cause: out of memory is exit code "
                "-9). Resume from the last checkpoint with --ckpt_path last."
            ) from err
        if status == "error":
            raise RuntimeError(f"the rollout worker failed in {method}:\n{value}")
        return value


AutocastState = list[tuple[str, torch.dtype]]


def autocast_state() -> AutocastState:
    """The device types autocast is on for in the calling thread, each with its dtype (autocast is thread-local: a
    call run on another thread or in another process drops it unless that call enters it again)."""
    devices = [device for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)]
    return [(device, torch.get_autocast_dtype(device)) for device in devices]


@contextlib.contextmanager
def autocast_as(state: AutocastState) -> Iterator[None]:
    """Run a block under the autocast ``state`` (from ``autocast_state``): Lightning's mixed precision
    (``trainer.precision: bf16-mixed``) reaches a rollout that another thread or process samples."""
    with contextlib.ExitStack() as stack:
        for device, dtype in state:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


def allow_open_files(extra: int) -> None:
    """Let this process open ``extra`` more files: the soft ``RLIMIT_NOFILE`` is raised towards the hard limit when it
    is too low (PyTorch's advice for sharing many CPU tensors); a hard limit too low is refused with the fix."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = len(os.listdir("/proc/self/fd")) + extra + 64 if os.path.isdir("/proc/self/fd") else soft
    if needed <= soft:
        return
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise OSError(
            f"the rollout worker's copy of the policy needs {extra} more open files (two per tensor until the worker "
            f"has taken it), and this process may open {hard} at most: raise the limit (ulimit -Hn {needed})."
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def start_forkserver() -> None:
    """Start, in the background, the process that workers are forked from, with this module and ``HFEngine``'s
    imported (torch and transformers with them, several seconds; no user module, whose failing import would end that
    process), once per trainer process, while the trainer sets up. A worker forked from it starts in milliseconds
    and, unlike a forked trainer, has no CUDA state (CUDA IPC forbids ``fork``). It is the ``forkserver`` start
    method with a preload."""
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, "gpo.rollout.hf"])
    multiprocessing.forkserver.ensure_running()


def _forget_the_parents_forkserver() -> None:
    """In a process forked from one whose server was started (Lightning's ``ddp_fork``, after a pipelined ``fit`` in
    the same notebook), Python's record of that server is the parent's: its first check of the server waits on a
    process that is not its child and raises ``ChildProcessError``. The child forgets it, and starts its own at its
    first ``start_forkserver``. (``multiprocessing.forkserver`` offers no public way to do this.)"""
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is None:
        return
    with contextlib.suppress(OSError):
        os.close(server._forkserver_alive_fd)  # the parent's server may end with the parent
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
    server._lock = threading.Lock()  # the parent's may have been held by another thread at the fork


os.register_at_fork(after_in_child=_forget_the_parents_forkserver)


def serve(
    engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, threads: int, environment: dict[str, str],
    connection: Connection,
) -> None:  # fmt: skip
    """The worker process: take the trainer's ``environment`` (the server's is that of the moment it started; a
    worker numbers GPUs by the trainer's ``CUDA_VISIBLE_DEVICES``: the copy of the policy arrives afterwards), receive
    the mapped copy of the policy (the first request, ``setup``), set ``engine`` up on it, answer requests, release
    the copy. Modules imported while ``engine`` was unpickled, before this runs, saw the server's environment."""
    os.environ.clear()
    os.environ.update(environment)
    torch.set_num_threads(threads)
    request = connection.recv()
    if request is None:  # closed before its set-up reached it
        return
    _, (policy,), _, _ = request
    try:
        device = next(policy.parameters()).device
        if device.type == "cuda":  # the rank's own GPU (DDP), not GPU 0, for anything placed by default
            torch.cuda.set_device(device)
        engine.setup(policy, tokenizer)
        connection.send(("ok", None))
        answer_requests(engine, connection)
    finally:
        release(policy)


def answer_requests(engine: RolloutEngine, connection: Connection) -> None:
    """Run ``(method, args, kwargs, autocast)`` requests on ``engine``, under the caller's autocast, and send back
    ``("ok", value)`` or ``("error", traceback)`` until ``None`` or the pipe closes; rollouts are sent on the CPU."""
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        if request is None:
            return
        method, args, kwargs, autocast = request
        try:
            with autocast_as(autocast):
                value = engine.generate(*args, **kwargs).to("cpu") if method == "generate" else None
            connection.send(("ok", value))
        except Exception:  # sent to the trainer, which raises it with the worker's traceback
            connection.send(("error", traceback.format_exc()))


def release(model: PreTrainedModel) -> None:
    """Drop the worker's views of the policy copy's storages before it exits. On a GPU they are CUDA IPC mappings of
    the trainer's memory, which a consumer must release while the producer lives (PyTorch's note "Sharing CUDA
    tensors"); left to the interpreter's exit, the trainer warns that they were never released."""
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = torch.empty(0)
