"""Step metrics reach the loggers every ``log_every_n_steps`` batches with the values logging every batch would write,
the callbacks and the progress bar every batch, and logging never changes the run."""

import csv
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from tensorboardX.proto import event_pb2

from gpo.train import loggers
from gpo.train.loggers import default_loggers
from gpo.train.metrics import step_metrics
from tests.tiny import prompts, quiet_trainer, tiny_module

STEPS = 7


def fit(tiny_assets, tmp_path, **trainer_kwargs):
    model, data = tiny_assets
    L.seed_everything(0)
    module = tiny_module(model)
    trainer = quiet_trainer(STEPS, **trainer_kwargs)
    trainer.fit(module, prompts(model, data))
    return module, trainer


def rows(folder) -> dict[int, dict[str, str]]:
    (metrics,) = folder.rglob("metrics.csv")
    return {int(row["step"]): row for row in csv.DictReader(metrics.open()) if row.get("reward/mean")}


def test_every_third_batch_logs_what_logging_every_batch_logs_at_those_batches(tiny_assets, tmp_path):
    _, every = fit(tiny_assets, tmp_path, logger=CSVLogger(tmp_path / "every"), log_every_n_steps=1)
    _, third = fit(tiny_assets, tmp_path, logger=CSVLogger(tmp_path / "third"), log_every_n_steps=3)
    every, third = rows(tmp_path / "every"), rows(tmp_path / "third")
    assert sorted(every) == list(range(STEPS))
    assert sorted(third) == [2, 5, 6]  # batches 3 and 6 (0-based 2, 5) and the last one
    timing = ("time/", "throughput/")  # wall-clock measurements differ between any two runs
    for step, row in third.items():
        for key, value in row.items():
            if key != "step" and not key.startswith(timing):
                assert value == every[step][key], (step, key)
    assert {"loss", "grad/norm", "reward/mean", "entropy", "train/lr", "completion/len_mean"} <= set(third[2])


def test_callbacks_and_the_progress_bar_see_every_batch(tiny_assets, tmp_path):
    seen = []

    class Reader(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((float(trainer.callback_metrics["loss"]), float(trainer.progress_bar_metrics["reward"])))

    fit(tiny_assets, tmp_path, logger=CSVLogger(tmp_path / "bar"), log_every_n_steps=50, callbacks=[Reader()])
    assert len(seen) == STEPS and len({loss for loss, _ in seen}) > 1  # fresh values every batch, not only logged ones


def test_gpos_callbacks_reach_the_loggers_at_the_logged_batches_and_the_callbacks_every_batch(tiny_assets, tmp_path):
    """DynamicSampling, DifficultyFilter and RolloutMonitor publish as the module does (no ``LightningModule.log``):
    their metrics are in ``callback_metrics`` after every batch and in the row of each logged batch, one row a
    batch in gpo's CSV however many of them log."""
    from gpo.callbacks import DifficultyFilter, DynamicSampling, RolloutMonitor

    seen = []

    class Reader(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(trainer.callback_metrics["dynamic_sampling/total_steps"]))

    callbacks = [DifficultyFilter(), DynamicSampling(max_rounds=1), RolloutMonitor(), Reader()]
    logger = loggers.ContinuedCSVLogger(tmp_path / "cb")
    _, trainer = fit(tiny_assets, tmp_path, logger=logger, log_every_n_steps=3, callbacks=callbacks)
    assert seen == list(range(1, len(seen) + 1))  # every batch, skipped ones included
    (metrics,) = (tmp_path / "cb").rglob("metrics.csv")
    rows = [{key: value for key, value in row.items() if value} for row in csv.DictReader(metrics.open())]
    assert len({row["step"] for row in rows}) == len(rows)  # one row a batch
    logged = {int(row["step"]): row for row in rows if "dynamic_sampling/total_steps" in row}
    last = len(seen) - 1
    assert sorted(logged) == sorted({batch for batch in range(last) if batch % 3 == 2} | {last})
    for batch, row in logged.items():
        assert int(float(row["dynamic_sampling/total_steps"])) == batch + 1 and "difficulty/seen" in row
    assert float(logged[last]["monitor/len_mean"]) == float(trainer.callback_metrics["monitor/len_mean"])
    assert "reward/mean" in logged[last]


def test_logging_never_changes_the_run(tiny_assets, tmp_path):
    quiet, _ = fit(tiny_assets, tmp_path)  # no logger at all
    logged, _ = fit(tiny_assets, tmp_path, logger=CSVLogger(tmp_path / "logged"), log_every_n_steps=1)
    for (name, a), b in zip(quiet.policy.named_parameters(), logged.policy.parameters(), strict=True):
        assert torch.equal(a, b), name


def tensorboard_events(folder) -> list[event_pb2.Event]:
    """The events of the one TensorBoard file under ``folder``."""
    (path,) = folder.rglob("events.out.tfevents.*")
    return events_of(path)


def events_of(path) -> list[event_pb2.Event]:
    """The events of a TensorBoard file (TFRecord: length, its CRC, the event, its CRC)."""
    data, events, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        events.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + length]))
        at += 12 + length + 4
    return events


