"""A NaN/inf loss or gradient skips that optimiser update (weights and optimiser untouched, logged with the step and
the quantity) and training goes on; too many in a row stop the run with a message that says what to change."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from gpo.rollout import HFEngine, Sampling
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from gpo.train.data import PromptDataModule
from gpo.train.module import GPOModule
from gpo.train.nonfinite import NonfiniteGuard
from gpo.train.optimization import Optimization


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    model = save_tiny_model(root / "model", "llama", seed=0)
    data = write_jsonl(make_task("sort_digits", 64, seed=0), root / "train.jsonl")
    return str(model), str(data)


class Snapshots(L.Callback):
    """Weights and logged metrics after every training batch."""

    def __init__(self):
        self.weights, self.metrics = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights.append({k: v.detach().clone() for k, v in pl_module.policy.named_parameters()})
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def poison(module: GPOModule, batches: set[int], where: str) -> None:
    """Make the loss (``where="loss"``) or one parameter's gradient (``"grad"``) non-finite on those batches."""
    original = module.learner._micro_loss
    armed = [False]
    parameter = module.model.model.layers[0].mlp.up_proj.weight
    parameter.register_hook(lambda grad: torch.full_like(grad, float("inf")) if armed[0] else grad)

    def poisoned(*args):
        loss, metrics = original(*args)
        hit = module.trainer.fit_loop.epoch_loop.total_batch_idx in batches
        armed[0] = hit and where == "grad"
        return (loss * float("nan") if hit and where == "loss" else loss), metrics

    module.learner._micro_loss = poisoned


def length(prompts, completions, **_):
    """A reward that differs within groups from the first step (the tiny model's task reward starts at 0)."""
    return [len(c) / 3 for c in completions]


def fit(workspace, steps: int, batches: set[int], where: str, **optim) -> tuple[GPOModule, Snapshots]:
    model, data = workspace
    L.seed_everything(0)
    module = GPOModule(
        model,
        [length],
        group_size=4,
        engine=HFEngine(sampling=Sampling(max_new_tokens=3)),
        optim=Optimization(lr=1e-3, **optim),
    )
    poison(module, batches, where)
    snapshots = Snapshots()
    trainer = L.Trainer(
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[snapshots]
    )
    trainer.fit(module, PromptDataModule(data, tokenizer=model, prompts_per_step=4))
    return module, snapshots


@pytest.mark.parametrize(("where", "quantity"), [("loss", "loss=nan"), ("grad", "gradient norm=inf")])
def test_a_nonfinite_update_is_skipped_logged_and_training_goes_on(workspace, caplog, where, quantity):
    with caplog.at_level(logging.WARNING, logger="gpo"):
        module, snap = fit(workspace, 4, {2}, where)
    assert len(snap.weights) == 5  # 4 optimiser steps took 5 batches: batch 2 did not step
    assert module.trainer.global_step == 4
    for name, before in snap.weights[1].items():
        assert torch.equal(snap.weights[2][name], before), name  # the poisoned batch changed nothing
    assert any(not torch.equal(snap.weights[3][k], v) for k, v in snap.weights[2].items())  # the next one did
    assert [m["train/nonfinite_skipped"] for m in snap.metrics] == [0, 0, 1, 0, 0]
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())
    (message,) = [r.getMessage() for r in caplog.records if "update skipped" in r.getMessage()]
    assert f"optimiser step 2: {quantity}" in message and "(1 in a row)" in message
    if where == "grad":
        assert "non-finite gradients in model.layers.0.mlp.up_proj.weight" in message
    assert "non-finite inputs" not in message  # the advantages and log-probs the loss read were finite
    assert "(its inputs are finite: made by gate NoGate, aggregator SequenceMean or the policy's pass)" in message


def test_non_finite_advantages_are_named_as_the_cause(workspace):
    model, data = workspace
    module = GPOModule(model, [length], group_size=4, engine=HFEngine(sampling=Sampling(max_new_tokens=3)))
    credit = module.credit

    def nan_advantages(rollout, mask):  # an advantage estimator of one's own that divides by zero
        step, step_adv, adv = credit(rollout, mask)
        return step, step_adv, adv * float("nan")

    module.credit = nan_advantages
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module.learner.nonfinite.max_in_a_row = 1
    with pytest.raises(
        FloatingPointError, match=r"\(non-finite inputs: advantages\).*the advantage estimator"
    ) as raised:
        trainer.fit(module, PromptDataModule(data, tokenizer=model, prompts_per_step=4))
    assert "made by" not in str(raised.value)  # the parts are not suspected when an input was not finite


def test_too_many_nonfinite_updates_in_a_row_stop_the_run_with_the_fix(workspace):
    with pytest.raises(FloatingPointError, match=r"3 updates in a row .* raise optim\.max_consecutive_nonfinite"):
        fit(workspace, 10, set(range(100)), "loss", max_consecutive_nonfinite=3)


def test_the_streak_resets_after_a_good_update(workspace):
    module, snap = fit(workspace, 3, {0, 1, 3, 4}, "loss", max_consecutive_nonfinite=3)  # never 3 in a row
    assert module.trainer.global_step == 3 and len(snap.weights) == 7


def four_layers(bad_gradients: int) -> torch.nn.Module:
    """Four one-weight layers (``0.weight`` ... ``3.weight``); the first ``bad_gradients`` hold a gradient with one
    NaN among finite values, the others a finite one."""
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 1, bias=False) for _ in range(4)))
    for i, p in enumerate(model.parameters()):
        p.grad = torch.tensor([[1.0, float("nan") if i < bad_gradients else 2.0]])
    return model


def test_the_warning_names_each_input_with_a_non_finite_value_and_the_first_three_bad_gradients(caplog):
    """One non-finite value is enough to name an input or a parameter; integer inputs (a mask) are never named."""
    inputs = {
        "advantages": torch.tensor([1.0, float("nan")]),
        "old_logp": torch.tensor([0.0, 0.0]),
        "logp": torch.tensor([float("-inf"), -1.0]),
        "mask": torch.tensor([1, 0]),
    }
    with caplog.at_level(logging.WARNING, logger="gpo"):
        assert not NonfiniteGuard(3).finite(float("nan"), float("nan"), four_layers(4), 7, inputs)
    assert caplog.records[-1].getMessage() == (
        "optimiser step 7: loss=nan (non-finite inputs: advantages, logp) (non-finite gradients in 0.weight, 1.weight, "
        "2.weight, ...); update skipped, weights unchanged (1 in a row)"
    )
    with caplog.at_level(logging.WARNING, logger="gpo"):
        NonfiniteGuard(3).finite(1.0, float("inf"), four_layers(3), 8, {})
    assert caplog.records[-1].getMessage() == (
        "optimiser step 8: gradient norm=inf (non-finite gradients in 0.weight, 1.weight, 2.weight); update skipped, "
        "weights unchanged (1 in a row)"
    )


def test_a_non_finite_loss_skips_the_update_even_when_the_gradient_norm_is_finite(caplog):
    """An infinite loss whose gradients are finite (a constant term gone to inf) still skips, and names the loss."""
    guard = NonfiniteGuard(3)
    with caplog.at_level(logging.WARNING, logger="gpo"):
        assert not guard.finite(float("inf"), 0.5, four_layers(0), 9, {"advantages": torch.tensor([1.0])})
    message = caplog.records[-1].getMessage()
    assert message == "optimiser step 9: loss=inf; update skipped, weights unchanged (1 in a row)"
    assert guard.finite(2.0, 0.5, four_layers(0), 10, {}) and guard.streak == 0
