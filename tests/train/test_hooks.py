"""The rollout hooks: declared on RolloutCallback (a misspelt one is refused), run by one call each, and enough for a
LightningModule that is not GPOModule to use DynamicSampling, RolloutMonitor and VLLMWeightSync."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer
from typing_extensions import override

import gpo.callbacks
from gpo.callbacks import DynamicSampling, RolloutMonitor, VLLMWeightSync
from gpo.models.scorer import TokenScorer
from gpo.rollout import Rollout, Sampling
from gpo.tasks import make_task
from gpo.testing import save_tiny_model
from gpo.train.hooks import (
    RolloutCallback,
    RolloutSource,
    run_prompt_hooks,
    run_rollout_hooks,
    warn_unreached_hooks,
)
from tests.tiny import quiet_trainer
from tests.vllm_engines import needs_vllm, tiny_vllm_engine


def test_a_misspelt_hook_is_refused_when_the_class_is_defined():
    with pytest.raises(TypeError, match=r"Filter\.on_rollout_ends is not a hook .* did you mean on_rollout_end\?"):

        class Filter(RolloutCallback):
            def on_rollout_ends(self, trainer, pl_module, rollout):
                return rollout

    with pytest.raises(TypeError, match=r"on_prompt is not a hook .* did you mean on_prompts\?"):

        class Prompts(RolloutCallback):
            def on_prompt(self, trainer, pl_module, batch):
                return batch


class PolicyOnly(RolloutSource, L.LightningModule):
    """Declares RolloutSource but sets only ``policy``."""

    def __init__(self):
        super().__init__()
        self.policy = torch.nn.Linear(1, 1)


@pytest.mark.parametrize(
    ("callback", "message"),
    [
        (
            gpo.callbacks.ExportPolicy(),
            r"ExportPolicy reads the module's policy, tokenizer, and PolicyOnly has not set "
            r"tokenizer: set them\.",
        ),
        (
            VLLMWeightSync(),
            r"reads the module's engine, policy, scorer, tokenizer, and PolicyOnly has not set engine, "
            r"scorer, tokenizer",
        ),
        (RolloutMonitor(compute_entropy=True), r"reads the module's scorer for compute_entropy .*has not set scorer"),
        (
            DynamicSampling(max_rounds=2),
            r"reads the module's draw_rollout to draw more groups .*has not set draw_rollout",
        ),
    ],
)
def test_a_callback_refuses_at_setup_a_module_that_has_not_set_what_it_reads(callback, message):
    """Not at train end, when ExportPolicy would first touch the tokenizer, after the whole run."""
    trainer = quiet_trainer(1)
    with pytest.raises(TypeError, match=message):
        callback.setup(trainer, PolicyOnly(), "fit")
    with pytest.raises(TypeError, match=r"LightningModule does not declare them: mix gpo.train.hooks.RolloutSource"):
        callback.setup(trainer, L.LightningModule(), "fit")


def test_dynamic_sampling_that_only_filters_needs_no_draw_rollout():
    DynamicSampling(max_rounds=0).setup(quiet_trainer(1), PolicyOnly(), "fit")  # it never draws: nothing to refuse


class BothHooks(RolloutCallback):
    @override
    def on_prompts(self, trainer, pl_module, batch):
        return None

    @override
    def on_rollout_end(self, trainer, pl_module, rollout):
        return None


class PromptHooksOnly(L.LightningModule):
    """Runs the prompt hooks and forgets the rollout hooks; the first two batches take no optimiser step (as a
    pipelined GPOModule's fill its queue), which the check does not count."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        run_prompt_hooks(self.trainer, self, {"prompt": batch})
        return None if batch_idx < 2 else self.layer(torch.ones(1)).sum()

    def train_dataloader(self):
        return DataLoader(["p"] * 13, batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_hook_the_module_never_runs_is_warned_about_once_ten_optimiser_steps_in(recwarn):
    module = PromptHooksOnly()
    quiet_trainer(10, [BothHooks()]).fit(module)  # 12 batches, 10 steps: not yet
    assert not [w for w in recwarn if "has not run in" in str(w.message)]
    quiet_trainer(11, [BothHooks()]).fit(PromptHooksOnly())
    messages = [str(w.message) for w in recwarn if "has not run in" in str(w.message)]
    assert messages == [
        "BothHooks.on_rollout_end has not run in 10 optimiser steps, so it does nothing: "
        "PromptHooksOnly.training_step must call gpo.train.hooks.run_rollout_hooks(trainer, module, rollout) after "
        "scoring (GPOModule does)."
    ]


def test_a_plain_callback_defining_a_rollout_hook_is_told_it_is_never_called(recwarn):
    class Plain(L.Callback):
        def on_rollout_end(self, trainer, pl_module, rollout):
            return rollout

    warn_unreached_hooks([Plain(), BothHooks(), L.Callback()])
    messages = [str(w.message) for w in recwarn]
    assert messages == [
        "Plain defines on_rollout_end but is a plain Callback, so it is never called: subclass "
        "gpo.train.hooks.RolloutCallback instead."
    ]


def test_every_rollout_hook_of_gpos_callbacks_is_marked_override():
    marked = 0
    for cls in (getattr(gpo.callbacks, name) for name in gpo.callbacks.__all__):
        if issubclass(cls, RolloutCallback):
            for name in ("on_prompts", "on_rollout_end"):
                if name in vars(cls):
                    assert getattr(vars(cls)[name], "__override__", False), f"{cls.__name__}.{name}"
                    marked += 1
    assert marked >= 5  # DynamicSampling, DifficultyFilter (2), RolloutMonitor, CompletionSamples


class Keeps(RolloutCallback):
    def __init__(self, tag):
        self.tag = tag

    @override
    def on_prompts(self, trainer, pl_module, batch):
        return {**batch, "seen": [*batch.get("seen", []), self.tag]}


def test_hooks_run_in_order_each_on_the_previous_result_and_plain_callbacks_are_left_alone():
    class Plain(L.Callback):
        def on_prompts(self, trainer, pl_module, batch):  # not a RolloutCallback: never called
            raise AssertionError("a plain Callback's on_prompts ran")

    trainer = type("T", (), {"callbacks": [Keeps("a"), Plain(), Keeps("b")]})()
    assert run_prompt_hooks(trainer, None, {"prompt": []})["seen"] == ["a", "b"]
    rollout = Rollout(*(torch.zeros(2, 1, dtype=torch.long),) * 4, torch.zeros(2, dtype=torch.bool), torch.arange(2))
    assert run_rollout_hooks(trainer, None, rollout) is rollout  # Keeps has no on_rollout_end: kept as it is


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"group": torch.arange(3)}, r"rollout's group has 3 rows, its completion_ids 4"),
        ({"completions": ["a"] * 3}, r"rollout's completions has 3 rows"),
        ({"fields": {"answer": [1, 2]}}, r"rollout's fields\['answer'\] has 2 rows"),
        ({"reward": torch.zeros(4, 1)}, r"reward must be a \[4\] tensor, one value per row, not \(4, 1\)"),
        ({"reward": [0.0] * 4}, r"reward must be a \[4\] tensor, one value per row, not list"),
    ],
)
def test_a_rollout_whose_fields_disagree_on_its_rows_is_refused_before_any_callback_reads_it(change, message):
    """A module of one's own builds its rollouts: a mistake there otherwise surfaces deep inside a callback (a torch
    error from bincount in RolloutMonitor or CompletionSamples)."""
    trainer = type("T", (), {"callbacks": [RolloutMonitor()]})()
    rollout = Rollout(*(torch.zeros(4, 1, dtype=torch.long),) * 4, torch.zeros(4, dtype=torch.bool), torch.arange(4))
    rollout.reward = torch.zeros(4)
    run_rollout_hooks(trainer, None, rollout)  # consistent: nothing refused (the monitor computes without a trainer)
    for name, value in change.items():
        setattr(rollout, name, value)
    with pytest.raises(ValueError, match=message):
        run_rollout_hooks(trainer, None, rollout)