def test_tensorboard_gets_one_event_per_logged_batch_with_every_scalar(tmp_path):
    (_, tensorboard) = default_loggers(str(tmp_path))
    tensorboard.log_metrics({"loss": 0.5, "reward/mean": torch.tensor(0.25), "epoch": 1}, step=3)
    tensorboard.log_metrics({"loss": 0.125}, step=4)
    tensorboard.finalize("success")
    scalars = [(e.step, {v.tag: v.simple_value for v in e.summary.value}) for e in tensorboard_events(tmp_path)]
    assert [s for s in scalars if s[1]] == [(3, {"loss": 0.5, "reward/mean": 0.25, "epoch": 1.0}), (4, {"loss": 0.125})]


def test_tensorboard_save_puts_every_logged_event_on_disk_and_logging_goes_on(tmp_path):
    """A checkpoint or an evaluation saves the loggers, then the run may be killed: what was logged must be on disk
    then, not in tensorboardX's queue (its own flush writes only what its thread has dequeued)."""
    (_, tensorboard) = default_loggers(str(tmp_path))
    for step in range(50):  # more than the queue's 10 slots
        tensorboard.log_metrics({"val/reward": step / 100}, step=step)
    tensorboard.save()
    steps = [e.step for e in tensorboard_events(tmp_path) if e.summary.value]
    assert steps == list(range(50))
    tensorboard.log_metrics({"val/reward": 1.0}, step=50)
    tensorboard.save()
    assert [e.step for e in tensorboard_events(tmp_path) if e.summary.value][-1] == 50


def test_each_tensorboard_session_starts_at_its_first_step_so_a_resumed_run_supersedes_the_steps_it_logs_again(
    tmp_path, monkeypatch
):
    """A run killed after its checkpoint at step 10 had logged steps up to 20; resumed, it logs 10 onwards again into
    a new file of the same folder. TensorBoard takes the second ``SessionLog.START`` of a folder for a restart and drops
    the points at its step and later (tensorboard's event accumulators, checked by hand: tensorboard is not a
    dependency), so each step is shown once."""
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)
    (_, crashed) = default_loggers(str(tmp_path))
    for step in range(21):
        crashed.log_metrics({"reward/mean": 0.0}, step=step)
    crashed.save()
    monkeypatch.setattr(time, "time", lambda: 1_800_000_060.0)  # the new file's name: a minute later
    (_, resumed) = default_loggers(str(tmp_path), resume=True)
    for step in range(10, 31):
        resumed.log_metrics({"reward/mean": 1.0}, step=step)
    resumed.finalize("success")
    files = sorted(Path(resumed.log_dir).glob("events.out.tfevents.*"))
    assert len(files) == 2
    for path, first in zip(files, (0, 10), strict=True):
        events = [e for e in events_of(path) if not e.file_version]
        assert events[0].session_log.status == event_pb2.SessionLog.START and events[0].step == first
        assert [e.step for e in events[1:]] == list(range(first, first + 21))  # then the scalars, one event a step


