"""``trainer.precision: 16-mixed``: float16 autocast with a loss scaler. Its gradients are ``scale`` times the loss's
until the optimiser step unscales them; gpo clips and reports them unscaled, and an overflow lowers the scale without
stopping the run. On the CPU a CPU ``GradScaler`` in Lightning's ``MixedPrecision`` stands in for a GPU's."""

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

from gpo.callbacks import ResumeCheckpoint
from gpo.train.optimization import Optimization
from tests.tiny import prompts, quiet_trainer, tiny_module, write_assets


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_assets(tmp_path_factory.mktemp("loss_scaling"), examples=2000)


class Logged(L.Callback):
    """Each training batch's ``grad/norm``, ``train/nonfinite_skipped`` and reward."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        keys = ("grad/norm", "train/nonfinite_skipped", "reward", "train/loss_scale")
        self.rows.append({key: float(trainer.callback_metrics[key]) for key in keys if key in trainer.callback_metrics})


class NaNGradients(L.Callback):
    """Every gradient of the policy's first parameter is NaN (the loss stays finite)."""

    def on_train_start(self, trainer, pl_module):
        next(pl_module.policy.parameters()).register_hook(lambda grad: torch.full_like(grad, math.nan))


def fit(
    workspace, steps: int, scaler: torch.amp.GradScaler | None, *callbacks: L.Callback, ckpt_path: Path | None = None,
    **module_kwargs,
) -> tuple[Logged, L.Trainer]:  # fmt: skip
    model, data = workspace
    L.seed_everything(0)
    module = tiny_module(model, group_size=8, old_logprobs="trainer", **module_kwargs)
    logged = Logged()
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)] if scaler is not None else []
    checkpointing = any(isinstance(callback, ModelCheckpoint) for callback in callbacks)
    trainer = quiet_trainer(steps, [logged, *callbacks], plugins=plugins, enable_checkpointing=checkpointing)
    trainer.fit(module, prompts(model, data, 8), ckpt_path=ckpt_path)
    return logged, trainer


@pytest.mark.parametrize(("max_grad_norm", "minibatches"), [(0.1, 1), (None, 2)], ids=["clipped", "two_minibatches"])
def test_the_gradient_is_clipped_and_reported_unscaled(workspace, max_grad_norm, minibatches):
    """Update by update, float32's gradient norm (to float16's rounding), not 2^16 times it (the scaler's initial
    scale): the same samples, so the same updates, clipped at the same bound (0.1 is below these norms), or not
    clipped at all, and with two updates a step. Four steps: later, float16's rounding may flip a sampled token."""
    optim = Optimization(lr=1e-3, max_grad_norm=max_grad_norm, number_of_minibatches=minibatches)
    full, _ = fit(workspace, 4 * minibatches, None, optim=optim)
    scaled, trainer = fit(workspace, 4 * minibatches, torch.amp.GradScaler("cpu"), optim=optim)
    assert trainer.precision == "16-mixed"
    expected, got = [row["grad/norm"] for row in full.rows], [row["grad/norm"] for row in scaled.rows]
    assert any(norm > 0 for norm in expected)
    assert got == pytest.approx(expected, rel=0.01), (expected, got)


def test_an_overflow_lowers_the_scale_and_the_run_goes_on(workspace):
    """A scale of 2^40 overflows float16's gradients: the scaler skips that update and lowers its scale (to 2^16
    here), which is no non-finite step of gpo's (one in a row would stop this run), and the run trains on."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-24)
    optim = Optimization(lr=1e-3, max_consecutive_nonfinite=1)
    scaled, _ = fit(workspace, 12, scaler, optim=optim)
    skipped = [row["train/nonfinite_skipped"] for row in scaled.rows]
    assert skipped.count(1.0) >= 1 and scaler.get_scale() <= 2.0**16, (skipped, scaler.get_scale())
    first = skipped.index(1.0)  # the logged scale: 2^40 until that step, lowered by it
    assert [row["train/loss_scale"] for row in scaled.rows[: first + 1]] == [2.0**40] * first + [2.0**16]
    applied = [row["grad/norm"] for row in scaled.rows if row["train/nonfinite_skipped"] == 0 and row["grad/norm"] > 0]
    assert applied and all(math.isfinite(norm) and norm < 100 for norm in applied), applied


def test_a_resumed_run_restores_the_loss_scale_and_ends_as_the_run_that_never_stopped(workspace, tmp_path):
    """The scaler's state is in the checkpoint: a run whose first step overflowed (its scale lowered from 2^40 to
    2^16) and that resumed after 4 steps ends with the weights and the scale of the 8-step run. Resumed at 2^40, its
    fifth step would have been skipped."""

    def scaler() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-24)

    optim = Optimization(lr=1e-3, lr_schedule="constant")  # a decaying schedule depends on max_steps by design
    whole_scaler, first_scaler, rest_scaler = scaler(), scaler(), scaler()
    _, whole = fit(workspace, 8, whole_scaler, optim=optim)
    fit(workspace, 4, first_scaler, ResumeCheckpoint(tmp_path), optim=optim)
    assert first_scaler.get_scale() == 2.0**16
    _, rest = fit(workspace, 8, rest_scaler, ResumeCheckpoint(tmp_path), ckpt_path=tmp_path / "last.ckpt", optim=optim)
    assert rest_scaler.get_scale() == whole_scaler.get_scale()
    expected, got = whole.lightning_module.policy.state_dict(), rest.lightning_module.policy.state_dict()
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())


def test_a_gradient_that_stays_nan_still_stops_the_run(workspace):
    """The scaler takes a NaN gradient for an overflow and lowers its scale; once the scale is below 1 (where float16
    cannot overflow) the non-finite updates count, and two in a row stop the run."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    optim = Optimization(lr=1e-3, max_consecutive_nonfinite=2)
    with pytest.raises(FloatingPointError, match="2 updates in a row had a non-finite loss or gradient"):
        fit(workspace, 12, scaler, NaNGradients(), optim=optim)
    assert scaler.get_scale() == 0.5  # 4 -> 2 -> 1 -> 0.5, then the two updates the guard counted
