"""One live run per checkpoint folder: a second run stops at once, a stale lock (and the partial file a killed write
left) is cleaned up, a fresh run refuses a folder holding an earlier run's last.ckpt unless it resumes it, and a
resume under another model or algorithm is refused naming the difference; what a checkpoint keeps of the run besides
its weights (generators, each rank's draws, the settings a resume compares); an evaluation cut short by a crash is
run again."""

import csv
import json
import os
import random
import signal
import socket
import subprocess
import sys
import warnings
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from gpo.algo import AdvantageEstimator, Custom
from gpo.algo.state import PartState
from gpo.callbacks import ResumeCheckpoint
from gpo.parallel import collectives
from gpo.train.checkpointing import RunLock
from gpo.train.loggers import default_loggers
from gpo.train.run_state import (
    capture_random_state,
    changed_keys,
    check_same_run,
    check_same_weights,
    describe,
    describe_run,
    describe_settings,
    described_differences,
    load_part_states,
    part_states,
    restore_random_state,
    restored_run_state,
    run_state,
    warn_changed_settings,
)
from tests.tiny import prompts, quiet_trainer, tiny_module
from tests.train.test_logging import event_pb2, events_of


def fit(tiny_assets, folder, steps=2, ckpt_path=None, **module_kwargs):
    model, data = tiny_assets
    trainer = quiet_trainer(steps, [ResumeCheckpoint(dirpath=folder)], enable_checkpointing=True)
    trainer.fit(tiny_module(model, **module_kwargs), prompts(model, data), ckpt_path=ckpt_path)
    return trainer


def claim(folder, pid):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RunLock.NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "then"}))