def test_csv_rows_reach_the_disk_within_save_every_s_not_at_every_log(tmp_path, monkeypatch):
    (csv_logger, _) = default_loggers(str(tmp_path))
    path = Path(csv_logger.log_dir) / "metrics.csv"
    csv_logger.log_metrics({"loss": 1.0}, step=0)
    assert not path.exists()  # held until SAVE_EVERY_S has passed since the last write
    monkeypatch.setattr(loggers, "SAVE_EVERY_S", 0.0)
    csv_logger.log_metrics({"loss": 2.0}, step=1)
    assert [row["loss"] for row in csv.DictReader(path.open())] == ["1.0", "2.0"]


def test_a_resumed_run_continues_the_version_that_trained_not_a_newer_validation(tmp_path):
    """``gpo validate`` after training writes ``version_1`` with its validation row alone; ``--ckpt_path last`` then
    continues ``version_0``, where the run's training rows are."""
    logs = tmp_path / "lightning_logs"
    for version, header in [(0, "epoch,step,reward/mean"), (1, "epoch,step,val/reward_greedy"), (2, "")]:
        (logs / f"version_{version}").mkdir(parents=True)
        if header:  # version_2: a run stopped before its first write
            (logs / f"version_{version}/metrics.csv").write_text(f"{header}\n0,0,0.5\n")
    resumed = [logger.version for logger in default_loggers(str(tmp_path), resume=True)]
    assert resumed == [0, 0] and default_loggers(str(tmp_path))[0].version == 3
    (logs / "version_0/metrics.csv").unlink()
    assert default_loggers(str(tmp_path), resume=True)[0].version == 2  # nothing trained: the newest, as before


def correct(prompts, completions, **kwargs):
    return [1.0] * len(completions)


def brief(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def test_step_metrics_hand_worked():
    """Three rows, two reward functions weighted 1 and 0.5; the advantages and mask written out by hand."""
    scores = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # weighted sums: 1, 0.5, 1.5
    step = {
        "scores": scores,
        "reward": torch.tensor([0.2, 0.4, 0.9]),  # what the advantages came from (a mixer's output)
        "lengths": torch.tensor([3, 1, 2]),
        "truncated": torch.tensor([1.0, 0.0, 0.0]),
        "mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]),
    }
    adv = torch.tensor([[0.5, 0.5, 0.5], [-2.0, 9.0, 9.0], [1.0, -1.0, 7.0]])  # 9 and 7 lie outside the mask
    got = {k: v.item() for k, v in step_metrics(step, adv, [correct, brief], [1.0, 0.5]).items()}
    expected = {
        "reward/mean": 1.0,
        "reward/std": 0.5,  # sample std of 1, 0.5, 1.5
        "reward/mixed_mean": 0.5,
        "completion/len_mean": 2.0,
        "completion/len_max": 3.0,
        "completion/truncated_frac": 1 / 3,
        "adv/mean": (1.5 - 2.0 + 0.0) / 6,
        "adv/abs_mean": (1.5 + 2.0 + 2.0) / 6,
        "reward/correct": 2 / 3,
        "reward/brief": 2 / 3,
    }
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key
    unweighted = step_metrics(step, adv, [correct, brief], None)  # weighted sums 1, 1, 2
    assert unweighted["reward/mean"].item() == pytest.approx(4 / 3)
    single = step_metrics({k: v[:1] for k, v in step.items()}, adv[:1], [correct, brief], None)
    assert single["reward/std"].item() == 0.0  # one row: no spread, not NaN


def test_publish_step_hand_worked():
    """The step's time split and tokens per second (sampled tokens over the engine's seconds, every token trained on,
    prompt and completion, over the training seconds), the reward-error counts and the headline reward, as the
    callbacks and the progress bar see them."""
    from collections import Counter

    from gpo.algo.mixers import WeightedSum
    from gpo.rollout.base import Rollout
    from gpo.rollout.collector import CollectionStats, Collector
    from gpo.train.metrics import publish_step
    from tests.callbacks.fake_trainer import fake_trainer

    ones = torch.ones(3, 2, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])  # 6 completion tokens, after 5 prompt tokens
    rollout = Rollout(ones, torch.tensor([[0, 1], [1, 1], [1, 1]]), mask, mask, torch.zeros(3, dtype=torch.bool),
                      torch.tensor([0, 0, 1]), reward=torch.zeros(3))  # fmt: skip
    collector = Collector(None, [correct, brief], mixer=WeightedSum(weights=[1.0, 0.5]))
    errors = Counter(brief=2)
    collector.stats = CollectionStats(rollout_s=4.0, generated_tokens=torch.tensor(20.0), reward_errors=errors)
    step = {
        "scores": torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
        "reward": torch.tensor([0.2, 0.4, 0.9]),
        "lengths": torch.tensor([3, 1, 2]),
        "truncated": torch.tensor([1.0, 0.0, 0.0]),
        "mask": mask.float(),
    }
    trainer = fake_trainer(0)
    publish_step(trainer, collector, rollout, step, torch.zeros(3, 3), {"loss": torch.tensor(0.5)}, scoring_s=1.0,
                 training_s=2.0)  # fmt: skip
    got = {key: float(value) for key, value in trainer.callback_metrics.items()}
    expected = {
        "loss": 0.5,
        "time/rollout_s": 4.0,
        "time/scoring_s": 1.0,
        "time/training_s": 2.0,
        "throughput/rollout_tokens_per_s": 20 / 4.0,
        "throughput/training_tokens_per_s": (5 + 6) / 2.0,
        "reward_errors/brief": 2.0,
        "reward": 1.0,  # reward/mean: the weighted sums 1, 0.5, 1.5
    }
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
    assert float(trainer.progress_bar_metrics["reward"]) == pytest.approx(1.0)


