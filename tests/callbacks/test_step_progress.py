"""StepProgressBar: optimiser steps out of trainer.max_steps, over epochs, with several steps per batch and resumed."""

import io
import logging
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from torch.utils.data import DataLoader

import gpo.callbacks.step_progress
from gpo.callbacks import ExportPolicy, ResumeCheckpoint, StepProgressBar

STEPS_PER_BATCH = 2  # as with model.optim.number_of_minibatches = 2
BATCHES_PER_EPOCH = 5


class TwoStepsPerBatch(L.LightningModule):
    """A linear model that takes ``STEPS_PER_BATCH`` optimiser steps per batch, as GPOModule does with minibatches."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        self.trainer.progress_bar_metrics["reward"] = torch.tensor(0.5)  # a tensor, as gpo.train.metrics.publish gives
        optimizer = self.optimizers()
        for _ in range(STEPS_PER_BATCH):
            optimizer.zero_grad()
            self.manual_backward(self.layer(batch).pow(2).mean())
            optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(torch.randn(BATCHES_PER_EPOCH, 2), batch_size=1)


class Seen(L.Callback):
    """What the progress bar showed after each batch, as (shown, total, global_step)."""

    def __init__(self) -> None:
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = trainer.progress_bar_callback.train_progress_bar
        self.rows.append((bar.n, bar.total, trainer.global_step))


def fit(tmp_path, bar, max_steps, ckpt_path=None, max_epochs=None):
    seen = Seen()
    trainer = L.Trainer(
        max_steps=max_steps, max_epochs=max_epochs, callbacks=[bar, seen], logger=False, enable_model_summary=False,
        default_root_dir=tmp_path, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(TwoStepsPerBatch(), ckpt_path=ckpt_path)
    return trainer, seen.rows


def test_the_bar_counts_optimiser_steps_out_of_max_steps_across_epochs(tmp_path):
    # 14 steps = 7 batches: the whole first epoch of 5 and 2 batches of the second
    trainer, rows = fit(tmp_path, StepProgressBar(), max_steps=14)
    assert rows == [(2 * batch, 14, 2 * batch) for batch in range(1, 8)]
    bar = trainer.progress_bar_callback.train_progress_bar
    assert bar.desc.startswith("Epoch 1, step") and "reward=0.5" in bar.postfix, (bar.desc, bar.postfix)
    assert bar.initial == 0  # the count, its rate and its elapsed time run on over the second epoch, not restarted


class Redraws(L.Callback):
    """The global step at each redraw of the bar's metrics (``set_postfix``), counted from the start of training."""

    def __init__(self) -> None:
        self.steps = []

    def on_train_start(self, trainer, pl_module):
        bar = trainer.progress_bar_callback.train_progress_bar
        set_postfix = bar.set_postfix

        def counted(*args, **kwargs):
            self.steps.append(trainer.global_step)
            return set_postfix(*args, **kwargs)

        bar.set_postfix = counted


