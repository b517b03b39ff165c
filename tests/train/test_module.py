"""GPOModule end to end on a tiny local model: the reward rises, micro-batching changes nothing, bad input fails."""

import logging
import re
import warnings

import lightning as L
import pytest
import torch

from gpo.algo import GSPO, EntropyBonus, KLPenalty, NoGate, OverlongFilter, RolloutCorrection
from gpo.algo.distillation import TeacherKL
from gpo.algo.masks import TokenMask
from gpo.rewards import positional_match
from gpo.rewards.runner import RewardErrors
from gpo.rollout import HFEngine, Sampling
from gpo.train.data import collate
from gpo.train.module import GPOModule
from gpo.train.optimization import Optimization
from tests.tiny import prompts, quiet_trainer, tiny_module, write_assets


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_assets(tmp_path_factory.mktemp("e2e"), examples=2000)


class RewardHistory(L.Callback):
    def __init__(self):
        self.rewards = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rewards.append(trainer.callback_metrics["reward"].item())


def fit(workspace, steps, **module_kwargs):
    model, data = workspace
    L.seed_everything(0)
    module = tiny_module(model, group_size=8, **module_kwargs)
    history = RewardHistory()
    quiet_trainer(steps, [history]).fit(module, prompts(model, data, 8))
    return module, history.rewards


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "dr_grpo", "dapo"])
def test_reward_rises_on_sort_digits(workspace, algorithm):
    # random start scores about 0.013 (1 position in 3 right by chance 1 time in ~96); 150 steps reach ~0.2
    _, rewards = fit(workspace, 150, algorithm=algorithm, old_logprobs="trainer")
    first, last = sum(rewards[:25]) / 25, sum(rewards[-25:]) / 25
    assert last > first + 0.1, (first, last)


def test_reward_rises_off_policy_with_minibatches_and_rollout_logprobs(workspace):
    # max_steps counts optimiser steps: 4 per rollout batch here, so 240 steps are 60 batches
    optim = Optimization(lr=1e-3, number_of_minibatches=2, ppo_epochs=2)
    _, rewards = fit(workspace, 240, algorithm=GSPO(), optim=optim, old_logprobs="rollout")
    assert len(rewards) == 60
    assert sum(rewards[-15:]) / 15 > sum(rewards[:15]) / 15 + 0.05