def test_a_callbacks_batch_values_are_the_batchs_own():
    """``BatchValues`` hands the loggers what the callback measured in this batch: a batch it measured nothing in
    logs nothing again."""
    from gpo.train.metrics import BatchValues
    from tests.callbacks.fake_trainer import fake_trainer

    class Rows:
        def __init__(self):
            self.rows = []

        def log_metrics(self, row, step):
            self.rows.append((step, row))

    logger, values = Rows(), BatchValues()
    trainer = fake_trainer(0)
    trainer.loggers = [logger]
    values.add({"difficulty/seen": 4.0})
    values.add({"difficulty/skipped": 1.0})
    values.publish(trainer)
    trainer.fit_loop.epoch_loop.total_batch_idx = 1
    values.publish(trainer)  # nothing measured in batch 1
    assert logger.rows == [(0, {"difficulty/seen": 4.0, "difficulty/skipped": 1.0})]
    assert float(trainer.callback_metrics["difficulty/seen"]) == 4.0


def csv_rows(logger) -> list[dict[str, str]]:
    with (Path(logger.log_dir) / "metrics.csv").open() as file:
        return [{key: value for key, value in row.items() if value} for row in csv.DictReader(file)]


def test_metrics_of_one_step_logged_in_several_calls_make_one_row_unless_a_name_repeats(tmp_path):
    (csv_logger, _) = default_loggers(str(tmp_path))
    csv_logger.log_metrics({"loss": 1.0}, step=0)
    csv_logger.log_metrics({"reward": 2.0}, step=0)  # a callback's, at the module's step: joins its row
    csv_logger.log_metrics({"loss": 3.0}, step=1)
    csv_logger.log_metrics({"loss": 4.0}, step=1)  # the same name again: a row of its own
    csv_logger.log_metrics({"reward": 5.0}, step=2)  # another step: a row of its own
    csv_logger.save()
    assert csv_rows(csv_logger) == [
        {"step": "0", "loss": "1.0", "reward": "2.0"},
        {"step": "1", "loss": "3.0"},
        {"step": "1", "loss": "4.0"},
        {"step": "2", "reward": "5.0"},
    ]