def test_a_second_run_on_the_folder_of_a_live_one_stops_at_once(tiny_assets, tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        claim(tmp_path / "ckpt", live.pid)
        with pytest.raises(FileExistsError, match=rf"another run \(process {live.pid} on .*--trainer.default_root_dir"):
            fit(tiny_assets, tmp_path / "ckpt")
        assert not (tmp_path / "ckpt" / "last.ckpt").exists()
    finally:
        live.kill()
        live.wait()


def test_validating_in_the_folder_of_a_live_run_neither_refuses_it_nor_takes_its_lock(tmp_path):
    """gpo validate --ckpt_path last reads a training run's checkpoint while it trains: only fit claims the folder."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        claim(tmp_path / "ckpt", live.pid)
        callback = ResumeCheckpoint(dirpath=tmp_path / "ckpt")
        callback.setup(quiet_trainer(1, [callback], enable_checkpointing=True), None, "validate")
        assert json.loads((tmp_path / "ckpt" / RunLock.NAME).read_text())["pid"] == live.pid
    finally:
        live.kill()
        live.wait()


def test_a_stale_lock_and_a_killed_writes_partial_file_are_cleaned_up(tiny_assets, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "ckpt"
    claim(folder, dead.pid)
    (folder / f".last.ckpt.tmp-{dead.pid}").write_bytes(b"half a checkpoint")
    fit(tiny_assets, folder)
    assert (folder / "last.ckpt").is_file() and not list(folder.glob(".*.tmp-*"))
    assert not (folder / RunLock.NAME).exists()  # released when the run ended


def test_a_fresh_run_refuses_an_earlier_runs_checkpoint_unless_it_resumes_it(tiny_assets, tmp_path):
    folder = tmp_path / "ckpt"
    fit(tiny_assets, folder, steps=2)
    said = r"last\.ckpt holds an earlier run's checkpoint.*--ckpt_path last \(in Python: .*ckpt_path='last'\)\)"
    with pytest.raises(FileExistsError, match=said):
        fit(tiny_assets, folder, steps=3)
    assert not (folder / RunLock.NAME).exists()  # the refused run gave the folder back
    assert fit(tiny_assets, folder, steps=3, ckpt_path=str(folder / "last.ckpt")).global_step == 3


def test_resuming_last_before_any_checkpoint_starts_fresh_and_says_so(tiny_assets, tmp_path, caplog):
    """``--ckpt_path last`` set once for a job that may be requeued: its first run has nothing to resume."""
    folder = tmp_path / "ckpt"
    with caplog.at_level("INFO"):
        assert fit(tiny_assets, folder, steps=2, ckpt_path="last").global_step == 2
    assert f"--ckpt_path last: no checkpoint in {folder} yet; starting from the initial weights." in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        assert fit(tiny_assets, folder, steps=3, ckpt_path="last").global_step == 3  # the requeued job continues
    assert "no checkpoint" not in caplog.text


def test_resuming_under_another_algorithm_is_refused_naming_the_difference(tiny_assets, tmp_path):
    folder = tmp_path / "ckpt"
    fit(tiny_assets, folder, steps=2)  # GRPO
    last = str(folder / "last.ckpt")
    with pytest.raises(ValueError, match=r"gate: NoGate\(\) in the checkpoint, ClipGate\(clip_high=0.28, .*\) now"):
        fit(tiny_assets, folder, steps=3, ckpt_path=last, algorithm="dapo")
    with pytest.raises(ValueError, match=r"group_size: 4 in the checkpoint, 2 now"):
        fit(tiny_assets, folder, steps=3, ckpt_path=last, group_size=2)


def test_a_resume_with_changed_settings_warns_naming_each_and_what_the_checkpoint_keeps(tiny_assets, tmp_path):
    import warnings

    from gpo.algo import KLPenalty, RolloutCorrection, WeightedSum
    from gpo.train.optimization import Optimization

    folder = tmp_path / "ckpt"
    fit(tiny_assets, folder, steps=2, optim=Optimization(lr=1e-3))
    with warnings.catch_warnings():  # the same settings: no warning
        warnings.filterwarnings("error", message="resumed with settings changed")
        fit(tiny_assets, folder, steps=3, ckpt_path="last", optim=Optimization(lr=1e-3))
    with pytest.warns(UserWarning, match=r"resumed with settings changed since the checkpoint") as caught:
        trainer = fit(tiny_assets, folder, steps=4, ckpt_path="last", optim=Optimization(lr=5e-3),
                      kl=KLPenalty(beta=0.1))  # fmt: skip
    message = next(str(w.message) for w in caught if "settings changed" in str(w.message))
    assert "model.optim.lr 0.001 -> 0.005 (not applied" in message
    assert "model.kl None -> KLPenalty(beta=0.1" in message and "micro_batch_size" not in message
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3)  # what the warning says
    with pytest.warns(UserWarning, match=r"resumed with settings changed since the checkpoint") as caught:
        changed = {"mixer": WeightedSum(weights=[2.0]), "old_logprobs": "trainer",
                   "correction": RolloutCorrection(mode="mis")}  # fmt: skip
        fit(tiny_assets, folder, steps=5, ckpt_path="last", optim=Optimization(lr=1e-3), kl=KLPenalty(beta=0.1),
            **changed)  # fmt: skip
    message = next(str(w.message) for w in caught if "settings changed" in str(w.message))
    assert "model.mixer WeightedSum(weights=None) -> WeightedSum(weights=[2.0])" in message
    assert "model.correction None -> RolloutCorrection(cap=2.0, level='token', mode='mis')" in message
    assert "model.old_logprobs rollout -> trainer" in message and "model.kl" not in message


class Evaluations(L.Callback):
    """The held-out metrics of each evaluation, by step; with ``term_at``, what Lightning's SIGTERM handler sets, at
    the first held-out batch of the evaluation after that step (the loop stops after that batch)."""

    def __init__(self, term_at: int | None = None) -> None:
        self.term_at, self.metrics, self.batches = term_at, {}, []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((trainer.global_step, batch_idx))
        if trainer.global_step == self.term_at:
            trainer._signal_connector.received_sigterm = True

    def on_validation_end(self, trainer, pl_module):
        held_out = {k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        self.metrics[trainer.global_step] = held_out


def digit_share(prompts, completions, **columns):
    """A reward with many values, so that an evaluation over other batches or weights shows."""
    return [sum(c.isdigit() for c in completion) / max(len(completion), 1) for completion in completions]


def test_sigterm_during_an_evaluation_checkpoints_the_finished_step_exits_143_and_the_resumed_run_evaluates_it(
    tiny_assets, tmp_path
):
    """Lightning's evaluation loop stops at SIGTERM with exit code 0, which a scheduler reads as done; and a
    checkpoint written as its loops stand mid-evaluation resumes after the evaluation, which the run then never has
    (seen before 2026-11-28: the resumed run's first evaluation was the next one)."""
    model, data = tiny_assets
    folder = tmp_path / "checkpoints"

    def fit(evaluations, ckpt_path=None, logs="run"):
        checkpoints = ResumeCheckpoint(dirpath=folder, every_n_train_steps=100)
        loggers = default_loggers(str(tmp_path / logs), resume=ckpt_path is not None)
        trainer = quiet_trainer(6, [checkpoints, evaluations], enable_checkpointing=True, val_check_interval=3,
                                check_val_every_n_epoch=None, num_sanity_val_steps=0, logger=loggers,
                                log_every_n_steps=1)  # fmt: skip
        module = tiny_module(model, rewards=(digit_share,))
        trainer.fit(module, prompts(model, data, val_size=16), ckpt_path=ckpt_path)  # 16 held-out prompts: 4 batches
        return module

    stopped_at_3 = Evaluations(term_at=3)
    with pytest.raises(SIGTERMException) as stopped:
        fit(stopped_at_3)
    assert stopped.value.code == 143 and stopped_at_3.batches == [(3, 0)] and stopped_at_3.metrics == {}
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 3  # the evaluation after step 3
    resumed = Evaluations()
    resumed_module = fit(resumed, ckpt_path="last")
    assert resumed.batches == [(3, 0), (3, 1), (3, 2), (3, 3), (6, 0), (6, 1), (6, 2), (6, 3)]  # step 3 again, whole
    (folder / "last.ckpt").unlink()
    uninterrupted = Evaluations()
    whole = fit(uninterrupted, logs="whole")
    assert resumed.metrics == uninterrupted.metrics and 0 < uninterrupted.metrics[3]["val/reward_sampled"] < 1
    for name, tensor in whole.state_dict().items():
        assert torch.equal(resumed_module.state_dict()[name], tensor), name
    # every value logged once: step 3's training row kept beside its evaluation done again, in both loggers
    logged = {logs: logged_values(tmp_path / logs) for logs in ("run", "whole")}
    assert logged["run"] == logged["whole"] and ("2", "val/reward_sampled") in logged["run"]
    _, again = sorted((tmp_path / "run").rglob("events.out.tfevents.*"), key=lambda path: path.stat().st_mtime)
    [start] = [event.step for event in events_of(again) if event.session_log.status == event_pb2.SessionLog.START]
    assert start == 3  # the step after the evaluation's (2, the third batch's index): step 2's training points stay


def logged_values(root) -> set[tuple[str, str]]:
    """The (step, key) pairs of ``metrics.csv`` under ``root`` that hold a value."""
    (path,) = root.rglob("metrics.csv")
    with path.open() as file:
        return {(row["step"], key) for row in csv.DictReader(file) for key, value in row.items() if value}


class PromptsSeen(L.Callback):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.extend(batch["prompt"])


def test_a_resume_with_another_batch_size_warns_and_goes_on_after_the_prompts_trained(tiny_assets, tmp_path):
    model, data = tiny_assets
    folder = tmp_path / "ckpt"

    def fit_seen(steps, prompts_per_step, *callbacks, ckpt_path=None) -> list[str]:
        seen = PromptsSeen()
        quiet_trainer(steps, [seen, *callbacks], enable_checkpointing=bool(callbacks)).fit(
            tiny_module(model), prompts(model, data, prompts_per_step), ckpt_path=ckpt_path
        )
        return seen.seen

    whole = fit_seen(6, 4)
    first = fit_seen(2, 4, ResumeCheckpoint(dirpath=folder))
    with pytest.warns(UserWarning, match=r"settings changed since the checkpoint: data\.prompts_per_step 4 -> 8\."):
        resumed = fit_seen(3, 8, ResumeCheckpoint(dirpath=folder), ckpt_path="last")
    resumed_again = fit_seen(4, 8, ResumeCheckpoint(dirpath=folder), ckpt_path="last")  # batches of two sizes before
    assert first + resumed + resumed_again == whole  # the prompts after those trained, none skipped or repeated


class RunningBaseline(AdvantageEstimator):
    """A part with state: the reward minus a running mean of the earlier steps' rewards."""

    def __init__(self, *, decay: float = 0.5) -> None:
        self.decay, self.baseline = decay, 0.0

    def __call__(self, reward, group, mask):
        adv = (reward - self.baseline)[:, None] * mask
        self.baseline = self.decay * self.baseline + (1 - self.decay) * float(reward.mean())
        return adv

    def state_dict(self):
        return {"baseline": self.baseline}

    def load_state_dict(self, state):
        self.baseline = state["baseline"]


def test_a_part_with_state_resumes_from_it_and_its_state_is_not_taken_for_a_setting(tiny_assets, tmp_path):
    model, data = tiny_assets

    def fit_with_baseline(steps, folder, ckpt_path=None):
        L.seed_everything(0)
        module = tiny_module(model, algorithm=Custom(advantage=RunningBaseline()))
        quiet_trainer(steps, [ResumeCheckpoint(dirpath=folder)], enable_checkpointing=True).fit(
            module, prompts(model, data), ckpt_path=ckpt_path
        )
        return module

    whole = fit_with_baseline(4, tmp_path / "whole")
    fit_with_baseline(2, tmp_path / "cut")
    resumed = fit_with_baseline(4, tmp_path / "cut", ckpt_path="last")  # not refused as "another run"
    assert resumed.credit.advantage.baseline == whole.credit.advantage.baseline != 0.0
    for (name, a), b in zip(whole.policy.named_parameters(), resumed.policy.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_part_of_one_class_described_otherwise_is_told_a_changing_attribute_is_state_not_a_setting():
    # RunningBaseline without its state_dict: its baseline, a public attribute, reads as a setting that changed
    saved = {"advantage": "RunningBaseline(baseline=0.25, decay=0.5)", "group_size": "4"}
    current = {"advantage": "RunningBaseline(baseline=0.0, decay=0.5)", "group_size": "4"}
    hint = r"If RunningBaseline changes a public attribute as it runs, that attribute is its state, not a setting"
    with pytest.raises(ValueError, match=hint + r": return it from state_dict\(\)"):
        check_same_run(saved, current, "last.ckpt")
    for gate, now in [("ClipGate(clip_low=0.2)", "NoGate()"), ("ClipGate(clip_high=0.2)", "ClipGate(clip_high=0.28)")]:
        with pytest.raises(ValueError) as refused:  # another part, or a setting of gpo's own changed on purpose
            check_same_run({"gate": gate}, {"gate": now}, "last.ckpt")
        assert "public attribute" not in str(refused.value)


class Linear(L.LightningModule):
    """Any LightningModule: ResumeCheckpoint asks nothing of gpo's."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=1)


@pytest.mark.parametrize(("save_top_k", "kept"), [(0, []), (2, [4, 5]), (-1, [1, 2, 3, 4, 5])])
def test_save_top_k_keeps_the_latest_step_numbered_checkpoints_beside_last(tmp_path, save_top_k, kept):
    every_step = ResumeCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=save_top_k)
    L.Trainer(max_steps=5, callbacks=[every_step], logger=False, enable_progress_bar=False,
              enable_model_summary=False).fit(Linear())  # fmt: skip
    assert sorted(path.name for path in tmp_path.glob("*.ckpt")) == ["last.ckpt", *(f"step{n:06d}.ckpt" for n in kept)]
    with pytest.raises(ValueError, match=r"save_top_k=-2 must be an int >= -1 \(-1 keeps all, 0 last.ckpt alone, K"):
        ResumeCheckpoint(save_top_k=-2)


class Evaluated(Linear):
    """Evaluates every 2 steps (``batches`` held-out batches), recording the step of each batch evaluated; the
    evaluation at ``crash_at`` fails, and the one at ``stop_at`` gets SIGTERM (Lightning's flag, as its handler sets
    it) or Ctrl-C (a real SIGINT) in its first batch."""

    def __init__(self, crash_at=None, stop_at=None, stop_by="SIGTERM", batches=1) -> None:
        super().__init__()
        self.crash_at, self.stop_at, self.stop_by, self.batches = crash_at, stop_at, stop_by, batches
        self.evaluated = []

    def validation_step(self, batch, batch_idx):
        if self.global_step == self.crash_at:
            raise RuntimeError("the evaluation crashed")
        if self.global_step == self.stop_at and self.stop_by == "SIGTERM":
            self.trainer._signal_connector.received_sigterm = True
        elif self.global_step == self.stop_at and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGINT)
        self.evaluated.append(self.global_step)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(self.batches, 2), batch_size=1)


def fit_evaluated(module, folder, max_steps=6, ckpt_path=None):
    trainer = L.Trainer(max_steps=max_steps, val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        callbacks=[ResumeCheckpoint(dirpath=folder, every_n_train_steps=2)], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)
    return module.evaluated


def saved_step(folder) -> int:
    return torch.load(folder / "last.ckpt", weights_only=False)["global_step"]


def test_an_evaluation_cut_short_by_a_crash_is_run_again_by_the_resumed_run(tmp_path):
    """The checkpoint of a step whose evaluation follows is written after it: a crash during the evaluation at step 4
    resumes from step 2, whose replay evaluates step 4 again. Written before the evaluation (as Lightning's
    on_train_batch_end save does), it resumed after it, and the run never had its step-4 evaluation."""
    crashed = Evaluated(crash_at=4)
    with pytest.raises(RuntimeError, match="the evaluation crashed"):
        fit_evaluated(crashed, tmp_path)
    assert crashed.evaluated == [2] and saved_step(tmp_path) == 2
    assert fit_evaluated(Evaluated(), tmp_path, ckpt_path="last") == [4, 6]  # step 2's evaluation is not run twice
    assert fit_evaluated(Evaluated(), tmp_path, ckpt_path="last") == []  # resumed at the end: nothing to redo


@pytest.mark.parametrize(("stop_by", "stopped_as"), [("SIGTERM", SIGTERMException), ("Ctrl-C", SystemExit)])
def test_a_run_resumed_from_an_evaluation_stopped_by_a_signal_keeps_its_checkpoint_steps_and_evaluations(
    tmp_path, stop_by, stopped_as
):
    """SIGTERM or Ctrl-C in step 4's evaluation stops it after that batch and checkpoints step 4; the resumed run
    evaluates it again from its first batch. Its checkpoints fall on steps 6, 8, ... as before (counted from a save it
    did not make, they fell on 5, 7, ...), and a crash in a later evaluation resumes without repeating the one before
    it (its batch counts were left one batch short of whole, so Lightning took the checkpoint for one written
    mid-evaluation). Ctrl-C used to let the evaluation finish and train one more step."""
    stopped = Evaluated(stop_at=4, stop_by=stop_by, batches=3)
    with pytest.raises(stopped_as) as raised:
        fit_evaluated(stopped, tmp_path, max_steps=10)
    assert raised.value.code == (143 if stop_by == "SIGTERM" else 1)
    assert stopped.evaluated == [2, 2, 2, 4] and saved_step(tmp_path) == 4
    crashed = Evaluated(crash_at=8, batches=3)
    with pytest.raises(RuntimeError, match="the evaluation crashed"):
        fit_evaluated(crashed, tmp_path, max_steps=10, ckpt_path="last")
    assert crashed.evaluated == [4, 4, 4, 6, 6, 6] and saved_step(tmp_path) == 6
    assert fit_evaluated(Evaluated(batches=3), tmp_path, max_steps=10, ckpt_path="last") == [8, 8, 8, 10, 10, 10]


def test_sigterm_during_the_evaluation_after_the_last_step_says_how_to_evaluate_it(tmp_path, caplog):
    """A run resumed at its last step has nothing to train, so Lightning runs no evaluation: the message names
    `gpo validate`; a resume to more steps evaluates that step first."""
    stopped = Evaluated(stop_at=6, batches=3)
    with caplog.at_level("INFO"), pytest.raises(SIGTERMException):
        fit_evaluated(stopped, tmp_path)
    assert stopped.evaluated == [2, 2, 2, 4, 4, 4, 6] and saved_step(tmp_path) == 6
    assert "stopped during the evaluation after the last step (6). Evaluate " in caplog.text
    assert "with `gpo validate --config ... --ckpt_path last`" in caplog.text
    assert fit_evaluated(Evaluated(batches=3), tmp_path, max_steps=8, ckpt_path="last") == [6, 6, 6, 8, 8, 8]


def test_a_resume_past_max_steps_warns_that_nothing_trains(tmp_path):
    """Lightning stops at once and says only that max_steps was reached; a resume at max_steps (a finished job run
    again) says nothing more."""
    fit_evaluated(Evaluated(), tmp_path, max_steps=4)
    with pytest.warns(UserWarning, match=r"resumed at step 4, past trainer.max_steps=3: nothing to train\. Raise "):
        fit_evaluated(Evaluated(), tmp_path, max_steps=3, ckpt_path="last")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="resumed at step")
        fit_evaluated(Evaluated(), tmp_path, max_steps=4, ckpt_path="last")


def test_a_run_folder_moved_before_its_resume_keeps_counting_its_step_checkpoints(tmp_path):
    """Lightning drops the saved paths of a checkpoint folder other than its own, with a warning: save_top_k then lost
    count of the files kept before the move, and kept them all."""
    import shutil

    def fit_in(folder, max_steps, ckpt_path=None):
        every_step = ResumeCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=2)
        L.Trainer(max_steps=max_steps, callbacks=[every_step], logger=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(Linear(), ckpt_path=ckpt_path)  # fmt: skip
        return every_step

    fit_in(tmp_path / "here", 4)
    shutil.copytree(tmp_path / "here", tmp_path / "there")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="The dirpath has changed")
        resumed = fit_in(tmp_path / "there", 6, ckpt_path="last")
    kept = sorted(path.name for path in (tmp_path / "there").glob("*.ckpt"))
    assert kept == ["last.ckpt", "step000005.ckpt", "step000006.ckpt"]
    assert resumed.last_model_path == str(tmp_path / "there" / "last.ckpt")
    assert sorted(path.name for path in (tmp_path / "here").glob("*.ckpt")) == ["last.ckpt", "step000003.ckpt",
                                                                                 "step000004.ckpt"]  # fmt: skip


def test_ckpt_path_last_without_a_checkpoint_says_so_once_without_lightnings_save_last_hint(tmp_path, caplog):
    """ResumeCheckpoint saves last.ckpt; Lightning's warning for the same case advised setting save_last."""
    with caplog.at_level("INFO"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_evaluated(Evaluated(), tmp_path, max_steps=1, ckpt_path="last")
    assert "no checkpoint in " in caplog.text and "yet; starting from the initial weights." in caplog.text
    assert not [w for w in caught if "no last checkpoint" in str(w.message)]


# ---- the lock's owner: which claims are live, stale or unreadable --------------------------------------------------


@pytest.mark.parametrize(
    ("owner", "why"),
    [
        ({"pid": 0, "host": socket.gethostname()}, "no process has id 0"),
        ("half a claim {", "a claim cut off while written reads as none"),
        ("own", "this process's own claim"),
    ],
)
def test_a_claim_that_names_no_other_live_run_lets_a_run_start(tmp_path, owner, why):
    lock = RunLock(tmp_path)
    if owner == "own":
        lock.acquire()
    else:
        (tmp_path / RunLock.NAME).write_text(owner if isinstance(owner, str) else json.dumps(owner))
    lock.check()  # no FileExistsError


@pytest.mark.parametrize("kill_error", [None, PermissionError])
def test_a_claim_from_another_host_or_another_users_live_process_stops_a_run(tmp_path, monkeypatch, kill_error):
    """A process id on another host cannot be checked here; one that exists under another user is alive."""
    if kill_error is None:  # a process id that is not alive here, but on another host
        owner = {"pid": 2**22 + 1, "host": socket.gethostname() + "-elsewhere"}
    else:
        monkeypatch.setattr(os, "kill", lambda pid, signal: (_ for _ in ()).throw(kill_error()))
        owner = {"pid": 2**22 + 1, "host": socket.gethostname()}
    (tmp_path / RunLock.NAME).write_text(json.dumps({**owner, "started": "then"}))
    with pytest.raises(FileExistsError, match=rf"another run \(process {2**22 + 1} on {owner['host']}, started then\)"):
        RunLock(tmp_path).check()


@pytest.mark.parametrize("other", [{"pid": 1}, {"host": "elsewhere"}])
def test_release_removes_only_this_processs_own_claim(tmp_path, other):
    claim_ = {"pid": os.getpid(), "host": socket.gethostname(), "started": "then"} | other
    (tmp_path / RunLock.NAME).write_text(json.dumps(claim_))
    RunLock(tmp_path).release()
    assert json.loads((tmp_path / RunLock.NAME).read_text()) == claim_
    lock = RunLock(tmp_path / "own")
    lock.acquire()
    lock.release()
    assert not lock.path.exists()


# ---- what a checkpoint keeps of the run beyond weights: generators, per-rank draws, the settings --------------------


def test_every_generator_draws_again_what_it_drew_after_its_state_was_captured_even_from_lists():
    """A checkpoint round trip may hand Python's nested tuples back as lists."""

    def draw():
        return random.random(), np.random.rand(), torch.rand(1).item()

    state = capture_random_state()
    first = draw()
    listed = json.loads(json.dumps(state["python"]))  # tuples -> lists
    restore_random_state({**state, "python": listed})
    assert draw() == first


def test_each_rank_resumes_its_own_draws_and_all_take_rank_0s_when_the_number_of_processes_changed(monkeypatch, caplog):
    ranks = [{"extra_batches_drawn": 3}, {"extra_batches_drawn": 5}]
    monkeypatch.setattr(collectives, "gather_objects", lambda own: ranks)
    saved = run_state(3, nonfinite_streak=2, parts={})
    assert saved["ranks"] == ranks and saved["extra_batches_drawn"] == 3 and saved["nonfinite_streak"] == 2
    monkeypatch.setattr(collectives, "world_size", lambda: 2)
    monkeypatch.setattr(collectives, "rank", lambda: 1)
    assert restored_run_state(saved) == ({"extra_batches_drawn": 5}, 2)
    monkeypatch.setattr(collectives, "world_size", lambda: 3)
    with caplog.at_level("WARNING"):
        assert restored_run_state(saved) == ({"extra_batches_drawn": 3}, 2)
    assert "checkpoint of 2 processes resumed by 3" in caplog.text


def test_a_single_processs_run_state_is_its_own_and_an_old_checkpoint_has_no_streak():
    saved = run_state(4, nonfinite_streak=1, parts={"gate": {"step": 2}})
    assert "ranks" not in saved and saved["extra_batches_drawn"] == 4 and saved["parts"] == {"gate": {"step": 2}}
    assert restored_run_state({"extra_batches_drawn": 4})[1] == 0


class Settable(PartState):
    """A part: public plain settings, a private attribute, what it learns (its state), a part inside it."""

    def __init__(self):
        self.eps, self.levels, self.name, self._cache = 0.2, [1, 2], None, 7
        self.table, self.inner = {"a": 1}, Custom()
        self.baseline = 0.5

    def state_dict(self):
        return {"baseline": self.baseline}

    def load_state_dict(self, state):
        self.baseline = state["baseline"]


def test_a_part_is_described_by_its_plain_public_settings_alone():
    assert describe(Settable()) == "Settable(eps=0.2, levels=[1, 2], name=None)"


def test_only_the_keys_both_describe_are_compared_and_a_difference_names_both_values():
    saved, current = {"a": "1", "b": "2", "gone": "x"}, {"a": "1", "b": "3", "new": "y"}
    assert changed_keys(saved, current) == ["b"]
    assert described_differences(saved, current, ["b"]) == ["b: 2 in the checkpoint, 3 now"]


def test_the_state_hint_is_given_only_for_a_part_named_in_the_part_keys():
    with pytest.raises(ValueError) as refused:
        check_same_run({"rewards": "Mine(a=1)"}, {"rewards": "Mine(a=2)"}, "last.ckpt")
    assert "rewards: Mine(a=1) in the checkpoint, Mine(a=2) now" in str(refused.value)
    assert "public attribute" not in str(refused.value)


def test_weights_are_refused_only_for_another_model_or_trainer_mode():
    check_same_weights({"model": "llama, 10 parameters", "gate": "NoGate()"}, {"model": "llama, 10 parameters",
                       "gate": "ClipGate()"})  # fmt: skip
    with pytest.raises(ValueError, match=r"another policy \(trainer_mode: lora in the checkpoint, full now\)"):
        check_same_weights({"trainer_mode": "lora"}, {"trainer_mode": "full"})


def test_a_changed_weight_decay_is_said_to_be_kept_by_the_optimiser_and_other_changes_are_not():
    with pytest.warns(UserWarning) as caught:
        warn_changed_settings({"model.optim.weight_decay": "0.0"}, {"model.optim.weight_decay": "0.1"})
    message = str(caught[0].message)
    assert "keeps 0.0)" in message and "start a new run from the exported policy" in message
    with pytest.warns(UserWarning) as caught:
        warn_changed_settings({"model.kl": "None"}, {"model.kl": "KLPenalty(beta=0.1)"})
    assert str(caught[0].message).endswith("model.kl None -> KLPenalty(beta=0.1). The run goes on with them, so it "
                                           "does not replay the one that wrote the checkpoint.")  # fmt: skip


def test_part_states_keep_each_stateful_part_and_a_part_no_longer_configured_is_skipped():
    def part(state):
        return SimpleNamespace(state_dict=lambda: dict(state), load_state_dict=state.update)

    objective = SimpleNamespace(gate=part({}), aggregator=part({}), masks=[part({"seen": 1})], token_weights=[])
    module = SimpleNamespace(learner=SimpleNamespace(objective=objective), credit=SimpleNamespace(advantage=part({})),
                             collector=SimpleNamespace(mixer=part({"scale": 2.0})))  # fmt: skip
    assert part_states(module) == {"mixer": {"scale": 2.0}, "masks/0": {"seen": 1}}
    load_part_states(module, {"mixer": {"scale": 3.0}, "masks/1": {"seen": 9}})  # masks/1: removed since
    assert part_states(module)["mixer"] == {"scale": 3.0}


def test_memory_and_give_up_settings_are_not_among_those_a_resume_warns_about(tiny_assets):
    model, _ = tiny_assets
    settings = describe_settings(tiny_module(model))
    assert "model.optim.lr" in settings
    assert not {"model.optim.micro_batch_size", "model.optim.max_consecutive_nonfinite"} & set(settings)


def test_a_lora_run_is_described_as_lora_and_a_full_one_as_full(tiny_assets):
    model, _ = tiny_assets
    assert describe_run(tiny_module(model))["trainer_mode"] == "full"
    assert describe_run(tiny_module(model, trainer_mode="lora"))["trainer_mode"] == "lora"