def test_micro_batching_leaves_the_update_unchanged(workspace):
    whole, _ = fit(workspace, 1, algorithm="dapo", optim=Optimization(lr=1e-3))
    split, _ = fit(workspace, 1, algorithm="dapo", optim=Optimization(lr=1e-3, micro_batch_size=5))
    for (name, a), b in zip(whole.policy.named_parameters(), split.policy.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_micro_batching_leaves_the_logged_diagnostics_unchanged(workspace):
    """Ratio extremes, clip fractions and entropy are the step's, whatever the micro-batches: a micro-batch whose
    completions OverlongFilter dropped (statistics of no token, read as 0) has no say."""
    settings = {"algorithm": "dapo", "token_weights": [OverlongFilter()], "old_logprobs": "rollout"}
    logged = []
    for micro in (None, 5):
        optim = Optimization(lr=1e-2, number_of_minibatches=2, ppo_epochs=2, micro_batch_size=micro)
        module, _ = fit(workspace, 4, optim=optim, **settings)
        logged.append(
            {
                k: float(v)
                for k, v in module.trainer.callback_metrics.items()
                if k.startswith(("ratio/", "clip/", "entropy"))
            }
        )
    whole, split = logged
    assert whole["ratio/min"] < 1 < whole["ratio/max"] and whole.keys() == split.keys()
    for key in whole:
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key


def test_a_reward_returning_nan_is_reported_with_its_prompt(workspace):
    def broken(prompts, completions, **_):
        return [float("nan")] * len(completions)

    model, data = workspace
    module = tiny_module(model, [broken], group_size=2)
    with pytest.raises(ValueError, match=r"reward function 'broken' returned nan for prompt '\d{3}='"):
        quiet_trainer(1).fit(module, prompts(model, data, 2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rewards": []}, "rewards is empty"),
        ({"group_size": 1}, "group_size=1"),
        ({"old_logprobs": "vllm"}, "rollout or trainer"),
        ({"ppo_clip_ref_logprobs": "vllm"}, "rollout or batch"),
        ({"old_logprobs": "rollout", "ppo_clip_ref_logprobs": "batch"}, None),  # flat GRPO configs' name for trainer
        ({"old_logprobs": "trainer", "ppo_clip_ref_logprobs": "rollout"}, r"in flat GRPO configs\) disagree; set only"),
        ({"algorithm": "ppo"}, "grpo, rloo, reinforce_pp"),
        ({"distill": TeacherKL()}, "model.distill needs a teacher"),
        ({"teacher": "somewhere"}, "model.teacher is set but nothing reads it"),
        ({"distill": TeacherKL(), "teacher": "no/such/teacher"}, "model.teacher='no/such/teacher': no such folder"),
    ],
)
def test_invalid_configuration_fails_at_construction(workspace, kwargs, message):
    kwargs = {"rewards": [positional_match], "engine": HFEngine(), **kwargs}
    if message is None:
        assert GPOModule(workspace[0], **kwargs).learner.old_logprobs == "trainer"
        return
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        GPOModule(workspace[0], **kwargs)


def test_optimization_settings_are_validated():
    with pytest.raises(ValueError, match="number_of_minibatches=0"):
        Optimization(number_of_minibatches=0)
    with pytest.raises(ValueError, match="lr=0"):
        Optimization(lr=0)


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # warm-up 1/3, 2/3 over steps 0, 1; then the decay over steps 2..6 (total 6), and 0 past the end
        ("constant", [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]),
        # 0.5 (1 + cos(pi p)) at p = 0, 1/4, 1/2, 3/4, 1: 1, (2 + sqrt 2) / 4, 1/2, (2 - sqrt 2) / 4, 0
        ("cosine", [1 / 3, 2 / 3, 1.0, (2 + 2**0.5) / 4, 0.5, (2 - 2**0.5) / 4, 0.0, 0.0]),
    ],
)
def test_the_learning_rate_warms_up_linearly_then_decays_to_0_at_max_steps(schedule, expected):
    optim = Optimization(lr=0.1, lr_schedule=schedule, warmup_steps=2)
    assert [optim.lr_factor(step, 6) for step in range(8)] == pytest.approx(expected, abs=1e-12)
    optimizer, _ = optim.build([torch.nn.Parameter(torch.zeros(1))], 6)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 3)  # the first step already warms up


@pytest.mark.parametrize("total_steps", [None, 2])
def test_a_decaying_schedule_without_steps_after_the_warm_up_is_refused_when_the_optimiser_is_built(total_steps):
    optim = Optimization(lr_schedule="linear", warmup_steps=2)
    with pytest.raises(ValueError, match=r"set trainer\.max_steps above model\.optim\.warmup_steps=2"):
        optim.build([torch.nn.Parameter(torch.zeros(1))], total_steps)
    Optimization(lr_schedule="linear", warmup_steps=2).build([torch.nn.Parameter(torch.zeros(1))], 3)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"lr": -1e-6}, "lr=-1e-06 must be > 0"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1 must be >= 0"),
        ({"max_grad_norm": 0.0}, "max_grad_norm=0.0 must be > 0"),
        ({"ppo_epochs": 0}, "ppo_epochs=0 must be >= 1"),
        ({"micro_batch_size": 0}, "micro_batch_size=0 must be >= 1"),
        ({"lr_schedule": "step"}, "lr_schedule='step' is not valid; choose constant, linear or cosine"),
        ({"warmup_steps": -1}, "warmup_steps=-1 must be >= 0"),
        ({"max_consecutive_nonfinite": 0}, "max_consecutive_nonfinite=0 must be >= 1"),
    ],
)
def test_each_optimization_setting_out_of_bounds_is_refused_under_its_own_key(setting, message):
    with pytest.raises(ValueError, match=rf"^model\.optim\.{re.escape(message)}"):
        Optimization(**setting)