class Returns(RolloutCallback):
    """Returns ``value`` from both rollout hooks, or applies it to what it is given when it is callable."""

    def __init__(self, value):
        self.value = value

    @override
    def on_prompts(self, trainer, pl_module, batch):
        return self.value(batch) if callable(self.value) else self.value

    @override
    def on_rollout_end(self, trainer, pl_module, rollout):
        return self.value(rollout) if callable(self.value) else self.value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, r"Returns.on_prompts returned bool; return the batch it was given with its rows filtered"),
        (lambda batch: batch["prompt"], r"Returns.on_prompts returned list; return the batch"),
        (lambda batch: {"prompt": batch["prompt"][:1]}, r"Returns.on_prompts returned a batch without \['fields', "
         r"'prompt_ids'\]"),
        (lambda batch: {**batch, "prompt": batch["prompt"][:1]}, r"Returns.on_prompts returned a batch whose columns "
         r"hold different numbers of prompts \(prompt 1, prompt_ids 2, fields\['answer'\] 2\)"),
    ],
)  # fmt: skip
def test_a_prompt_hook_that_returns_no_batch_of_prompts_is_refused_by_name(value, message):
    trainer = type("T", (), {"callbacks": [Returns(value)]})()
    batch = {"prompt": ["1=", "2="], "prompt_ids": [[1], [2]], "fields": {"answer": ["1", "2"]}}
    with pytest.raises((TypeError, ValueError), match=message):
        run_prompt_hooks(trainer, None, batch)