def test_a_resumed_csv_keeps_the_rows_before_its_first_step_and_the_new_rows_from_there_on(tmp_path):
    """Killed after logging steps 0 to 3, resumed from the checkpoint at step 2: steps 2 and 3 are logged again, and
    those rows replace the old ones; the rows of a later save are added to them."""
    (crashed, _) = default_loggers(str(tmp_path))
    for step in range(4):
        crashed.log_metrics({"loss": float(step)}, step=step)
    crashed.save()
    (resumed, _) = default_loggers(str(tmp_path), resume=True)
    assert resumed.log_dir == crashed.log_dir
    resumed.log_metrics({"loss": 20.0}, step=2)
    resumed.log_metrics({"loss": 30.0}, step=3)
    resumed.save()
    resumed.log_metrics({"loss": 40.0, "reward": 1.0}, step=4)  # a new column too
    resumed.save()
    assert csv_rows(resumed) == [
        {"step": "0", "loss": "0.0"},
        {"step": "1", "loss": "1.0"},
        {"step": "2", "loss": "20.0"},
        {"step": "3", "loss": "30.0"},
        {"step": "4", "loss": "40.0", "reward": "1.0"},
    ]


@pytest.mark.parametrize("resumed", [False, True], ids=["new column", "resumed"])
def test_a_csv_rewrite_cut_short_leaves_the_rows_already_written(tmp_path, monkeypatch, resumed):
    """metrics.csv is written again whole when a column appears (the first evaluation's) and at a resume's first save:
    a full disk (or a kill) in the middle of that write leaves the file as it was, not emptied."""
    (logger, _) = default_loggers(str(tmp_path))
    for step in range(3):
        logger.log_metrics({"loss": float(step)}, step=step)
    logger.save()
    before = csv_rows(logger)
    if resumed:
        (logger, _) = default_loggers(str(tmp_path), resume=True)
    logger.log_metrics({"loss": 9.0, "val/reward": 1.0}, step=3)

    def disk_full(writer, rows):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(csv.DictWriter, "writerows", disk_full)
    with pytest.raises(OSError, match="No space left"):
        logger.save()
    assert csv_rows(logger) == before
    assert [p.name for p in Path(logger.log_dir).iterdir() if p.name.startswith(".")] == []


def test_a_resumed_csv_writer_removes_the_file_a_killed_rewrite_left(tmp_path):
    (logger, _) = default_loggers(str(tmp_path))
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.save()
    left = Path(logger.log_dir) / ".metrics.csv.tmp-12345"  # a rewrite killed before its rename
    left.write_text("step,loss\n")
    (resumed, _) = default_loggers(str(tmp_path), resume=True)
    resumed.log_metrics({"loss": 2.0}, step=1)
    resumed.save()
    assert not left.exists() and csv_rows(resumed) == [{"step": "0", "loss": "1.0"}, {"step": "1", "loss": "2.0"}]