def test_the_optimiser_is_fused_adamw_with_the_reference_update():
    """Three steps of ``Optimization.build``'s optimiser equal torch's reference (per-parameter) AdamW in float64,
    weight decay and the learning-rate schedule's warm-up included."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=generator, dtype=torch.float64), torch.randn(7, dtype=torch.float64)]
    grads = [[torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in start] for _ in range(3)]
    optim = Optimization(lr=0.05, weight_decay=0.1, warmup_steps=2)
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    reference = [torch.nn.Parameter(p.clone()) for p in start]
    optimizer, scheduler = optim.build(ours, None)
    assert optimizer.defaults["fused"]
    expected = torch.optim.AdamW(reference, lr=0.05, weight_decay=0.1, foreach=False)
    for step, step_grads in enumerate(grads):
        for ours_p, reference_p, grad in zip(ours, reference, step_grads, strict=True):
            ours_p.grad, reference_p.grad = grad.clone(), grad.clone()
        expected.param_groups[0]["lr"] = 0.05 * optim.lr_factor(step, None)
        optimizer.step()
        scheduler.step()
        expected.step()
    for ours_p, reference_p, initial in zip(ours, reference, start, strict=True):
        torch.testing.assert_close(ours_p, reference_p, rtol=1e-12, atol=1e-12)
        assert not torch.equal(ours_p, initial)  # it moved


def test_python_api_with_loaded_model_and_tokenizer(workspace):
    from gpo.testing import char_tokenizer, tiny_model

    module = GPOModule(
        tiny_model("llama"),
        [positional_match],
        tokenizer=char_tokenizer(),
        group_size=2,
        engine=HFEngine(sampling=Sampling(max_new_tokens=2)),
    )
    trainer = quiet_trainer(2)
    trainer.fit(module, prompts(*workspace, 2))
    assert trainer.global_step == 2
    with pytest.raises(ValueError, match="without a tokenizer"):
        GPOModule(tiny_model("llama"), [positional_match], engine=HFEngine()).setup("fit")


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_kl_entropy_and_correction_paths_run_and_log(workspace, placement):
    model, data = workspace
    module = tiny_module(
        model,
        engine=HFEngine(sampling=Sampling(max_new_tokens=3)),
        optim=Optimization(lr=1e-3, number_of_minibatches=2),
        kl=KLPenalty(beta=0.1, placement=placement),
        entropy=EntropyBonus(coef=0.01),
        correction=RolloutCorrection(mode="tis", cap=2.0),
        old_logprobs="trainer",
        token_weights=[OverlongFilter()],
    )
    reference = module.scorer.reference
    assert reference is not None and not any(p.requires_grad for p in reference.parameters())
    n_policy = sum(1 for _ in module.policy.parameters())
    assert sum(1 for _ in module.parameters()) == n_policy  # the reference is not trained, saved or summarised
    trainer = quiet_trainer(4)
    trainer.fit(module, prompts(model, data, 2))
    logged = trainer.callback_metrics
    assert ("kl/mean" in logged) == (placement == "loss") and ("kl/sequence_mean" in logged) == (placement == "reward")
    if placement == "reward":  # the reward holds -beta times each completion's summed KL, which is logged
        assert logged["kl/sequence_mean"] > 0
        expected = logged["reward/mean"] - 0.1 * logged["kl/sequence_mean"]
        assert logged["reward/mixed_mean"].item() == pytest.approx(expected.item(), abs=1e-6)
    assert "correction/weight_mean" in logged and torch.isfinite(logged["loss"])


def test_a_reward_that_fails_under_the_score_policy_is_scored_and_counted(workspace):
    def nan_first(prompts, completions, **_):
        return [float("nan")] + [0.5] * (len(completions) - 1)

    def raises(prompts, completions, **_):
        raise KeyError("answer")

    model, data = workspace
    errors = RewardErrors(policy="score", value=-1.0)
    module = tiny_module(model, [nan_first, raises], group_size=2, reward_errors=errors)
    trainer = quiet_trainer(1)
    trainer.fit(module, prompts(model, data, 2))
    # 2 prompts x 2 completions: nan_first fails row 0 only, raises fails all 4 rows
    assert trainer.callback_metrics["reward_errors/nan_first"] == 1
    assert trainer.callback_metrics["reward_errors/raises"] == 4
    # mean reward: (nan_first: -1 + 3 x 0.5) / 4 + (raises: -1) = 0.125 - 1
    assert trainer.callback_metrics["reward"].item() == pytest.approx(-0.875)


def test_dppo_top_k_modes_train_with_the_old_policys_top_k_from_the_lean_path(workspace, monkeypatch):
    from gpo.algo import Custom, DivergenceMaskGate

    gate = DivergenceMaskGate(mode="topk_tv", threshold=0.5, top_k=4)
    divergences = []
    divergence = gate.divergence
    monkeypatch.setattr(gate, "divergence", lambda *a: divergences.append(divergence(*a)) or divergences[-1])

    def length(prompts, completions, **_):  # differs within groups from the first step
        return [len(c) / 4 for c in completions]

    optim = Optimization(lr=0.05, number_of_minibatches=2)
    model, data = workspace
    module = tiny_module(model, [length], algorithm=Custom(gate=gate), optim=optim, old_logprobs="trainer")
    quiet_trainer(2).fit(module, prompts(model, data))
    assert len(divergences) == 2 and divergences[0].shape[-1] <= 4
    # the first update of the rollout runs the policy that sampled it: the old top-4 set is the current one
    assert float(divergences[0].max()) < 1e-5 and float(divergences[1].max()) > 1e-3
    assert module.learner.objective.requires == {"topk_logp", "old_topk_logp"}


def test_a_step_with_every_completion_dropped_from_the_loss_is_skipped_counted_and_warned_about(workspace, caplog):
    from gpo.algo import OverlongFilter

    model, data = workspace
    # one token, the most likely (top_k=1): for these prompts it is not EOS, so OverlongFilter drops every completion
    module = tiny_module(
        model, token_weights=[OverlongFilter()], engine=HFEngine(sampling=Sampling(max_new_tokens=1, top_k=1))
    )
    trainer = quiet_trainer(10, limit_train_batches=6, max_epochs=1)
    with caplog.at_level(logging.WARNING, logger="gpo"):
        trainer.fit(module, prompts(model, data))
    assert trainer.global_step == 0  # no optimiser step on an empty loss
    assert float(trainer.callback_metrics["train/empty_loss_streak"]) == 6
    assert "entropy" not in trainer.callback_metrics  # no statistics over an empty mask
    [warning] = [r.getMessage() for r in caplog.records if "no token was left in the loss" in r.getMessage()]
    assert "for 5 steps in a row" in warning and "OverlongFilter" in warning and "max_new_tokens" in warning


class SkipState(L.Callback):
    """``rollout/skipped`` and ``train/empty_loss_streak`` as callbacks read them after each batch."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        keys = ("rollout/skipped", "train/empty_loss_streak")
        self.rows.append(tuple(float(trainer.callback_metrics[key]) for key in keys))