def set_reward_list(rollout):
    rollout.reward = rollout.reward.tolist()  # changed in place, returned as None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, r"Returns.on_rollout_end returned bool; return a Rollout \(an empty one skips the step\) or None"),
        (set_reward_list, r"after Returns.on_rollout_end: the rollout's reward must be a \[4\] tensor"),
    ],
)
def test_a_rollout_hook_that_returns_no_rollout_or_breaks_it_is_refused_by_name(value, message):
    trainer = type("T", (), {"callbacks": [Returns(value)]})()
    rollout = Rollout(*(torch.zeros(4, 1, dtype=torch.long),) * 4, torch.zeros(4, dtype=torch.bool), torch.arange(4))
    rollout.reward = torch.zeros(4)
    with pytest.raises((TypeError, ValueError), match=message):
        run_rollout_hooks(trainer, None, rollout)


def digit_share(completions: list[str]) -> torch.Tensor:
    """The reward: the fraction of a completion's characters that are digits (varies within a group)."""
    return torch.tensor([sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions])


class Reinforce(RolloutSource, L.LightningModule):
    """Not a GPOModule: samples with a gpo VLLMEngine, scores with a TokenScorer, and trains by group-mean REINFORCE.
    It declares what the three callbacks read (RolloutSource) and runs the rollout hooks with one call."""

    def __init__(self, folder: str, engine, group_size: int = 4) -> None:
        super().__init__()
        self.policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.engine, self.group_size = engine, group_size
        self.scorer = TokenScorer(self.policy, temperature=engine.sampling.temperature)
        self.prompts = [self.tokenizer(r["prompt"]).input_ids for r in make_task("sort_digits", 64, seed=0)]
        self.automatic_optimization, self.drawn = False, 0

    def setup(self, stage):
        self.engine.setup(self.policy, self.tokenizer)

    def train_dataloader(self):
        return DataLoader(self.prompts, batch_size=2, collate_fn=list)

    def sample(self, prompt_ids) -> Rollout:
        rollout = self.engine.generate(prompt_ids, self.group_size, seed=self.drawn, logprobs=True)
        self.drawn += 1
        completions = self.tokenizer.batch_decode(
            rollout.completion_ids * rollout.completion_mask, skip_special_tokens=True
        )
        rollout.reward = digit_share(completions)
        return rollout

    def draw_rollout(self) -> Rollout:
        return self.sample(self.prompts[self.drawn % 32 * 2 :][:2])

    def training_step(self, batch, batch_idx):
        rollout = run_rollout_hooks(self.trainer, self, self.sample(batch))
        if len(rollout) == 0:
            return
        _, group = torch.unique(rollout.group, return_inverse=True)
        baseline = torch.zeros(int(group.max()) + 1).index_reduce(0, group, rollout.reward, "mean", include_self=False)
        width = rollout.completion_ids.shape[1]
        logp = self.scorer.train_scores(rollout.input_ids, rollout.attention_mask, width, router=False).logp
        mask = rollout.completion_mask.float()
        loss = -((rollout.reward - baseline[group])[:, None] * logp * mask).sum() / mask.sum()
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.log("reward", rollout.reward.mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=0.1)


@needs_vllm
def test_a_lightning_module_that_is_not_gpos_uses_three_callbacks_with_one_hook_call(tmp_path):
    folder = str(save_tiny_model(tmp_path / "model"))
    module = Reinforce(folder, tiny_vllm_engine(sampling=Sampling(temperature=0.8, max_new_tokens=4)))
    sync = VLLMWeightSync(verify_every_k=1, max_logprob_diff=1e-4)
    monitor = RolloutMonitor(compute_entropy=True, warmup=1)
    sampling = DynamicSampling(max_rounds=2)
    trainer = quiet_trainer(3, [sync, sampling, monitor])
    trainer.fit(module)
    logged = trainer.callback_metrics
    assert sync.syncs == 4 and float(logged["weight_sync/logprob_diff_max"]) < 1e-4  # verified after every step
    assert float(logged["monitor/entropy"]) > 0 and "dynamic_sampling/groups_drawn" in logged
    assert sampling.totals["steps"] == 3
