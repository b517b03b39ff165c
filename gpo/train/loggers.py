"""The loggers ``gpo fit`` writes to: CSV and TensorBoard in one version folder, continued (never erased) on resume.

Logged rows are written to disk at most every ``SAVE_EVERY_S`` seconds (the CSV rows with the first row logged that
long after the last write, TensorBoard's by its writer thread), after each evaluation (Lightning saves the loggers
then), at each checkpoint (``GPOModule.on_save_checkpoint`` saves every logger, so a run killed and resumed loses no
row) and at the end, but not at every logged step: writing costs about 0.7 ms each time. A resumed run logs again the
steps between its checkpoint and the crash: the CSV keeps the new rows alone, and TensorBoard drops the older points
from there on (each TensorBoard logger marks its first step as a session start).
"""

from __future__ import annotations

import csv
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import tensorboardX
from lightning import Trainer
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only
from tensorboardX.event_file_writer import _EventLoggerThread
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from torch import Tensor
from typing_extensions import override

from gpo.plot import trained

SAVE_EVERY_S = 10.0


class ContinuedWriter(ExperimentWriter):
    """Lightning's CSV experiment writer, except that an existing ``metrics.csv`` is continued instead of deleted,
    and that a step's metrics logged in several calls make one row.

    The rows already in the file stay, but those at or after the first step logged now: a run resumed from a
    checkpoint logs again the steps between that checkpoint and the moment it stopped, and their new rows replace
    the old ones. Metrics logged at the step of the last row not yet written, under other names (the module's and
    each callback's), join that row.
    """

    def log_metrics(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics_dict, step)
        if len(self.metrics) > 1:
            last, new = self.metrics[-2], self.metrics[-1]
            if new["step"] == last["step"] and not (new.keys() & last.keys()) - {"step"}:
                last.update(self.metrics.pop())

    def _check_log_dir_exists(self) -> None:
        self.evaluation_repeated_first = False  # set by ContinuedCSVLogger.evaluation_repeated_first
        self._kept: list[dict[str, str]] | None = None
        path = Path(self.metrics_file_path)
        for left in path.parent.glob(f".{path.name}.tmp-*"):  # a rewrite killed midway (replace_rows)
            left.unlink(missing_ok=True)
        if path.is_file():
            with path.open(newline="") as file:
                self._kept = list(csv.DictReader(file))
            self.metrics_keys = sorted({key for row in self._kept for key in row})

    def save(self) -> None:
        if self._kept is not None and self.metrics:
            first = min(int(row["step"]) for row in self.metrics)
            kept = [row for row in self._kept if not row.get("step") or int(row["step"]) < first]
            if self.evaluation_repeated_first:
                self._keep_training_values_at(first)
            self._kept = None
            self._record_new_keys()
            replace_rows(Path(self.metrics_file_path), self.metrics_keys, kept)
        super().save()

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        # Lightning's rewrite truncates the file first: a kill or a full disk meanwhile lost every row
        with open(self.metrics_file_path, newline="") as file:
            rows = list(csv.DictReader(file))
        replace_rows(Path(self.metrics_file_path), fieldnames, rows)

    def _keep_training_values_at(self, step: int) -> None:
        """The earlier run's values at ``step`` join the new row there, the evaluation done again: a run stopped by a
        signal during the evaluation after ``step`` resumes by evaluating it again and trains from the next step, so
        no run logs that step's training values again."""
        new = next(row for row in self.metrics if int(row["step"]) == step)
        for row in self._kept:
            if row.get("step") and int(row["step"]) == step:
                new.update({key: value for key, value in row.items() if value not in ("", None) and key not in new})