def test_a_trained_step_after_a_skipped_one_reads_as_not_skipped(workspace, monkeypatch):
    """Callbacks read a key's last published value: the steps after a skipped one must say they trained."""
    from gpo.train.learner import Learner

    real, calls = Learner.has_loss_tokens, []

    def empty_twice(self, mask, step, **kwargs):  # batches 1 and 2 keep no token in the loss
        calls.append(step)
        return real(self, mask * 0 if len(calls) in (2, 3) else mask, step, **kwargs)

    monkeypatch.setattr(Learner, "has_loss_tokens", empty_twice)
    model, data = workspace
    state = SkipState()
    quiet_trainer(3, [state]).fit(tiny_module(model), prompts(model, data))
    assert state.rows == [(0.0, 0.0), (1.0, 1.0), (1.0, 2.0), (0.0, 0.0), (0.0, 0.0)]


class EmptiesSecondCall(TokenMask):
    """A step mask that keeps no token on its second call (a step whose engine disagrees everywhere, say)."""

    requires = frozenset({"adv"})

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, mask, *, adv):
        self.calls += 1
        return mask.bool() & (self.calls != 2), {}


def test_a_step_a_step_mask_empties_is_skipped_without_an_optimiser_step_and_the_run_goes_on(workspace):
    model, data = workspace
    state, module = SkipState(), tiny_module(model, masks=[EmptiesSecondCall()])
    quiet_trainer(3, [state]).fit(module, prompts(model, data))
    assert state.rows == [(0.0, 0.0), (1.0, 1.0), (0.0, 0.0), (0.0, 0.0)]  # 3 optimiser steps over 4 batches
    assert module.trainer.global_step == 3 and module.skipped_in_a_row == 0


