"""Pipelined rollouts: the next steps' rollouts are sampled and scored while the policy trains on this one.

One sampler thread runs, in the order they are submitted, every call that touches the rollout engine: the
collection of a step's rollout, a weight push after an optimiser step, a held-out evaluation, a callback's extra
draw. The training loop submits the collection of batch ``j`` at step ``j`` and trains the rollout of batch ``j - s``
(``s = max_off_policy_steps``); the first ``s`` steps only fill the pipeline. As pushes and collections run in
program order, the rollout of batch ``j`` is always sampled by the policy after ``max(0, j - s)`` training steps, and
trained after ``j`` of them: its staleness is ``min(j, s)``, whatever the timing, so a run is reproducible and
resumes bitwise (the rollouts collected but not yet trained are part of the checkpoint).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpo.rollout.base import Rollout, RolloutEngine, Sampling
from gpo.rollout.collector import CollectionStats
from gpo.rollout.worker import ProcessEngine, autocast_as, autocast_state


class SamplerThread:
    """One thread that runs tasks in the order they were submitted, and measures the time it had none to run."""

    def __init__(self) -> None:
        self.executor: ThreadPoolExecutor | None = None  # started at the first task, again after close()
        self.ident: int | None = None
        self.idle_s, self.busy_until = 0.0, time.perf_counter()
        self.lock = threading.Lock()

    def _mark(self) -> None:
        self.ident = threading.get_ident()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` after the tasks submitted before it, under the submitting thread's autocast."""
        submitted, autocast = time.perf_counter(), autocast_state()
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="gpo-sampler", initializer=self._mark)

        def timed() -> Any:
            with self.lock:
                self.idle_s += max(0.0, submitted - self.busy_until)
            try:
                with autocast_as(autocast):
                    return fn(*args, **kwargs)
            finally:
                self.busy_until = time.perf_counter()

        return self.executor.submit(timed)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` after every task submitted before it; inline when called from the thread itself."""
        if threading.get_ident() == self.ident:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def take_idle_s(self) -> float:
        """Seconds without a task since the last call."""
        with self.lock:
            idle, self.idle_s = self.idle_s, 0.0
        return idle

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.executor = None


class QueuedEngine(RolloutEngine):
    """The engine as the trainer and the callbacks see it when rollouts are pipelined: every call runs on the sampler
    thread after the calls submitted before it, so a ``generate`` sees exactly the weight pushes submitted before it,
    and each row it returns is stamped with the policy version of those weights (``Rollout.version``).

    ``update_weights`` copies the tensors at once (training goes on changing the originals) and returns; the push
    runs in its turn. The version it installs is ``trained_steps`` at the time of the call.
    """

    shares_policy_weights = False

    def __init__(self, engine: RolloutEngine, thread: SamplerThread) -> None:
        self.engine, self.thread = engine, thread
        self.sampling, self.serves_all_ranks, self.episodic = engine.sampling, engine.serves_all_ranks, engine.episodic
        self.trained_steps = 0  # training steps taken by the policy (the learner's side)
        self.version = 0  # training steps behind the weights the engine samples from (the sampler's side)
        self.push_s = 0.0  # seconds of weight pushes on the sampler thread, since the last take_push_s
        self.pushes: list[Future] = []

    def setup(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.engine.setup(policy, tokenizer)

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        *,
        greedy: bool = False,
        seed: int | None = None,
        logprobs: bool = True,
        sampling: Sampling | None = None,
        tasks: Sequence[str] | None = None,
    ) -> Rollout:
        """``tasks``: the prompts' text, for an episodic engine (``RolloutEngine.episodic``)."""
        kwargs = {"greedy": greedy, "seed": seed, "logprobs": logprobs, "sampling": sampling}
        kwargs |= {"tasks": tasks} if tasks is not None else {}
        return self.thread.run(self._generate, prompt_ids, n, **kwargs)

    def _generate(self, prompt_ids: list[list[int]], n: int, **kwargs: Any) -> Rollout:
        rollout = self.engine.generate(prompt_ids, n, **kwargs)
        rollout.version = torch.full((len(rollout),), self.version, dtype=torch.long)
        return rollout

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        snapshot = [(name, tensor.detach().clone()) for name, tensor in named_tensors]
        self.pushes.append(self.thread.submit(self._push, snapshot, self.trained_steps))

    def _push(self, snapshot: list[tuple[str, Tensor]], version: int) -> None:
        started = time.perf_counter()
        self.engine.update_weights(snapshot)
        self.version, self.push_s = version, self.push_s + time.perf_counter() - started

    def check_pushes(self) -> None:
        """Raise the error of a finished push that failed; forget the finished ones (and those cancelled when the
        sampler thread stopped: their weights were never installed, and nothing samples after them)."""
        for push in [p for p in self.pushes if p.done()]:
            self.pushes.remove(push)
            if not push.cancelled():
                push.result()

    def take_push_s(self) -> float:
        seconds, self.push_s = self.push_s, 0.0
        return seconds


@dataclass
class Collected:
    """A step's first round, collected ahead: the rollout (None when the step's batch had no prompt on this rank)
    and what collecting it cost."""

    step: int
    rollout: Rollout | None
    stats: CollectionStats

    def state(self) -> dict[str, Any]:
        """Plain values and tensors (a checkpoint loads with ``weights_only=True``)."""
        rollout = None if self.rollout is None else {f.name: getattr(self.rollout, f.name) for f in fields(Rollout)}
        stats = {"rollout_s": self.stats.rollout_s, "generated_tokens": float(self.stats.generated_tokens),
                 "reward_errors": dict(self.stats.reward_errors)}  # fmt: skip
        return {"step": self.step, "rollout": rollout, "stats": stats}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Collected:
        rollout = None if state["rollout"] is None else Rollout(**state["rollout"])
        stats = state["stats"]
        return cls(state["step"], rollout, CollectionStats(stats["rollout_s"], stats["generated_tokens"],
                                                           Counter(stats["reward_errors"])))  # fmt: skip


class RolloutPipeline:
    """Collects up to ``lag`` steps ahead of training, on the sampler thread (see the module docstring).

    An engine that samples from the trained module itself (``HFEngine``) runs in a worker process on a copy of the
    weights (``ProcessEngine`` with ``sampler_threads`` torch threads), which the trainer pushes after each training
    step (``pushes_policy``); engines with their own weights (vLLM) are driven from the sampler thread and pushed by
    ``VLLMWeightSync``.

    Args:
        engine: the run's rollout engine.
        lag: ``max_off_policy_steps`` (>= 1).
        sampler_threads: torch threads of the worker process (engines that share the policy's weights); None: half
            of this process's. The trainer keeps the rest (``split_threads``).
    """

    def __init__(self, engine: RolloutEngine, lag: int, sampler_threads: int | None) -> None:
        if lag < 0:
            raise ValueError(f"model.max_off_policy_steps={lag} must be >= 0 (0: sample, then train, in turn).")
        if sampler_threads is not None and sampler_threads < 1:
            raise ValueError(f"model.sampler_threads={sampler_threads} must be >= 1, or null for half the threads.")
        if engine.episodic and engine.shares_policy_weights:
            raise ValueError(
                f"model.max_off_policy_steps={lag} with {type(engine).__name__} over an engine that samples from "
                "the trained policy itself (HFEngine) is not supported: use a vLLM engine inside it, or set "
                "model.max_off_policy_steps: 0."
            )
        self.lag, self.thread = lag, SamplerThread()
        self.pushes_policy = engine.shares_policy_weights
        threads = sampler_threads or max(1, torch.get_num_threads() // 2)
        self.worker = ProcessEngine(engine, threads=threads) if self.pushes_policy else None
        self.engine = QueuedEngine(self.worker or engine, self.thread)
        self.pending: deque[Future] = deque()
        self.learner_wait_s = 0.0
        self.threads_before: int | None = None  # this process's torch threads before split_threads

    def split_threads(self) -> None:
        """Leave the worker process's threads to it: this process keeps the rest of its torch threads (until
        ``close``)."""
        if self.worker is not None and self.threads_before is None:
            self.threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, self.threads_before - self.worker.threads))

    def submit(self, collect: Callable[[], Collected]) -> None:
        """Run ``collect`` (a step's collection) on the sampler thread, after everything submitted before."""
        self.pending.append(self.thread.submit(collect))

    def ready(self) -> bool:
        """Whether more than ``lag`` steps are pending, so the oldest may be trained (False while filling)."""
        self.engine.check_pushes()
        return len(self.pending) > self.lag

    def next(self) -> Collected:
        """The oldest pending step's collection, waited for (call when ``ready``)."""
        started = time.perf_counter()
        collected = self.pending.popleft().result()
        self.learner_wait_s += time.perf_counter() - started
        return collected

    def push(self, model: PreTrainedModel) -> None:
        """Push the trainable parameters of ``model`` to the worker (engines that share the policy's weights)."""
        if self.pushes_policy:
            self.engine.update_weights((name, p) for name, p in model.named_parameters() if p.requires_grad)

    def metrics(self, rollout: Rollout, dropped: int, device: torch.device) -> dict[str, Tensor]:
        """Staleness of the trained rows and where the time went since the last step's metrics."""
        staleness = (self.engine.trained_steps - rollout.version).float()  # [B]
        values = {
            "pipeline/filling": torch.tensor(0.0),
            "pipeline/staleness_mean": staleness.mean(),
            "pipeline/staleness_max": staleness.max(),
            "pipeline/dropped_stale": torch.tensor(float(dropped)),
            "pipeline/queue_depth": torch.tensor(float(len(self.pending))),
            "pipeline/learner_wait_s": torch.tensor(self.learner_wait_s),
            "pipeline/sampler_idle_s": torch.tensor(self.thread.take_idle_s()),
            "pipeline/weight_push_s": torch.tensor(self.engine.take_push_s()),
        }
        self.learner_wait_s = 0.0
        return {name: value.to(device) for name, value in values.items()}

    def within_bound(self, rollout: Rollout) -> tuple[Rollout, int]:
        """``rollout`` without the rows sampled more than ``lag`` training steps ago, and how many were dropped."""
        fresh = self.engine.trained_steps - rollout.version <= self.lag  # [B]
        if bool(fresh.all()):
            return rollout, 0
        return rollout.select(fresh.nonzero()[:, 0]), int((~fresh).sum())

    def state(self) -> dict[str, Any]:
        """The pending collections (waited for; they stay pending) and the policy version, for a checkpoint. After
        ``close``, the collections it let finish."""
        self.engine.check_pushes()
        pending = [future.result().state() for future in self.pending]
        return {"pending": pending, "trained_steps": self.engine.trained_steps}

    def load_state(self, state: dict[str, Any] | None) -> None:
        """Put back a checkpoint's pending collections and policy version (None: a checkpoint of a run without
        pipelining, nothing pending)."""
        if state is None:
            return
        if len(state["pending"]) > self.lag:
            raise ValueError(
                f"the checkpoint holds {len(state['pending'])} rollouts collected ahead, more than "
                f"model.max_off_policy_steps={self.lag}: resume with model.max_off_policy_steps: "
                f"{len(state['pending'])} or more."
            )
        self.engine.trained_steps = state["trained_steps"]
        self.pending.clear()  # a module fitted before holds what its last fit collected ahead
        for item in state["pending"]:
            done: Future = Future()
            done.set_result(Collected.from_state(item))
            self.pending.append(done)

    def close(self) -> None:
        """Stop the sampler thread (the task it runs finishes, those queued are cancelled) and the worker process,
        and give back the threads it had. The collections finished by then stay pending: a checkpoint saved after a
        failure (``ResumeCheckpoint`` on SIGTERM) or after the fit holds them."""
        self.thread.close()
        while self.pending and self.pending[-1].cancelled():  # queued in order: the cancelled ones are the last
            self.pending.pop()
        if self.worker is not None:
            self.worker.close()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
            self.threads_before = None
