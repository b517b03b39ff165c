"""Pipelined rollouts (``max_off_policy_steps``): the sampler runs ahead of the learner by a fixed number of training
steps, in a worker process for HFEngine; staleness is bounded and stamped, runs are deterministic, a worker that
dies stops the run with a message, and the reward still rises."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typing_extensions import override

from gpo.rollout import Rollout, RolloutEngine, Sampling
from gpo.rollout.base import concat_rollouts
from gpo.rollout.hf import HFEngine
from gpo.rollout.pipeline import RolloutPipeline, SamplerThread
from gpo.rollout.worker import ProcessEngine, RolloutWorkerDied, allow_open_files, start_forkserver
from gpo.testing import save_tiny_model
from gpo.train.hooks import RolloutCallback
from tests.tiny import prompts, quiet_trainer, tiny_module, write_assets
from tests.vllm_engines import needs_vllm, tiny_vllm_engine
from tests.worker_engines import MARK, NamesTheMark


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_assets(tmp_path_factory.mktemp("pipeline"), examples=2000)


class Stamps(RolloutCallback):
    """Per trained step: the policy's training steps so far, and the versions stamped on the rollout's rows."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int]]] = []

    @override
    def on_rollout_end(self, trainer, pl_module, rollout):
        self.seen.append((pl_module.engine.trained_steps, rollout.version.tolist()))


class Rewards(L.Callback):
    def __init__(self) -> None:
        self.rewards: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.callback_metrics.get("pipeline/filling", 0) == 0:
            self.rewards.append(float(trainer.callback_metrics["reward"]))


def fit(workspace, steps: int, lag: int, *callbacks, **module_kwargs):
    model, data = workspace
    L.seed_everything(0)
    module = tiny_module(model, group_size=8, max_off_policy_steps=lag, **module_kwargs)
    trainer = quiet_trainer(steps, list(callbacks))
    trainer.fit(module, prompts(model, data, 8))
    return module, trainer


@pytest.mark.parametrize("lag", [1, 2])
def test_every_rollout_is_sampled_exactly_min_j_lag_steps_before_it_trains(workspace, lag):
    stamps, threads = Stamps(), torch.get_num_threads()
    module, trainer = fit(workspace, 8, lag, stamps)
    assert trainer.global_step == 8 and len(stamps.seen) == 8
    for trained, versions in stamps.seen:  # rollout j trains after j steps, sampled after max(0, j - lag)
        assert versions == [max(0, trained - lag)] * len(versions)
    assert float(trainer.callback_metrics["pipeline/staleness_max"]) == lag
    assert float(trainer.callback_metrics["pipeline/dropped_stale"]) == 0
    assert trainer.fit_loop.epoch_loop.batch_progress.total.completed == 8 + lag  # the first `lag` only filled
    assert module.feed.pipeline.worker.process is None  # the worker stopped when training ended
    assert torch.get_num_threads() == threads  # the threads left to the worker are given back