def test_the_headline_reward_is_the_weighted_sum_of_the_rewards_whatever_the_mixer(workspace):
    from gpo.algo import GroupNormalizedSum

    def length(prompts, completions, **_):
        return [float(len(c)) for c in completions]

    model, data = workspace
    module = tiny_module(model, [positional_match, length], mixer=GroupNormalizedSum(weights=[1.0, 0.5]))
    trainer = quiet_trainer(1)
    trainer.fit(module, prompts(model, data))
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    # GDPO's mix is centred within each group: its mean is 0, which is no headline
    assert logged["reward/mixed_mean"] == pytest.approx(0.0, abs=1e-6)
    weighted = logged["reward/positional_match"] + 0.5 * logged["reward/length"]
    assert logged["reward/mean"] == pytest.approx(weighted, rel=1e-6) == pytest.approx(logged["reward"], rel=1e-6)
    assert logged["reward/length"] > 0


def test_training_starts_without_modules_left_in_eval_mode(workspace):
    model, data = workspace
    module, trainer = tiny_module(model), quiet_trainer(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, prompts(model, data))
    assert not [w for w in caught if "eval mode" in str(w.message)]
    assert all(m.training for m in module.policy.modules())


def test_load_from_checkpoint_rebuilds_the_module_with_its_trained_weights(workspace, tmp_path):
    """Lightning's way back from a checkpoint: the constructor's arguments given again (the module saves no
    hyper-parameters: rewards and engines are code), the weights from the file."""
    model, data = workspace
    module = tiny_module(model)
    trainer = quiet_trainer(2)
    trainer.fit(module, prompts(model, data, 2))
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    kwargs = {"group_size": 4, "engine": HFEngine(sampling=Sampling(max_new_tokens=4))}  # optim left at its default
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="resumed with settings changed")  # nothing is resumed
        loaded = GPOModule.load_from_checkpoint(tmp_path / "two.ckpt", policy=model, rewards=[positional_match],
                                                **kwargs)  # fmt: skip
    for (name, trained), again in zip(module.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(trained, again), name
    assert loaded._restored == {}  # the run's random state and draws stay out of a later fresh fit
    # into a LoRA policy: one line naming the difference, not Lightning's list of every missing parameter
    wrong_shape = r"another policy \(model: .*; trainer_mode: full in the checkpoint, lora now\)"
    with pytest.raises(ValueError, match=wrong_shape):
        GPOModule.load_from_checkpoint(tmp_path / "two.ckpt", policy=model, rewards=[positional_match],
                                       trainer_mode="lora", **kwargs)  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "fix"),
    [({"gradient_clip_val": 0.5}, "set model.optim.max_grad_norm: 0.5"),
     ({"accumulate_grad_batches": 2}, "raise data.prompts_per_step")],
)  # fmt: skip
def test_lightnings_automatic_optimisation_settings_get_gpos_fix_in_python_too(workspace, setting, fix):
    """Lightning refused them first with "switch to automatic optimization", which a GPOModule cannot."""
    model, data = workspace
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, **setting)
    with pytest.raises(ValueError, match=re.escape(fix)):
        trainer.fit(tiny_module(model), prompts(model, data, 2))
    trainer.validate(tiny_module(model), prompts(model, data, 2, val_size=4))  # Lightning takes them there too


def test_the_max_steps_warning_is_for_fitting_not_validating(workspace, caplog):
    model, data = workspace
    module = tiny_module(model, optim=Optimization(lr=1e-3, number_of_minibatches=2))
    with caplog.at_level("WARNING", logger="gpo.train.preflight"):
        quiet_trainer(3).validate(module, prompts(model, data, 2, val_size=4))
    assert "is not a multiple" not in caplog.text


def always_one(prompts, completions, **columns):
    return [1.0] * len(completions)


def test_the_held_out_reward_is_the_rewards_weighted_sum_whatever_the_mixer(workspace):
    """GDPO's mixer normalises within groups: a one-row greedy group gets exactly 0 from it, and every held-out
    reward and pass rate read 0 before."""
    from gpo.algo import GroupNormalizedSum

    model, data = workspace
    module = tiny_module(model, rewards=(positional_match, always_one), mixer=GroupNormalizedSum(weights=[1.0, 0.5]))
    (got,) = quiet_trainer(1).validate(module, prompts(model, data, 2, val_size=4))
    for kind in ("greedy", "sampled"):
        expected = got[f"val/reward_{kind}/positional_match"] + 0.5 * got[f"val/reward_{kind}/always_one"]
        assert got[f"val/reward_{kind}"] == pytest.approx(expected, abs=1e-6) and expected >= 0.5, got