def replace_rows(path: Path, fieldnames: list[str], rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` as the CSV file ``path`` in one step: to ``.<name>.tmp-<pid>`` beside it, then renamed over
    it, so that a kill or a full disk midway leaves the previous file whole."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with temporary.open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class ContinuedCSVLogger(CSVLogger):
    """``CSVLogger`` whose version folder, when it already holds a ``metrics.csv``, is continued (see
    ``ContinuedWriter``): a resumed run keeps every metric it logged before. The rows are written with the first row
    logged ``SAVE_EVERY_S`` or more after the last write (and, as Lightning's, every ``flush_logs_every_n_steps``
    steps)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._saved_at = time.monotonic()

    @override
    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics, step)
        if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self.save()

    @override
    @rank_zero_only
    def save(self) -> None:
        with naming(self.log_dir):
            super().save()
        self._saved_at = time.monotonic()

    @rank_zero_only
    def evaluation_repeated_first(self) -> None:
        """The run's first logged step is an evaluation done again (``ResumeCheckpoint``: a resume of a run a signal
        stopped during that evaluation): the earlier run's training values at that step stay in its row."""
        self.experiment.evaluation_repeated_first = True

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuedWriter(log_dir=self.log_dir)
        return self._experiment


class OneEventTensorBoardLogger(TensorBoardLogger):
    """``TensorBoardLogger`` that writes the scalars of one ``log_metrics`` call as a single event, always through
    tensorboardX (a gpo dependency, whose event types it builds).

    The first step it writes is marked as the start of a session (``SessionLog.START``, as tensorboardX's
    ``purge_step`` does). In a run resumed from a checkpoint, which logs again the steps the run before it logged
    after that checkpoint, TensorBoard takes the second start in the folder for a restart and drops the earlier
    points at that step and later: each step is shown once (without the mark, twice). A resume that first evaluates
    again the step whose evaluation a signal stopped marks the next step (``evaluation_repeated_first``).

    tensorboardX sends every event through a 10-slot multiprocessing queue to its writer thread, so Lightning's
    ``add_scalar`` per key costs about 1 ms for 30 keys and blocks while the thread drains the queue; one event with
    30 values costs about 0.03 ms. TensorBoard reads both alike (a ``Summary`` may hold many values). Dict values
    (``add_scalars`` groups) keep Lightning's path.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session_started = False
        self._session_starts_after_first_step = False

    @property
    @rank_zero_experiment
    def experiment(self) -> tensorboardX.SummaryWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            # tensorboardX names a file by the second it opens it and opens it with "wb": a resume within the same
            # second as the run before it (a crash at start-up, requeued at once) emptied that run's file
            unique = {"filename_suffix": f".{os.getpid()}.{uuid.uuid4().hex[:8]}"}
            self._experiment = tensorboardX.SummaryWriter(log_dir=self.log_dir, **(unique | self._kwargs))
        return self._experiment

    def evaluation_repeated_first(self) -> None:
        """The run's first logged step is an evaluation done again (``ResumeCheckpoint``: a resume of a run a signal
        stopped during that evaluation), whose step's training values the earlier run logged and no run logs again:
        the session starts at the next step, or TensorBoard would drop them."""
        self._session_starts_after_first_step = True

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float | Tensor | dict], step: int | None = None) -> None:
        groups = {key: value for key, value in metrics.items() if isinstance(value, Mapping)}
        if groups:
            super().log_metrics(groups, step)
        if not self._session_started and step is not None:
            self._session_started = True
            first = step + self._session_starts_after_first_step
            start = Event(step=first, session_log=SessionLog(status=SessionLog.START))
            self.experiment._get_file_writer().add_event(start)
        prefix = f"{self._prefix}{self.LOGGER_JOIN_CHAR}" if self._prefix else ""
        values = [
            Summary.Value(tag=prefix + key, simple_value=float(value))  # float() also reads a one-element tensor
            for key, value in metrics.items() if key not in groups
        ]  # fmt: skip
        if values:
            self.experiment._get_file_writer().add_summary(Summary(value=values), step)  # as Lightning's hparams

    @override
    @rank_zero_only
    def save(self) -> None:
        """Every event logged so far on disk. tensorboardX's ``flush`` writes only the events its writer thread has
        already taken from its queue: an evaluation logged just before a checkpoint, then a crash, lost its points. So
        the thread is stopped (it writes what is queued before its stop signal), the file flushed, and a new thread
        started on the same queue and file (tensorboardX 2.6's internals; pyproject.toml keeps it below 2.7)."""
        with naming(self.log_dir):
            super().save()
            file_writer = self._experiment.file_writer if self._experiment is not None else None
            if file_writer is not None:  # None: closed (finalize); _get_file_writer would open a new, empty file
                events = file_writer.event_writer
                events._worker.stop()
                events.flush()
                events._worker = _EventLoggerThread(events._event_queue, events._ev_writer, events._flush_secs)
                events._worker.start()

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        try:
            with naming(self.log_dir):
                super().finalize(status)
        except OSError:
            # what could not be written now never will be: tensorboardX's exit hook would try again and print a
            # traceback under gpo's one-line error
            file_writer = self._experiment.file_writer if self._experiment is not None else None
            if file_writer is not None:
                file_writer.event_writer._closed = True
                file_writer.event_writer._worker.stop()
            raise


@contextmanager
def naming(folder: str) -> Iterator[None]:
    """An ``OSError`` without a file name (a full disk met by a write or a flush: ``[Errno 28] No space left on
    device``) raised again naming ``folder``, so that ``gpo`` prints it as one line with the path, not a traceback."""
    try:
        yield
    except OSError as error:
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror, folder) from error


def default_loggers(root: str, resume: bool = False) -> list[Logger]:
    """CSV and TensorBoard loggers sharing ``<root>/lightning_logs/version_N/`` (TensorBoard's files in ``tb/``);
    ``resume`` continues the run's existing version (``resumed_version``; its metrics kept) instead of starting a new
    one.

    The CSV logger comes first, so the saved ``config.yaml`` lands next to ``metrics.csv``."""
    csv_logger = ContinuedCSVLogger(root)
    if resume and csv_logger.version > 0:
        csv_logger = ContinuedCSVLogger(root, version=resumed_version(Path(csv_logger.root_dir), csv_logger.version))
    tensorboard = OneEventTensorBoardLogger(
        root, version=csv_logger.version, sub_dir="tb", default_hp_metric=False, flush_secs=SAVE_EVERY_S
    )  # its writer thread flushes every SAVE_EVERY_S
    return [csv_logger, tensorboard]


def resumed_version(logs: Path, next_free: int) -> int:
    """The version folder in ``logs`` that a resumed run continues: the newest whose ``metrics.csv`` holds training
    steps, passing over the newer ones ``gpo validate`` writes (its validation alone); else the newest of all."""
    for version in range(next_free - 1, -1, -1):
        metrics_csv = logs / f"version_{version}" / "metrics.csv"
        if metrics_csv.is_file() and trained(metrics_csv):
            return version
    return next_free - 1


def discard_unused_version(trainer: Trainer) -> None:
    """Remove the new ``version_N`` folder of a run that stopped before its first training batch (a setting refused at
    set-up) if it holds only what every start writes there (``config.yaml``, TensorBoard's first event file), so that
    the next run takes its number. Call it only for a folder this run created (not a resumed one). Global rank 0 alone
    touches the disk; no collective (the other processes may have stopped already)."""
    if not trainer.is_global_zero or trainer.global_step > 0 or trainer.fit_loop.epoch_loop.total_batch_idx >= 0:
        return
    folder = Path(trainer.loggers[0].log_dir)
    files = {path.relative_to(folder) for path in folder.rglob("*") if path.is_file()}
    events = {path for path in files if path.parent == Path("tb") and path.name.startswith("events.out.tfevents.")}
    if folder.is_dir() and files - events <= {Path("config.yaml")} and len(events) <= 1:
        shutil.rmtree(folder)
