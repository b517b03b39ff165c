"""GPOModule end to end on a tiny local model: the reward rises, micro-batching changes nothing, bad input fails."""

import warnings

import lightning as L
import pytest
import torch

from gpo.algo import AlgorithmKnobs
from gpo.rewards import positional_match
from gpo.rewards.runner import RewardErrors
from gpo.rollout import HFEngine
from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from gpo.train.data import PromptDataModule
from gpo.train.module import GPOModule, Optimization


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    model = save_tiny_model(root / "model", "llama", seed=0)
    data = write_jsonl(make_task("sort_digits", 2000, seed=0), root / "train.jsonl")
    return str(model), str(data)


class RewardHistory(L.Callback):
    def __init__(self):
        self.rewards = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rewards.append(trainer.callback_metrics["reward"].item())


def fit(workspace, steps, **module_kwargs):
    model, data = workspace
    warnings.filterwarnings("ignore", module="lightning")
    L.seed_everything(0)
    module_kwargs.setdefault("engine", HFEngine(max_new_tokens=4))
    module_kwargs.setdefault("optim", Optimization(lr=1e-3))
    module = GPOModule(model, [positional_match], group_size=8, **module_kwargs)
    history = RewardHistory()
    trainer = L.Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[history],
    )
    trainer.fit(module, PromptDataModule(data, tokenizer=model, prompts_per_step=8))
    return module, history.rewards


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "dr_grpo", "dapo"])
def test_reward_rises_on_sort_digits(workspace, algorithm):
    # random start scores about 0.013 (1 position in 3 right by chance 1 time in ~96); 150 steps reach ~0.2
    _, rewards = fit(workspace, 150, algorithm=algorithm, ppo_clip_ref_logprobs="batch")
    first, last = sum(rewards[:25]) / 25, sum(rewards[-25:]) / 25
    assert last > first + 0.1, (first, last)


def test_reward_rises_off_policy_with_minibatches_and_rollout_logprobs(workspace):
    # max_steps counts optimiser steps: 4 per rollout batch here, so 240 steps are 60 batches
    optim = Optimization(lr=1e-3, number_of_minibatches=2, ppo_epochs=2)
    _, rewards = fit(workspace, 240, algorithm="gspo", optim=optim, ppo_clip_ref_logprobs="rollout")
    assert len(rewards) == 60
    assert sum(rewards[-15:]) / 15 > sum(rewards[:15]) / 15 + 0.05


def test_micro_batching_leaves_the_update_unchanged(workspace):
    whole, _ = fit(workspace, 1, algorithm="dapo", optim=Optimization(lr=1e-3))
    split, _ = fit(workspace, 1, algorithm="dapo", optim=Optimization(lr=1e-3, micro_batch_size=5))
    for (name, a), b in zip(whole.policy.named_parameters(), split.policy.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_a_reward_returning_nan_is_reported_with_its_prompt(workspace):
    def broken(prompts, completions, **_):
        return [float("nan")] * len(completions)

    model, data = workspace
    module = GPOModule(model, [broken], engine=HFEngine(max_new_tokens=2), group_size=2)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"reward function 'broken' returned nan for prompt '\d{3}='"):
        trainer.fit(module, PromptDataModule(data, tokenizer=model, prompts_per_step=2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rewards": []}, "rewards is empty"),
        ({"group_size": 1}, "group_size=1"),
        ({"ppo_clip_ref_logprobs": "vllm"}, "rollout or batch"),
        ({"algorithm": "gspo", "knobs": AlgorithmKnobs(use_ppo_clip=True)}, "not compatible with algorithm='gspo'"),
    ],
)
def test_invalid_configuration_fails_at_construction(workspace, kwargs, message):
    kwargs = {"rewards": [positional_match], **kwargs}
    with pytest.raises(ValueError, match=message):
        GPOModule(workspace[0], **kwargs)


def test_optimization_settings_are_validated():
    with pytest.raises(ValueError, match="number_of_minibatches=0"):
        Optimization(number_of_minibatches=0)
    with pytest.raises(ValueError, match="lr=0"):
        Optimization(lr=0)


def test_python_api_with_loaded_model_and_tokenizer(workspace):
    from gpo.testing import char_tokenizer, tiny_model

    module = GPOModule(
        tiny_model("llama"),
        [positional_match],
        tokenizer=char_tokenizer(),
        group_size=2,
        engine=HFEngine(max_new_tokens=2),
    )
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, PromptDataModule(workspace[1], tokenizer=workspace[0], prompts_per_step=2))
    assert trainer.global_step == 2
    with pytest.raises(ValueError, match="without a tokenizer"):
        GPOModule(tiny_model("llama"), [positional_match]).setup("fit")


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_kl_entropy_and_correction_paths_run_and_log(workspace, placement):
    from gpo.algo import EntropyBonus, KLPenalty, RolloutCorrection

    model, data = workspace
    module = GPOModule(
        model,
        [positional_match],
        group_size=4,
        engine=HFEngine(max_new_tokens=3),
        optim=Optimization(lr=1e-3, number_of_minibatches=2),
        kl=KLPenalty(beta=0.1, placement=placement),
        entropy=EntropyBonus(coef=0.01),
        correction=RolloutCorrection(mode="tis", cap=2.0),
        mask_truncated_completions=True,
    )
    assert module.reference is not None and not any(p.requires_grad for p in module.reference.parameters())
    n_policy = sum(1 for _ in module.policy.parameters())
    assert sum(1 for _ in module.parameters()) == n_policy  # the reference is not trained, saved or summarised
    trainer = L.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, PromptDataModule(data, tokenizer=model, prompts_per_step=2))
    logged = trainer.callback_metrics
    assert ("kl/mean" in logged) == (placement == "loss")
    assert "correction/weight_mean" in logged and torch.isfinite(logged["loss"])


def test_a_reward_that_fails_under_the_score_policy_is_scored_and_counted(workspace):
    def nan_first(prompts, completions, **_):
        return [float("nan")] + [0.5] * (len(completions) - 1)

    def raises(prompts, completions, **_):
        raise KeyError("answer")

    model, data = workspace
    errors = RewardErrors(policy="score", value=-1.0)
    module = GPOModule(
        model, [nan_first, raises], engine=HFEngine(max_new_tokens=2), group_size=2, reward_errors=errors
    )
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, PromptDataModule(data, tokenizer=model, prompts_per_step=2))
    # 2 prompts x 2 completions: nan_first fails row 0 only, raises fails all 4 rows
    assert trainer.callback_metrics["reward_errors/nan_first"] == 1
    assert trainer.callback_metrics["reward_errors/raises"] == 4
    # mean reward: (nan_first: -1 + 3 x 0.5) / 4 + (raises: -1) = 0.125 - 1
    assert trainer.callback_metrics["reward"].item() == pytest.approx(-0.875)