# Lightning's bar also redraws when an epoch ends (after steps 10 and 14, the second epoch cut short by max_steps)
@pytest.mark.parametrize(
    ("interval_s", "refresh_rate", "max_steps", "redrawn"),
    [
        (0.0, 1, 14, [2, 4, 6, 8, 10, 10, 12, 14, 14]),
        (3600.0, 1, 14, [2, 10, 14, 14]),
        (0.0, 3, 14, [6, 10, 14, 14]),  # the third batch of each epoch (the second epoch has 2), and the last step
        (3600.0, 1, 13, [2, 10, 14, 14]),  # the last batch's second step goes past max_steps: still the last step
    ],
)
def test_the_bar_is_redrawn_at_most_every_interval_and_at_the_last_step(
    tmp_path, monkeypatch, interval_s, refresh_rate, max_steps, redrawn
):
    """Redraws cost about 0.3 ms each (metrics to the host, formatted, written): a fast run's bar is redrawn every
    ``REDRAW_INTERVAL_S`` seconds, at its first batch and at its last step, while its count moves every batch."""
    monkeypatch.setattr(gpo.callbacks.step_progress, "REDRAW_INTERVAL_S", interval_s)
    redraws, seen = Redraws(), Seen()
    trainer = L.Trainer(
        max_steps=max_steps, callbacks=[StepProgressBar(refresh_rate), redraws, seen], logger=False,
        enable_model_summary=False,
        default_root_dir=tmp_path, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(TwoStepsPerBatch())
    assert redraws.steps == redrawn
    assert [n for n, _, _ in seen.rows] == [2 * batch for batch in range(1, 8)]
    assert seen.rows[-1][:2] == (14, 14)  # past max_steps=13, 14 of 14: tqdm drew a total below the count as "14/?"
    assert "reward=0.5" in trainer.progress_bar_callback.train_progress_bar.postfix


def test_lightnings_own_bar_counts_batches_of_the_epoch_instead(tmp_path):
    # what StepProgressBar replaces: totals capped at the steps left, counts restarting every epoch
    _, rows = fit(tmp_path, TQDMProgressBar(), max_steps=14)
    assert [(n, total) for n, total, _ in rows] == [(1, 5), (2, 5), (3, 5), (4, 5), (5, 5), (1, 4), (2, 4)]


@pytest.mark.parametrize("bar", [TQDMProgressBar, StepProgressBar])
def test_without_max_steps_the_bar_is_lightnings_counting_the_batches_of_each_epoch(tmp_path, bar):
    trainer, rows = fit(tmp_path, bar(), max_steps=-1, max_epochs=2)
    assert [(n, total) for n, total, _ in rows] == [(batch, 5) for batch in range(1, 6)] * 2
    assert trainer.progress_bar_callback.train_progress_bar.desc.startswith("Epoch 1")


class SaveAtStep(L.Callback):
    def __init__(self, path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, *_):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_a_resumed_run_counts_on_from_its_checkpoint(tmp_path):
    trainer, _ = fit(tmp_path / "first", StepProgressBar(), max_steps=6)
    checkpoint = tmp_path / "first.ckpt"
    trainer.save_checkpoint(checkpoint)
    resumed, rows = fit(tmp_path / "second", StepProgressBar(), max_steps=10, ckpt_path=checkpoint)
    assert rows == [(8, 10, 8), (10, 10, 10)]
    assert resumed.progress_bar_callback.train_progress_bar.initial == 6  # the rate counts this run's steps only


def test_a_run_resumed_from_a_checkpoint_written_mid_epoch_counts_on_too(tmp_path):
    """As ``gpo fit``'s checkpoints are written: Lightning calls no ``on_train_epoch_start`` before resuming."""
    checkpoint = tmp_path / "mid.ckpt"
    trainer = L.Trainer(
        max_steps=8, callbacks=[StepProgressBar(), SaveAtStep(checkpoint, 6)], logger=False,
        enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(TwoStepsPerBatch())
    resumed, rows = fit(tmp_path / "second", StepProgressBar(), max_steps=10, ckpt_path=checkpoint)
    assert rows == [(8, 10, 8), (10, 10, 10)]
    assert resumed.progress_bar_callback.train_progress_bar.desc.startswith("Epoch 0, step")


class FailsAtBatch3(TwoStepsPerBatch):
    def training_step(self, batch, batch_idx):
        if batch_idx == 3:
            raise ValueError("a reward function failed")
        return super().training_step(batch, batch_idx)


class FailsInSanityCheck(TwoStepsPerBatch):
    """Fails in Lightning's sanity check, whose bar (not kept on screen) is the only one drawn."""

    def validation_step(self, batch, batch_idx):
        raise ValueError("a reward function failed")

    def val_dataloader(self):
        return DataLoader(torch.randn(2, 2), batch_size=1)


class FailsInAnEvaluation(FailsInSanityCheck):
    """Fails in the evaluation after step 4, whose bar is drawn below the training bar (kept on screen)."""

    def validation_step(self, batch, batch_idx):
        if self.trainer.global_step >= 4 and batch_idx == 1:
            raise ValueError("a reward function failed")


@pytest.mark.parametrize(
    ("module", "drawn", "settings"),
    [
        (FailsAtBatch3, "Epoch 0, step", {}),
        (FailsInSanityCheck, "Sanity Check", {}),
        (FailsInAnEvaluation, "Validation", {"val_check_interval": 2, "num_sanity_val_steps": 0}),
    ],
)
def test_a_run_that_fails_leaves_the_bar_line_ended_for_the_error(
    tmp_path, capsys, monkeypatch, module, drawn, settings
):
    """gpo prints the error next: on a line of its own, not after the bar's last redraw (a bar kept on screen ends
    its line when closed, one cleared from it gets a line end written); gpo's warnings go back to logging's own."""
    monkeypatch.setattr(logging.root, "handlers", [])  # as outside pytest: the bar adds its handler for gpo's warnings
    trainer = L.Trainer(max_steps=20, callbacks=[StepProgressBar()], logger=False, enable_checkpointing=False,
                        enable_model_summary=False, default_root_dir=tmp_path, **settings)  # fmt: skip
    with pytest.raises(ValueError, match="a reward function failed"):
        trainer.fit(module())
    out = capsys.readouterr().out
    assert drawn in out and out.endswith("\n") and not out.endswith("\n\n"), repr(out[-200:])
    assert not logging.getLogger("gpo").handlers  # Lightning calls no teardown after an error


class WarnsAtBatch3(TwoStepsPerBatch):
    def training_step(self, batch, batch_idx):
        if batch_idx == 3:
            logging.getLogger("gpo.rollout.test").warning("vLLM server X stopped answering")
        return super().training_step(batch, batch_idx)


def test_a_warning_during_the_run_gets_a_line_of_its_own_above_the_bar(tmp_path, monkeypatch):
    """Bar and warning on one terminal (one stream here): the bar's line is cleared before the warning, which ends its
    line, and the bar is drawn again below it; the handler is gone after the run. Python's last resort (no handler)
    wrote the warning right after the bar's last redraw, on the bar's line."""
    screen = io.StringIO()
    monkeypatch.setattr(logging.root, "handlers", [])  # as outside pytest, whose capture handlers sit there
    monkeypatch.setattr("sys.stdout", screen)
    monkeypatch.setattr("sys.stderr", screen)
    monkeypatch.setattr(gpo.callbacks.step_progress, "REDRAW_INTERVAL_S", 0.0)
    trainer = L.Trainer(max_steps=20, callbacks=[StepProgressBar()], logger=False, enable_checkpointing=False,
                        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(WarnsAtBatch3())
    text = screen.getvalue()
    before, after = text.split("vLLM server X stopped answering", 1)
    assert before.endswith("\r") and before.rstrip("\r").endswith(" "), repr(before[-120:])  # the bar's line cleared
    assert after.startswith("\n") and "step" in after  # the bar again, below
    assert not logging.getLogger("gpo").handlers


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StepProgressBar(refresh_rate=0), "refresh_rate=0 must be an int >= 1"),
        (lambda: StepProgressBar(refresh_rate=1.5), "refresh_rate=1.5 must be an int >= 1"),
        (lambda: ExportPolicy(folder=3), r"ExportPolicy folder=3 must be a path, or None for <log dir>/export"),
        (lambda: ResumeCheckpoint(every_n_train_steps=1.5), "every_n_train_steps=1.5 must be an int >= 1"),
    ],
)
def test_other_callbacks_refuse_settings_of_the_wrong_kind_when_built(make, message):
    """Given in Python, no parser checks them: each failed later (or never: a float step count) far from the setting."""
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("configured", [False, True])
def test_a_warning_during_the_run_is_written_once_to_stderr(tmp_path, capsys, monkeypatch, configured):
    """Whether gpo's bar writes it (no logging set up) or the handler the user set up does, alone (not both); 8 steps:
    the first epoch's 4 batches, the warning given at its fourth."""
    handlers = [logging.StreamHandler(sys.stderr)] if configured else []  # sys.stderr: pytest's capture here
    monkeypatch.setattr(logging.root, "handlers", handlers)
    trainer = L.Trainer(max_steps=8, callbacks=[StepProgressBar()], logger=False, enable_checkpointing=False,
                        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(WarnsAtBatch3())
    out, err = capsys.readouterr()
    assert err.count("vLLM server X stopped answering") == 1 and "vLLM server" not in out, (out[-300:], err[-300:])