def test_validate_collects_its_rollouts_on_the_modules_device(workspace):
    """``validate`` calls no fit hook, and its rollouts belong on the module's device all the same (not on the CPU,
    where the collector starts, in a GPU run)."""
    model, data = workspace
    module = tiny_module(model)
    module.collector.device = torch.device("meta")  # stands for "not the module's device"
    quiet_trainer(1).validate(module, prompts(model, data, 2, val_size=4))
    assert module.collector.device == module.device


def test_a_trainer_used_again_is_not_told_that_gpos_own_callback_replaces_itself(workspace, caplog):
    model, data = workspace
    module, trainer = tiny_module(model), quiet_trainer(1)
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            trainer.validate(module, prompts(model, data, 2, val_size=4))
    assert "will override existing callbacks" not in caplog.text


def test_batches_of_another_shape_are_refused_naming_what_they_lack(workspace):
    """A loader of one's own whose batches are not batches of prompts is refused before anything reads them."""
    model, _ = workspace
    rows = [{"prompt": "12=", "answer": "12"}] * 4
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    with pytest.raises(ValueError, match=r"lacks \['prompt_ids', 'fields'\] \(it has \['answer', 'prompt'\]\)"):
        quiet_trainer(1).fit(tiny_module(model), train_dataloaders=loader)
    texts = torch.utils.data.DataLoader([{"text": "12=", "answer": "12"}] * 4, batch_size=2)
    with pytest.raises(ValueError, match=r"lacks \['prompt', 'prompt_ids', 'fields'\]"):
        quiet_trainer(1).fit(tiny_module(model), train_dataloaders=texts)
    tokenized = [row | {"prompt_ids": [5, 6, 7]} for row in rows]  # README: any loader of such rows, collated by gpo
    loader = torch.utils.data.DataLoader(tokenized, batch_size=2, collate_fn=collate)
    quiet_trainer(2).fit(tiny_module(model), train_dataloaders=loader)


def test_a_fit_tells_a_plain_callback_with_a_rollout_hook_that_it_is_never_called(workspace):
    class Plain(L.Callback):
        def on_rollout_end(self, trainer, pl_module, rollout):
            return rollout

    model, data = workspace
    with pytest.warns(UserWarning, match=r"Plain defines on_rollout_end but is a plain Callback"):
        quiet_trainer(1, [Plain()]).fit(tiny_module(model), prompts(model, data, 2))


RESET_SEEDS: list[int] = []


def test_a_multi_turn_greedy_evaluation_plays_the_same_episodes_whatever_the_global_generator(workspace):
    """The greedy pass's environment seeds came from torch's global generator: each evaluation played other games."""
    from gpo.envs import NumberGuess
    from gpo.envs.number_guess_prompts import prompt
    from gpo.rewards import env_reward
    from gpo.rollout import MultiTurnEngine
    from gpo.tasks import write_jsonl

    class SeedsSeen(NumberGuess):
        def reset(self, seed, task):
            RESET_SEEDS.append(seed)
            return super().reset(seed, task)

    model, _ = workspace
    data = write_jsonl([{"prompt": prompt(1, 8)}] * 16, f"{model}/../guess.jsonl")
    seen = []
    for generator_seed in (0, 1):
        RESET_SEEDS.clear()
        torch.manual_seed(generator_seed)
        engine = MultiTurnEngine(engine=HFEngine(sampling=Sampling(max_new_tokens=3)), env=SeedsSeen(), max_turns=2)
        quiet_trainer(1).validate(tiny_module(model, rewards=(env_reward,), engine=engine),
                                  prompts(model, data, 4, val_size=8))  # fmt: skip
        seen.append(list(RESET_SEEDS))
    assert seen[0] == seen[1] and len(seen[0]) == 8 * (1 + 4)  # greedy, then 4 samples a prompt


