"""The loggers ``gpo fit`` writes to: CSV and TensorBoard in one version folder, continued (never erased) on resume."""

from __future__ import annotations

import csv
from pathlib import Path

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class ContinuedWriter(ExperimentWriter):
    """Lightning's CSV experiment writer, except that an existing ``metrics.csv`` is continued instead of deleted.

    The rows already in the file stay, but those at or after the first step logged now: a run resumed from a
    checkpoint logs again the steps between that checkpoint and the moment it stopped, and their new rows replace
    the old ones.
    """

    def _check_log_dir_exists(self) -> None:
        self._kept: list[dict[str, str]] | None = None
        path = Path(self.metrics_file_path)
        if path.is_file():
            with path.open(newline="") as file:
                self._kept = list(csv.DictReader(file))
            self.metrics_keys = sorted({key for row in self._kept for key in row})

    def save(self) -> None:
        if self._kept is not None and self.metrics:
            first = min(int(row["step"]) for row in self.metrics)
            kept = [row for row in self._kept if not row.get("step") or int(row["step"]) < first]
            self._kept = None
            self._record_new_keys()
            with open(self.metrics_file_path, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(kept)
        super().save()


class ContinuedCSVLogger(CSVLogger):
    """``CSVLogger`` whose version folder, when it already holds a ``metrics.csv``, is continued (see
    ``ContinuedWriter``): a resumed run keeps every metric it logged before."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuedWriter(log_dir=self.log_dir)
        return self._experiment


def default_loggers(root: str, resume: bool = False) -> list[Logger]:
    """CSV and TensorBoard loggers sharing ``<root>/lightning_logs/version_N/`` (TensorBoard's files in ``tb/``);
    ``resume`` continues the newest existing version (its metrics kept) instead of starting a new one.

    The CSV logger comes first, so the saved ``config.yaml`` lands next to ``metrics.csv``."""
    csv_logger = ContinuedCSVLogger(root)
    if resume and csv_logger.version > 0:
        csv_logger = ContinuedCSVLogger(root, version=csv_logger.version - 1)  # the next free version minus one
    return [csv_logger, TensorBoardLogger(root, version=csv_logger.version, sub_dir="tb", default_hp_metric=False)]