def test_two_runs_with_the_same_seed_end_with_the_same_weights(workspace):
    first, _ = fit(workspace, 6, 1)
    second, _ = fit(workspace, 6, 1)
    for (name, a), b in zip(first.policy.named_parameters(), second.policy.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_reward_rises_with_the_sampler_one_step_ahead(workspace):
    rewards = Rewards()
    fit(workspace, 150, 1, rewards)
    first, last = sum(rewards.rewards[:25]) / 25, sum(rewards.rewards[-25:]) / 25
    assert last > first + 0.1, (first, last)


class FailAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("a callback failed")


def test_a_run_that_fails_stops_the_sampler_thread_and_the_worker(workspace):
    threads = torch.get_num_threads()
    model, data = workspace
    module = tiny_module(model, group_size=8, max_off_policy_steps=1)
    with pytest.raises(RuntimeError, match="a callback failed"):
        quiet_trainer(6, [FailAt(2)]).fit(module, prompts(model, data, 8))
    assert module.feed.pipeline.worker.process is None  # Lightning calls no teardown hook of a failed run
    assert module.feed.pipeline.thread.executor is None
    assert torch.get_num_threads() == threads


def test_a_checkpoint_saved_after_a_pipelined_fit_holds_its_rollouts_collected_ahead_and_resumes(workspace, tmp_path):
    _, trainer = fit(workspace, 4, 1)
    trainer.save_checkpoint(tmp_path / "after.ckpt")  # the pipeline has stopped (teardown)
    pipeline = torch.load(tmp_path / "after.ckpt", weights_only=True)["gpo"]["pipeline"]
    assert pipeline["trained_steps"] == 4 and [item["step"] for item in pipeline["pending"]] == [4]
    model, data = workspace
    resumed = quiet_trainer(6)
    resumed.fit(tiny_module(model, group_size=8, max_off_policy_steps=1), prompts(model, data, 8),
                ckpt_path=tmp_path / "after.ckpt")  # fmt: skip
    assert resumed.global_step == 6


class KillWorker(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            pl_module.feed.pipeline.worker.process.kill()


def test_a_worker_that_dies_stops_the_run_with_a_message(workspace):
    with pytest.raises(RolloutWorkerDied, match=r"rollout worker process \(pid \d+\) ended with exit code -9"):
        fit(workspace, 10, 1, KillWorker())


def in_process_and_worker_engines(model) -> tuple[torch.nn.Module, HFEngine, ProcessEngine, list[list[int]]]:
    """The policy in the folder ``model``, an in-process ``HFEngine`` and a ``ProcessEngine`` over another, both set up
    on it, and three prompts' token ids."""
    policy, tokenizer = AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(model)
    local, worker = (
        HFEngine(sampling=Sampling(max_new_tokens=4)),
        ProcessEngine(HFEngine(sampling=Sampling(max_new_tokens=4))),
    )
    local.setup(policy, tokenizer)
    worker.setup(policy, tokenizer)
    return policy, local, worker, [tokenizer(text)["input_ids"] for text in ("12+3=", "7*8=", "99-1=")]


ON_A_GPU = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
)


@pytest.mark.parametrize("device", ["cpu", ON_A_GPU])
def test_the_worker_samples_the_policy_as_it_is_at_its_first_call_and_after_each_push(workspace, device):
    """GPOModule sets its engine up before Lightning moves the policy to its device: the worker starts at its first
    call, copying the policy where it is then (on a GPU, a CUDA copy the worker maps). Here the policy moves to
    ``device`` and changes after set-up (output layer zeroed: every logit 0, greedy picks token 0), then changes back
    before a push: each time the worker's greedy completions are those of an in-process engine on the policy as it
    is."""
    policy, local, worker, prompt_ids = in_process_and_worker_engines(workspace[0])
    assert worker.process is None

    def greedy(engine):
        return engine.generate(prompt_ids, 2, greedy=True, logprobs=False).completion_ids

    before = greedy(local)
    policy.to(device)
    head = policy.get_output_embeddings().weight
    trained = head.detach().clone()
    try:
        for weights in (torch.zeros_like(trained), trained):
            with torch.no_grad():
                head.copy_(weights)
            expected = greedy(local).cpu()
            assert not torch.equal(expected, before)
            if worker.process is not None:  # started by the first call, on the policy as it was then
                worker.update_weights(policy.named_parameters())
            assert torch.equal(greedy(worker), expected)  # rollouts come back on the CPU
            assert {p.device.type for p in worker.parameters.values()} == {device}
            before = expected
    finally:
        worker.close()
    assert worker.process is None and worker.parameters == {}


class OwnWeights(RolloutEngine):
    """An engine with weights of its own (as vLLM's): it records the pushes it gets."""

    def __init__(self) -> None:
        self.sampling, self.pushed = Sampling(max_new_tokens=2), []

    def generate(self, prompt_ids, n, **kwargs) -> Rollout:
        rows = len(prompt_ids) * n
        ids = torch.ones(rows, 2, dtype=torch.long)
        return Rollout(ids, ids, ids, ids, torch.zeros(rows, dtype=torch.bool), torch.arange(rows) // n)

    def update_weights(self, named_tensors) -> None:
        self.pushed.append(dict(named_tensors))


class SeedsRecorded(OwnWeights):
    """OwnWeights that records the seed of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.seeds: list[int | None] = []

    def generate(self, prompt_ids, n, *, seed=None, **kwargs) -> Rollout:
        self.seeds.append(seed)
        return super().generate(prompt_ids, n, **kwargs)


@pytest.mark.parametrize("lag", [0, 1])
def test_every_round_of_a_step_has_a_seed_of_its_own_its_statistics_and_the_reward_kl_penalty(lag, monkeypatch):
    """Round ``r`` of training batch ``j`` samples with ``stream_seed("rollout", seed, j, r, rank)``, whether round 0
    is collected when the step asks for it (lag 0) or ahead on the sampler thread (lag 1), and the rounds a rollout
    hook draws after it (``draw_more``) go on from round 1; the step's statistics count all its rounds (4 rows of 2
    tokens, and 0.5 s of a clock that ticks at each read, a round); every round has the KL penalty placed in the
    reward (1 minus 0.1 times the row's KL)."""
    import itertools
    from types import SimpleNamespace

    from gpo.algo import ClipGate, KLPenalty, PolicyObjective, TokenMean
    from gpo.models.scorer import TokenScorer
    from gpo.rollout.collector import Collector
    from gpo.seeds import stream_seed
    from gpo.testing import char_tokenizer, tiny_model
    from gpo.train.feed import rollout_feed
    from gpo.train.learner import Learner
    from gpo.train.optimization import Optimization

    engine = SeedsRecorded()
    pipeline = RolloutPipeline(engine, lag=lag, sampler_threads=None) if lag else None
    collector = Collector(pipeline.engine if lag else engine, [lambda prompts, completions, **_: [1.0] * len(prompts)],
                          group_size=2, seed=5)  # fmt: skip
    collector.setup(None, char_tokenizer())
    collector.rank = 1
    scorer = TokenScorer(tiny_model("llama", seed=1), reference=tiny_model("llama", seed=2))
    learner = Learner(scorer, PolicyObjective(ClipGate(), TokenMean()), Optimization(),
                      kl=KLPenalty(beta=0.1, placement="reward"))  # fmt: skip
    feed = rollout_feed(collector, learner, pipeline)
    batch = {"prompt": ["12", "34"], "prompt_ids": [[3, 4], [5, 6]], "fields": {}}
    collector.extra_prompts = iter([batch] * 6)
    if not lag:  # one thread reads the clock
        ticks = itertools.count(0.0, 0.5)
        monkeypatch.setattr("gpo.rollout.collector.time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    rollouts, generated, seconds = [], [], []
    try:
        for j in range(3 + lag):
            feed.submit(batch, j)
            if feed.ready():
                rollouts += [feed.take(), feed.draw_more(), feed.draw_more()]
                generated.append(float(collector.stats.generated_tokens))
                seconds.append(collector.stats.rollout_s)
    finally:
        feed.close()
    streams = {stream_seed("rollout", 5, j, r, 1): (j, r) for j in range(4) for r in range(3)}
    drawn = [streams.get(seed) for seed in engine.seeds]
    assert len(set(drawn)) == len(drawn) and None not in drawn, drawn
    assert {(j, r) for j in range(3) for r in range(3)} <= set(drawn), drawn
    assert generated == [3 * 8.0] * 3
    assert lag or seconds == [3 * 0.5] * 3
    for rollout in rollouts:
        assert rollout.reward_kl is not None and bool((rollout.reward_kl > 0).all())
        torch.testing.assert_close(rollout.reward, 1.0 - 0.1 * rollout.reward_kl)


def test_rows_staler_than_the_bound_are_dropped_and_counted():
    pipeline = RolloutPipeline(OwnWeights(), lag=1, sampler_threads=None)
    try:
        rollout = pipeline.engine.generate([[5], [6]], 2)
        assert rollout.version.tolist() == [0, 0, 0, 0]
        pipeline.engine.trained_steps = 2
        weight = torch.zeros(3)
        pipeline.engine.update_weights([("w", weight)])
        weight += 1  # training goes on: the push holds the value of the call
        fresh = pipeline.engine.generate([[7]], 2)  # after the push: sampled by version 2
        assert fresh.version.tolist() == [2, 2] and torch.equal(pipeline.engine.engine.pushed[0]["w"], torch.zeros(3))
        pipeline.engine.trained_steps = 3
        kept, dropped = pipeline.within_bound(concat_rollouts([rollout, fresh]))
        assert dropped == 4 and kept.version.tolist() == [2, 2]
    finally:
        pipeline.close()


class Logged(L.Callback):
    """Each batch's ``pipeline/dropped_stale`` and ``rollout/skipped`` as the callbacks see them."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        keys = ("pipeline/dropped_stale", "rollout/skipped")
        self.rows.append({key: float(trainer.callback_metrics[key]) for key in keys if key in trainer.callback_metrics})


def test_a_batch_whose_rows_are_all_too_stale_is_skipped_counted_and_warned_about(workspace, monkeypatch):
    """With VLLMWeightSync(weight_sync_interval > max_off_policy_steps) whole batches go stale: the step is skipped,
    and the count of dropped rows still reaches the metrics, with a warning that says what to change."""
    real, calls = RolloutPipeline.within_bound, []

    def all_stale_once(self, rollout):
        calls.append(len(rollout))
        if len(calls) == 2:
            return rollout.select(torch.zeros(0, dtype=torch.long)), len(rollout)
        return real(self, rollout)

    monkeypatch.setattr(RolloutPipeline, "within_bound", all_stale_once)
    logged = Logged()
    with pytest.warns(UserWarning, match=r"64 rows sampled more than .* skipped.* raise model.max_off_policy_steps"):
        fit(workspace, 3, 1, logged)
    dropped = [row.get("pipeline/dropped_stale") for row in logged.rows]
    # batch 0 fills the pipeline, batch 1 trains, batch 2's rows are all dropped: skipped, then steps 2 and 3 train
    assert dropped == [None, 0.0, 64.0, 0.0, 0.0], logged.rows
    assert logged.rows[2]["rollout/skipped"] == 1.0


def test_a_pipelined_run_can_weigh_the_lag_with_a_correction_instead_of_the_ratio(workspace):
    """``old_logprobs: trainer`` with a correction: the gates clip ``pi / pi_train`` and the correction weighs
    ``pi_train / pi_sampler``, the lag of the policy that sampled (one step here)."""
    from gpo.algo import RolloutCorrection

    _, trainer = fit(workspace, 3, 1, old_logprobs="trainer", correction=RolloutCorrection(mode="tis", cap=2.0))
    logged = trainer.callback_metrics
    assert trainer.global_step == 3 and float(logged["pipeline/staleness_max"]) == 1
    assert float(logged["mismatch/abs_diff_max"]) > 0  # the sampler's policy is a step behind the trainer's
    assert 0 < float(logged["correction/weight_mean"]) <= 2.0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"old_logprobs": "trainer"}, r"older policy, which must enter the loss: set model.old_logprobs: rollout"),
        ({"max_off_policy_steps": -1}, r"model.max_off_policy_steps=-1 must be >= 0"),
        ({"sampler_threads": 0}, r"model.sampler_threads=0 must be >= 1"),
    ],
)
def test_settings_a_pipeline_cannot_run_are_refused(workspace, settings, message):
    model, _ = workspace
    with pytest.raises(ValueError, match=message):
        tiny_module(model, **{"max_off_policy_steps": 1, **settings})


@needs_vllm
def test_vllm_engine_runs_ahead_with_its_weight_pushes_and_checks_in_order(workspace):
    from gpo.callbacks import VLLMWeightSync

    stamps = Stamps()
    sync = VLLMWeightSync(verify_every_k=2, max_logprob_diff=1e-3)  # verifications go through the sampler's queue
    engine = tiny_vllm_engine(sampling=Sampling(max_new_tokens=4))
    _, trainer = fit(workspace, 6, 1, stamps, sync, engine=engine)
    assert [versions[0] for _, versions in stamps.seen] == [0, 0, 1, 2, 3, 4]  # pushed after each step, one behind
    assert float(trainer.callback_metrics["weight_sync/logprob_diff_max"]) < 1e-3
    assert int(trainer.callback_metrics["weight_sync/count"]) == 7  # at the start and after each of the 6 steps


def parent_pid(pid: int) -> int:
    """The parent of process ``pid`` (Linux: field 4 of ``/proc/<pid>/stat``, after the command in parentheses)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def test_workers_fork_from_one_server_started_at_setup_so_a_later_worker_starts_at_once(workspace):
    """The workers of one trainer process are forked from one server process, started when the engine is set up
    with torch and transformers imported: not children of the trainer (a spawned worker imports them afresh, 6-8 s
    on this project's CPU machine); a later worker starts in well under that."""
    model, _ = workspace
    policy, tokenizer = AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(model)
    servers, starts = [], []
    for _ in range(2):
        worker = ProcessEngine(HFEngine(sampling=Sampling(max_new_tokens=4)))
        worker.setup(policy, tokenizer)
        started = time.perf_counter()
        try:
            worker.generate([[5, 6, 7]], 2, seed=0, logprobs=False)
            starts.append(time.perf_counter() - started)
            servers.append(parent_pid(worker.process.pid))
        finally:
            worker.close()
    assert servers[0] == servers[1] != os.getpid()
    assert starts[1] < 2.0, starts


def autocast_now() -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")


def test_the_sampler_thread_runs_each_task_under_the_autocast_of_the_thread_that_submitted_it():
    thread = SamplerThread()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = thread.submit(autocast_now)
        outside = thread.submit(autocast_now)
        assert inside.result() == (True, torch.bfloat16)
        assert outside.result()[0] is False
    finally:
        thread.close()


def test_the_worker_samples_under_the_autocast_of_its_caller(workspace):
    """``trainer.precision: bf16-mixed`` runs a step under autocast, which stays in its thread: the worker enters its
    caller's, so the log-probs it samples with are an in-process engine's under the same autocast, not float32's."""
    _, local, worker, prompt_ids = in_process_and_worker_engines(workspace[0])

    def sampled(engine):
        rollout = engine.generate(prompt_ids, 2, greedy=True)
        return rollout.completion_ids, rollout.logp

    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected, mixed = sampled(local), sampled(worker)
        full = sampled(worker)
    finally:
        worker.close()
    assert torch.equal(mixed[0], expected[0]) and torch.equal(mixed[1], expected[1])
    assert not torch.allclose(mixed[1], full[1], atol=1e-4)  # bfloat16 compute shows


def test_a_policy_of_more_tensors_than_a_new_process_can_be_passed_reaches_the_worker(tmp_path):
    """A process started from the forkserver takes at most 256 file descriptors with its arguments, and the CPU copy
    of the policy shares one per tensor: the copy goes to the worker through its pipe instead."""
    save_tiny_model(tmp_path / "model", "llama", seed=0, num_layers=30)
    policy, local, worker, prompt_ids = in_process_and_worker_engines(tmp_path / "model")
    assert len([*policy.parameters(), *policy.buffers()]) > 256
    try:
        sampled = worker.generate(prompt_ids, 2, greedy=True, logprobs=False).completion_ids
    finally:
        worker.close()
    assert torch.equal(sampled, local.generate(prompt_ids, 2, greedy=True, logprobs=False).completion_ids)


def test_a_copy_that_cannot_reach_the_worker_stops_it_and_is_raised(workspace):
    """The copy is the worker's first request: when it cannot be sent (here it cannot be pickled), the worker, which
    takes no other request before it, is stopped, and the error is the caller's."""
    policy, _, worker, prompt_ids = in_process_and_worker_engines(workspace[0])
    policy.not_picklable = lambda: None  # deep-copied as it is, refused by pickle
    with pytest.raises(AttributeError, match="Can't pickle local object"):
        worker.generate(prompt_ids, 2)
    assert worker.process is None and worker.connection is None


def test_the_open_file_limit_is_raised_for_the_copy_and_a_hard_limit_too_low_is_refused_with_the_fix():
    """Sending the CPU copy holds two open files per tensor (a 60-layer model: 1,088) until the worker has it, over
    the common soft limit of 1,024: the soft limit is raised towards the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 100, hard))
    try:
        allow_open_files(500)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= open_now + 500
        if hard != resource.RLIM_INFINITY:
            with pytest.raises(OSError, match=r"may open \d+ at most: raise the limit \(ulimit -Hn \d+\)"):
                allow_open_files(hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_worker_sees_the_trainers_environment_of_when_it_starts_not_the_servers(workspace, monkeypatch):
    """The server was started earlier; a variable set since (a notebook's ``CUDA_VISIBLE_DEVICES`` between two fits)
    reaches the worker."""
    model, _ = workspace
    start_forkserver()
    monkeypatch.setenv(MARK, "set-after-the-server-started")
    worker = ProcessEngine(NamesTheMark(sampling=Sampling(max_new_tokens=4)))
    worker.setup(AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(model))
    try:
        with pytest.raises(RuntimeError, match=f"{MARK}=set-after-the-server-started"):
            worker.generate([[5, 6, 7]], 2)
    finally:
        worker.close()


def test_a_process_forked_after_the_server_started_starts_a_server_of_its_own():
    """Lightning's ``ddp_fork`` after a pipelined fit in the same process: the forked rank's record of the server is
    its parent's, which Python cannot check from the child (``ChildProcessError``) unless the child forgets it."""
    start_forkserver()
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 when it could start (or find) its own server
        try:
            start_forkserver()
        except BaseException:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


class GlobalDraws(HFEngine):
    """Stands for an in-process vLLM engine: its sampling draws from torch's process-wide generator."""

    draws_global_generator = True


@pytest.mark.parametrize(("dropout", "warned"), [(0.1, True), (0.0, False)])
def test_a_pipelined_engine_drawing_the_global_generator_with_dropout_is_warned_about(workspace, caplog, dropout,
                                                                                         warned):  # fmt: skip
    from gpo.models.loading import LoraSettings

    model, _ = workspace
    with caplog.at_level("WARNING", logger="gpo.train.preflight"):
        tiny_module(model, engine=GlobalDraws(sampling=Sampling(max_new_tokens=4)), max_off_policy_steps=1,
                    trainer_mode="lora", lora=LoraSettings(dropout=dropout))  # fmt: skip
    assert ("two runs with one seed differ" in caplog.text) == warned, caplog.text


def test_a_multi_turn_engine_over_the_trained_policy_is_refused_and_over_its_own_weights_taken():
    from gpo.envs import NumberGuess
    from gpo.rollout.multi_turn import MultiTurnEngine

    with pytest.raises(ValueError, match=r"with MultiTurnEngine over an engine that samples from the trained policy"):
        RolloutPipeline(MultiTurnEngine(engine=HFEngine(), env=NumberGuess()), lag=1, sampler_threads=None)
    RolloutPipeline(MultiTurnEngine(engine=OwnWeights(), env=NumberGuess()), lag=1, sampler_threads=None).close()