def test_a_full_disk_met_by_the_loggers_names_their_folder_and_is_printed_as_one_line(tmp_path, monkeypatch):
    """A write or flush that meets a full disk raises ``OSError(28)`` without a file name, which gpo took for a bug
    and showed as a 95-line traceback; named, ``gpo`` prints it in one line. tensorboardX's exit hook does not try
    the failed flush again (it printed another traceback below the message)."""
    from tensorboardX.record_writer import RecordWriter

    from gpo.cli import is_user_error

    def disk_full(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():  # tensorboardX's writer thread flushes too
            raise OSError(28, "No space left on device")

    csv_logger, tensorboard = default_loggers(str(tmp_path))
    for logger in (csv_logger, tensorboard):
        logger.log_metrics({"loss": 1.0}, step=0)
    monkeypatch.setattr(RecordWriter, "flush", disk_full)
    monkeypatch.setattr(csv.DictWriter, "writerows", disk_full)
    for failing in (csv_logger.save, tensorboard.save, lambda: tensorboard.finalize("failed")):
        with pytest.raises(OSError) as raised:
            failing()
        assert raised.value.errno == 28 and raised.value.filename is not None and is_user_error(raised.value)
        assert Path(raised.value.filename).is_relative_to(tmp_path)
    tensorboard.experiment.file_writer.event_writer.close()  # what the exit hook calls: nothing left to flush


@pytest.mark.parametrize("repeated", [True, False], ids=["evaluation_repeated", "evaluation_first"])
def test_a_resume_that_evaluates_its_last_step_again_keeps_that_steps_training_row(tmp_path, repeated):
    """Stopped by a signal during the evaluation after step 3, a run resumes by evaluating step 3 again (told by
    ResumeCheckpoint) and trains from step 4: its first row, step 3's val/* values, replaced the training row of step
    3, which no run logs again. Any other run's rows replace the earlier rows from its first step on."""
    (stopped, _) = default_loggers(str(tmp_path))
    for step in range(4):
        stopped.log_metrics({"loss": float(step), "epoch": 0}, step=step)
    stopped.save()
    (resumed, _) = default_loggers(str(tmp_path), resume=True)
    if repeated:
        resumed.evaluation_repeated_first()
    resumed.log_metrics({"val/reward": 0.5, "epoch": 0}, step=3)
    resumed.save()
    resumed.log_metrics({"loss": 4.0, "epoch": 0}, step=4)
    resumed.save()
    assert csv_rows(resumed)[3:] == [
        {"step": "3", "val/reward": "0.5", "epoch": "0", **({"loss": "3.0"} if repeated else {})},
        {"step": "4", "loss": "4.0", "epoch": "0"},
    ]


@pytest.mark.parametrize("repeated", [True, False], ids=["evaluation_repeated", "evaluation_first"])
def test_a_resume_that_evaluates_again_first_starts_its_tensorboard_session_at_the_next_step(tmp_path, repeated):
    """TensorBoard drops the earlier points at the session start's step and later: marked at the step of an evaluation
    done again (told by ResumeCheckpoint), the start dropped that step's training values, which no run logs again.
    An evaluation that is the first thing a run logs for another reason (one logged before a kill, logged again)
    starts the session at its step: the earlier point is dropped, not shown twice."""
    (_, tensorboard) = default_loggers(str(tmp_path))
    if repeated:
        tensorboard.evaluation_repeated_first()
    tensorboard.log_metrics({"val/reward": 0.5, "epoch": 0}, step=3)
    tensorboard.log_metrics({"loss": 4.0}, step=4)
    tensorboard.finalize("success")
    events = [e for e in tensorboard_events(tmp_path) if not e.file_version]
    assert [(e.step, e.session_log.status == event_pb2.SessionLog.START) for e in events] == [
        (4 if repeated else 3, True),
        (3, False),
        (4, False),
    ]


def test_a_resume_within_the_same_second_keeps_the_earlier_tensorboard_file(tmp_path, monkeypatch):
    """tensorboardX names an event file by the second it opens it, and opens it with "wb": a resumed run's file
    opened in the same second as the earlier run's replaced it, and every earlier point was lost."""
    from tensorboardX import event_file_writer

    monkeypatch.setattr(event_file_writer.time, "time", lambda: 1_000_000_000.0)  # both files in one second
    for step, resume in [(0, False), (1, True)]:
        (_, tensorboard) = default_loggers(str(tmp_path), resume=resume)
        tensorboard.log_metrics({"loss": float(step)}, step=step)
        tensorboard.finalize("success")
    files = list(tmp_path.rglob("events.out.tfevents.*"))
    assert len(files) == 2 and sorted(e.step for path in files for e in events_of(path) if e.summary.value) == [0, 1]


def test_a_filename_suffix_given_to_the_tensorboard_logger_is_kept(tmp_path):
    # the unique suffix gpo adds is a default: one given by the user names the file
    tensorboard = loggers.OneEventTensorBoardLogger(str(tmp_path), filename_suffix=".mine")
    tensorboard.log_metrics({"loss": 1.0}, step=0)
    tensorboard.finalize("success")
    assert [path.name.endswith(".mine") for path in tmp_path.rglob("events.out.tfevents.*")] == [True]


def test_an_os_error_that_names_its_file_keeps_that_name_through_the_loggers(tmp_path):
    # only an error without a file name (a full disk met by a flush) is given the loggers' folder
    with pytest.raises(PermissionError) as raised, loggers.naming(str(tmp_path)):
        raise PermissionError(13, "Permission denied", str(tmp_path / "metrics.csv"))
    assert raised.value.filename == str(tmp_path / "metrics.csv")


def test_a_resume_of_a_root_without_runs_starts_version_0(tmp_path):
    assert [logger.version for logger in default_loggers(str(tmp_path), resume=True)] == [0, 0]


def test_csv_rows_wait_save_every_s_after_the_last_write_not_after_the_start(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(loggers, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    (csv_logger, _) = default_loggers(str(tmp_path))
    clock[0] = loggers.SAVE_EVERY_S + 1  # the first row logged that long after the start is written with it
    csv_logger.log_metrics({"loss": 1.0}, step=0)
    clock[0] += 1  # one second after that write: held
    csv_logger.log_metrics({"loss": 2.0}, step=1)
    assert csv_rows(csv_logger) == [{"step": "0", "loss": "1.0"}]


def test_tensorboard_tags_carry_the_loggers_prefix_and_dict_values_keep_lightnings_groups(tmp_path):
    tensorboard = loggers.OneEventTensorBoardLogger(str(tmp_path), prefix="fit", default_hp_metric=False)
    tensorboard.log_metrics({"loss": 0.5, "pair": {"a": 1.0, "b": 2.0}}, step=3)
    tensorboard.finalize("success")
    (main,) = Path(tensorboard.log_dir).glob("events.out.tfevents.*")
    scalars = [(e.step, {v.tag: v.simple_value for v in e.summary.value}) for e in events_of(main) if e.summary.value]
    assert scalars == [(3, {"fit-loss": 0.5})]
    folder = Path(tensorboard.log_dir)
    groups = sorted(str(path.parent.relative_to(folder)) for path in folder.glob("*/*/events.out.tfevents.*"))
    assert groups == ["fit-pair/a", "fit-pair/b"]  # add_scalars: a folder per value of the group


def unused_run(tmp_path, *, files=("config.yaml", "tb/events.out.tfevents.1"), **trainer):
    """A version folder holding ``files``, and the trainer of a run that stopped before its first batch."""
    folder = tmp_path / "lightning_logs" / "version_0"
    for name in files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("")
    state = {"is_global_zero": True, "global_step": 0, "total_batch_idx": -1} | trainer
    epoch_loop = SimpleNamespace(total_batch_idx=state.pop("total_batch_idx"))
    logger = SimpleNamespace(log_dir=str(folder))
    return folder, SimpleNamespace(**state, fit_loop=SimpleNamespace(epoch_loop=epoch_loop), loggers=[logger])


def test_the_version_folder_of_a_run_stopped_before_its_first_batch_is_removed(tmp_path):
    folder, trainer = unused_run(tmp_path)
    loggers.discard_unused_version(trainer)
    assert not folder.exists()


@pytest.mark.parametrize(
    "kept",
    [
        {"is_global_zero": False},  # another process: rank 0 alone touches the disk
        {"global_step": 1},
        {"total_batch_idx": 0},  # its first batch started
        {"files": ("config.yaml", "tb/events.out.tfevents.1", "metrics.csv")},  # it logged
        {"files": ("config.yaml", "tb/events.out.tfevents.1", "tb/events.out.tfevents.2")},
    ],
)
def test_a_version_folder_that_a_run_used_or_another_process_owns_is_kept(tmp_path, kept):
    folder, trainer = unused_run(tmp_path, **kept)
    loggers.discard_unused_version(trainer)
    assert (folder / "config.yaml").is_file()


def test_the_session_start_is_marked_at_the_first_logged_step_not_at_a_call_without_one(tmp_path):
    (_, tensorboard) = default_loggers(str(tmp_path))
    tensorboard.log_metrics({"hp": 1.0})  # no step
    tensorboard.log_metrics({"loss": 0.5}, step=5)
    tensorboard.finalize("success")
    starts = [e.step for e in tensorboard_events(tmp_path) if e.session_log.status == event_pb2.SessionLog.START]
    assert starts == [5]