@pytest.mark.parametrize("setting", [{"temperature": 0.0}, {"top_p": 0.0}])
def test_an_evaluation_setting_out_of_bounds_is_refused_under_its_own_key(setting):
    from gpo.train.evaluation import Evaluation

    key = next(iter(setting))
    with pytest.raises(ValueError, match=rf"^model\.evaluation\.{key}=0\.0 must be"):
        Evaluation(**setting)  # 0 read as "not set" before, and the run failed later naming the engine's setting


def test_a_checkpoint_is_evaluated_under_other_rewards_than_it_trained_with(workspace, tmp_path):
    model, data = workspace
    trainer = quiet_trainer(1, enable_checkpointing=False)
    trainer.fit(tiny_module(model), prompts(model, data, 2))
    trainer.save_checkpoint(tmp_path / "trained.ckpt")
    module = tiny_module(model, rewards=(positional_match, always_one))
    with warnings.catch_warnings():  # other data settings too (a held-out split): nothing is resumed, nothing warned
        warnings.filterwarnings("error", message="resumed with settings changed")
        held_out = prompts(model, data, 2, val_size=4)
        (got,) = quiet_trainer(1).validate(module, held_out, ckpt_path=tmp_path / "trained.ckpt")
    assert got["val/reward_greedy/always_one"] == 1.0


TASKS_SEEN: list[str] = []


def test_a_multi_turn_environment_gets_the_prompts_text_not_its_chat_template(workspace, tmp_path):
    from transformers import AutoTokenizer

    from gpo.envs import NumberGuess
    from gpo.envs.number_guess_prompts import prompt
    from gpo.rewards import env_reward
    from gpo.rollout import MultiTurnEngine
    from gpo.tasks import write_jsonl

    class TasksSeen(NumberGuess):
        def reset(self, seed, task):
            TASKS_SEEN.append(task)
            return super().reset(seed, task)

    model, _ = workspace
    templated = AutoTokenizer.from_pretrained(model)
    templated.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    templated.save_pretrained(tmp_path / "templated")
    data = write_jsonl([{"prompt": prompt(1, 8)}] * 8, tmp_path / "guess.jsonl")
    engine = MultiTurnEngine(engine=HFEngine(sampling=Sampling(max_new_tokens=3)), env=TasksSeen(), max_turns=1)
    module = tiny_module(model, rewards=(env_reward,), engine=engine, tokenizer=str(tmp_path / "templated"))
    TASKS_SEEN.clear()
    quiet_trainer(1).fit(module, prompts(str(tmp_path / "templated"), str(data), 2))
    assert TASKS_SEEN and set(TASKS_SEEN) == {prompt(1, 8)}  # not "<" + prompt + ">"


class ReadsTeacher(NoGate):
    """A gate of a user's that reads the teacher's log-probs of the sampled tokens, with no distillation term."""

    requires = frozenset({"teacher_logp"})

    def __call__(self, logp, old_logp, adv, mask, *, teacher_logp):
        return super().__call__(logp, old_logp, adv * teacher_logp.exp(), mask)


def test_a_teacher_read_by_a_gate_alone_is_accepted_and_scored(workspace):
    from gpo.algo import Custom

    model, data = workspace
    module = tiny_module(model, algorithm=Custom(gate=ReadsTeacher()), teacher=model)  # no model.distill
    trainer = quiet_trainer(1)
    trainer.fit(module, prompts(model, data, 2))
    assert trainer.global_step == 1


class OwnWeights(HFEngine):
    """Stands for a vLLM engine: it holds a copy of the weights of its own (here, in name only)."""

    shares_policy_weights = False


def test_evaluating_a_checkpoint_with_an_engine_of_its_own_weights_and_no_sync_is_refused(workspace, tmp_path):
    model, data = workspace
    trainer = quiet_trainer(1)
    trainer.fit(tiny_module(model), prompts(model, data, 2))
    trainer.save_checkpoint(tmp_path / "trained.ckpt")
    module = tiny_module(model, engine=OwnWeights(sampling=Sampling(max_new_tokens=4)))
    with pytest.raises(ValueError, match=r"no VLLMWeightSync, so the engine would score the weights it started with"):
        quiet_trainer(1).validate(module, prompts(model, data, 2, val_size=4), ckpt_path=tmp_path / "trained.ckpt")
