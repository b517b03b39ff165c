"""Step metrics reach the loggers every ``log_every_n_steps`` batches with the values logging every batch would write,
the callbacks and the progress bar every batch, and logging never changes the run."""

import csv

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

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


def test_logging_never_changes_the_run(tiny_assets, tmp_path):
    quiet, _ = fit(tiny_assets, tmp_path)  # no logger at all
    logged, _ = fit(tiny_assets, tmp_path, logger=CSVLogger(tmp_path / "logged"), log_every_n_steps=1)
    for (name, a), b in zip(quiet.policy.named_parameters(), logged.policy.parameters(), strict=True):
        assert torch.equal(a, b), name
