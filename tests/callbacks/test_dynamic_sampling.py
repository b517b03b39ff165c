"""DynamicSampling: uniform groups dropped, more drawn up to the target, exact trimming, running out (train / skip),
its metrics; inside a real Trainer with GPOModule and with a LightningModule that only follows the contract."""

import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from gpo.callbacks.dynamic_sampling import DynamicSampling
from gpo.rollout import HFEngine, Sampling
from gpo.rollout.base import Rollout
from gpo.train.hooks import RolloutCallback, RolloutSource, run_rollout_hooks
from tests import tiny
from tests.callbacks.fake_trainer import fake_trainer, published


def make_rollout(rewards: list[list[float]], *, interleave: bool = False, tag: str = "") -> Rollout:
    """A scored rollout with one group per inner list; prompts are named ``{tag}{group}``. ``interleave`` puts the
    rows of different groups in turn (a group's rows are not adjacent); groups must then have equal sizes."""
    pairs = [(g, r) for g, group in enumerate(rewards) for r in group]
    if interleave:  # stable sort by each row's rank within its group
        rank = [sum(q[0] == pair[0] for q in pairs[:i]) for i, pair in enumerate(pairs)]
        pairs = [pair for _, pair in sorted(zip(rank, pairs, strict=True), key=lambda x: x[0])]
    group = torch.tensor([g for g, _ in pairs])
    size = len(pairs)
    return Rollout(
        prompt_ids=torch.ones(size, 2, dtype=torch.long),
        prompt_mask=torch.ones(size, 2, dtype=torch.long),
        completion_ids=torch.full((size, 3), 5),
        completion_mask=torch.tensor([[1, 1, 0]] * size),
        truncated=torch.zeros(size, dtype=torch.bool),
        group=group,
        prompts=[f"{tag}{g}" for g, _ in pairs],
        completions=["c"] * size,
        reward=torch.tensor([r for _, r in pairs]),
    )


class FakeModule(RolloutSource):
    """Hands out prepared rollouts, one per ``draw_rollout``; its ``trainer`` holds what the callback publishes."""

    device = torch.device("cpu")

    def __init__(self, *rollouts: Rollout) -> None:
        self.queue, self.drawn, self.trainer = list(rollouts), 0, fake_trainer(7)

    def draw_rollout(self) -> Rollout:
        self.drawn += 1
        return self.queue[self.drawn - 1]

    @property
    def logged(self) -> dict[str, float]:
        return published(self.trainer, "dynamic_sampling/")


TRAINER = fake_trainer(7)


def rollout_end(callback: DynamicSampling, module: FakeModule, rollout: Rollout) -> Rollout | None:
    """``on_rollout_end``, then the end of the batch, when the callback publishes its metrics."""
    out = callback.on_rollout_end(module.trainer, module, rollout)
    callback.on_train_batch_end(module.trainer, module, None, None, 0)
    return out


def groups_by_prompt(rollout: Rollout) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for prompt, reward in zip(rollout.prompts, rollout.reward.tolist(), strict=True):
        out.setdefault(prompt, []).append(reward)
    return out


def test_uniform_groups_are_dropped_rows_of_a_group_need_not_be_adjacent():
    rollout = make_rollout([[1, 1, 1], [0, 1, 0], [0, 0, 0], [1, 0, 0]], interleave=True)
    module = FakeModule()
    out = rollout_end(DynamicSampling(num_groups=2, max_rounds=0), module, rollout)
    assert groups_by_prompt(out) == {"1": [0, 1, 0], "3": [1, 0, 0]}
    assert out.num_groups == 2 and len(out) == 6 and module.drawn == 0
    assert module.logged["groups_drawn"] == 4 and module.logged["groups_dropped"] == 2
    assert module.logged["groups_kept"] == 2 and module.logged["exhausted"] == 0
    assert module.logged["informative_frac"] == 0.5


def test_draws_more_rounds_until_the_target_then_trims_to_exactly_num_groups():
    first = make_rollout([[1, 1], [0, 1], [0, 0], [1, 1]], tag="a")
    second = make_rollout([[0, 0], [0, 0], [1, 0], [2, 2]], tag="b")
    third = make_rollout([[0, 1], [1, 1], [1, 0], [0.5, 0.2]], tag="c")  # 3 informative: 2 needed, 1 surplus
    module = FakeModule(second, third, make_rollout([[0, 1]], tag="never"))
    out = rollout_end(DynamicSampling(max_rounds=5), module, first)  # target: the 4 groups of `first`
    assert list(groups_by_prompt(out)) == ["a1", "b2", "c0", "c2"]  # the earliest informative groups, in order
    assert out.num_groups == 4 and len(out) == 8 and sorted(out.group.unique().tolist()) == [0, 1, 2, 3]
    assert module.drawn == 2
    expected = {"groups_drawn": 12, "groups_kept": 4, "groups_dropped": 7, "groups_surplus": 1, "rounds": 2}
    assert {key: module.logged[key] for key in expected} == expected
    assert module.logged["exhausted"] == 0 and module.logged["tokens_drawn"] == 24 * 2


def test_surplus_informative_groups_are_trimmed_without_drawing():
    rollout = make_rollout([[0, 1], [1, 0], [0, 0], [0, 2], [3, 1]])
    out = DynamicSampling(num_groups=3).on_rollout_end(TRAINER, FakeModule(), rollout)
    assert list(groups_by_prompt(out)) == ["0", "1", "3"]


def test_a_step_that_needs_no_change_keeps_its_rollout():
    module = FakeModule()
    assert rollout_end(DynamicSampling(), module, make_rollout([[0, 1], [1, 0]])) is None
    assert module.logged["groups_kept"] == 2 and module.logged["rounds"] == 0


def test_atol_decides_what_counts_as_equal():
    rollout = make_rollout([[0.5, 0.5 + 3e-7], [0.0, 1.0]])  # float32 keeps 3e-7 apart
    default = DynamicSampling(num_groups=2, max_rounds=0)
    with pytest.warns(UserWarning, match="1 of 2"):
        assert default.on_rollout_end(TRAINER, FakeModule(), rollout).num_groups == 1
    assert DynamicSampling(atol=0.0).on_rollout_end(TRAINER, FakeModule(), rollout) is None


def test_running_out_with_train_trains_on_fewer_groups_and_warns_with_the_counts():
    module = FakeModule(make_rollout([[0, 0], [1, 1], [0, 1]], tag="b"), make_rollout([[1, 1]] * 3, tag="c"))
    callback = DynamicSampling(max_rounds=2)
    with pytest.warns(
        UserWarning, match=r"step 7: 2 of 3 informative groups after 2 extra rounds \(9 groups drawn.*Raise"
    ):
        out = rollout_end(callback, module, make_rollout([[0, 1], [1, 1], [2, 2]]))
    assert list(groups_by_prompt(out)) == ["0", "b2"]
    assert module.logged["exhausted"] == 1 and module.logged["groups_kept"] == 2 and module.logged["rounds"] == 2
    with warnings.catch_warnings():  # the next step that runs out is counted, not warned about again
        warnings.simplefilter("error")
        module.queue += [make_rollout([[1, 1]] * 3)] * 2
        rollout_end(callback, module, make_rollout([[0, 1], [1, 1], [2, 2]]))
    assert module.logged["exhausted"] == 1 and callback.totals["exhausted_steps"] == 2


def test_running_out_with_skip_returns_an_empty_rollout():
    module = FakeModule(make_rollout([[0, 0], [1, 1]]))
    callback = DynamicSampling(max_rounds=1, on_exhausted="skip")
    with pytest.warns(UserWarning, match="skipping the step"):
        out = rollout_end(callback, module, make_rollout([[0, 1], [1, 1]]))
    assert out is not None and len(out) == 0 and out.num_groups == 0
    assert module.logged["exhausted"] == 1 and module.logged["groups_kept"] == 0


def test_no_informative_group_at_all_skips_even_with_train():
    module = FakeModule(make_rollout([[0, 0], [1, 1]]))
    with pytest.warns(UserWarning, match="0 of 2 informative groups.*skipping the step. Not one group had") as seen:
        out = rollout_end(DynamicSampling(max_rounds=1), module, make_rollout([[1, 1], [0, 0]]))
    assert len(out) == 0
    assert "Raise max_rounds" not in str(seen[0].message)  # more rounds cannot help a constant reward


def test_running_totals_are_logged_and_restored_from_state_dict():
    callback = DynamicSampling(num_groups=1, max_rounds=1)
    module = FakeModule(make_rollout([[0, 1]]))
    rollout_end(callback, module, make_rollout([[1, 1], [0, 0]]))
    rollout_end(callback, module, make_rollout([[1, 0]]))
    assert callback.state_dict() == {
        "steps": 2, "groups_drawn": 4, "groups_kept": 2, "rounds": 1, "exhausted_steps": 0, "tokens_drawn": 16,
    }  # fmt: skip
    assert module.logged["total_groups_drawn"] == 4
    restored = DynamicSampling()
    restored.load_state_dict(callback.state_dict())
    assert restored.totals == callback.totals


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_groups": 0}, "num_groups=0 must be an int >= 1"),
        ({"num_groups": 2.5}, "num_groups=2.5"),
        ({"max_rounds": -1}, "max_rounds=-1 must be an int >= 0"),
        ({"max_rounds": None}, "max_rounds=None"),
        ({"atol": -0.1}, "atol=-0.1 must be a finite number >= 0"),
        ({"atol": float("nan")}, "atol=nan"),
        ({"on_exhausted": "stop"}, "on_exhausted='stop' is not valid; choose 'train' or 'skip'"),
    ],
)
def test_invalid_arguments_name_the_field_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicSampling(**kwargs)


def test_an_unscored_rollout_is_refused():
    rollout = make_rollout([[0, 1]])
    rollout.reward = None
    with pytest.raises(ValueError, match="needs a scored rollout"):
        DynamicSampling().on_rollout_end(TRAINER, FakeModule(), rollout)


# ---- in a real Trainer ------------------------------------------------------------------------------------------


def uniform_groups(rollout: Rollout) -> int:
    """Groups whose rewards are all exactly equal."""
    return sum(int(rollout.reward[rollout.group == g].unique().numel() == 1) for g in rollout.group.unique())


class TrainedOn(RolloutCallback):
    """Placed after DynamicSampling: records the rollout each step goes on to train on."""

    def __init__(self) -> None:
        self.groups, self.uniform = [], []

    @override
    def on_rollout_end(self, trainer, pl_module, rollout):
        self.groups.append(rollout.num_groups)
        self.uniform.append(uniform_groups(rollout))


def first_digit(prompts, completions, answer, **_):
    """1 if the completion starts with the answer's first digit (sort_digits: the smallest digit), else 0.
    A random tiny model gets it about 1 time in 80: roughly 1 group of 8 in 10 is informative."""
    return [float(c.strip()[:1] == a[:1]) for c, a in zip(completions, answer, strict=True)]


def quiet_trainer(steps: int, callbacks: list, **kwargs) -> L.Trainer:
    warnings.filterwarnings("ignore", message="DynamicSampling")
    return tiny.quiet_trainer(steps, callbacks, **kwargs)


def test_every_gpo_step_trains_on_exactly_num_groups_informative_groups(tiny_assets):
    model, data = tiny_assets
    L.seed_everything(0)
    module = tiny.tiny_module(model, [first_digit], group_size=8, engine=HFEngine(sampling=Sampling(max_new_tokens=3)))
    sampling, trained_on = DynamicSampling(num_groups=3, max_rounds=60), TrainedOn()
    trainer = quiet_trainer(6, [sampling, trained_on])
    trainer.fit(module, tiny.prompts(model, data, 4))
    assert trainer.global_step == 6
    assert trained_on.groups == [3] * 6 and trained_on.uniform == [0] * 6
    assert sampling.totals["steps"] == 6 and sampling.totals["exhausted_steps"] == 0
    assert sampling.totals["rounds"] > 6  # most groups are uniform here: it had to draw more
    logged = trainer.callback_metrics
    assert logged["dynamic_sampling/groups_kept"] == 3 and logged["dynamic_sampling/groups_drawn"] >= 4


def test_gpo_skips_a_step_without_informative_groups(tiny_assets):
    model, data = tiny_assets

    def constant(prompts, completions, **_):
        return [1.0] * len(completions)

    module = tiny.tiny_module(model, [constant], group_size=2, engine=HFEngine(sampling=Sampling(max_new_tokens=2)))
    trainer = quiet_trainer(1, [DynamicSampling(max_rounds=0)], limit_train_batches=2, max_epochs=1)
    trainer.fit(module, tiny.prompts(model, data, 2))
    assert trainer.global_step == 0  # both batches skipped: an empty rollout from the hook means no step
    assert trainer.callback_metrics["rollout/skipped"] == 1.0


def test_a_run_whose_batches_are_all_skipped_stops_with_the_cause_instead_of_running_forever(tiny_assets, monkeypatch):
    """Skipped batches do not count towards max_steps: a run that skips them all never ended."""
    from gpo.train.module import RunStalled

    monkeypatch.setattr("gpo.train.module.MAX_SKIPPED_IN_A_ROW", 3)
    model, data = tiny_assets

    def constant(prompts, completions, **_):
        return [1.0] * len(completions)

    module = tiny.tiny_module(model, [constant], group_size=2, engine=HFEngine(sampling=Sampling(max_new_tokens=2)))
    trainer = quiet_trainer(5, [DynamicSampling(max_rounds=0)])
    with pytest.raises(RunStalled, match=r"the last 3 training batches were all skipped.*dynamic_sampling/\*"):
        trainer.fit(module, tiny.prompts(model, data, 2))
    assert trainer.fit_loop.epoch_loop.total_batch_idx == 2 and trainer.global_step == 0


class Bandit(RolloutSource, L.LightningModule):
    """Not a GPOModule: a policy over ``actions`` answers per prompt, trained by group-mean-baselined REINFORCE on
    reward 1 for answer ``prompt % actions``. It follows only DynamicSampling's documented contract: it declares
    ``RolloutSource.draw_rollout`` and runs the rollout hooks with one call."""

    def __init__(self, prompts: int = 64, actions: int = 8, group_size: int = 4, batch: int = 4) -> None:
        super().__init__()
        self.logits = torch.nn.Embedding(prompts, actions)
        torch.nn.init.zeros_(self.logits.weight)
        self.prompts, self.actions, self.group_size, self.batch = prompts, actions, group_size, batch
        self.extra = torch.Generator().manual_seed(1)
        self.trained_on: list[Rollout] = []
        self.automatic_optimization = False

    def train_dataloader(self):
        return DataLoader(torch.arange(self.prompts), batch_size=self.batch, shuffle=True)

    def draw_rollout(self) -> Rollout:
        return self.scored_rollout(torch.randint(self.prompts, (self.batch,), generator=self.extra))

    @torch.no_grad()
    def scored_rollout(self, batch: torch.Tensor) -> Rollout:
        prompt = batch.repeat(self.group_size)  # rows of a group are not adjacent
        action = torch.distributions.Categorical(logits=self.logits(prompt)).sample()
        ones, group = torch.ones(len(prompt), 1, dtype=torch.long), torch.arange(len(batch)).repeat(self.group_size)
        return Rollout(
            prompt_ids=prompt[:, None], prompt_mask=ones, completion_ids=action[:, None], completion_mask=ones,
            truncated=torch.zeros(len(prompt), dtype=torch.bool), group=group,
            reward=(action == prompt % self.actions).float(),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        rollout = run_rollout_hooks(self.trainer, self, self.scored_rollout(batch))
        if len(rollout) == 0:
            return  # skip the step: no optimiser step, so global_step stays
        self.trained_on.append(rollout)
        _, index = torch.unique(rollout.group, return_inverse=True)
        groups = int(index.max()) + 1
        mean = torch.zeros(groups).index_add(0, index, rollout.reward) / torch.bincount(index, minlength=groups)
        logp = torch.log_softmax(self.logits(rollout.prompt_ids[:, 0]), -1).gather(1, rollout.completion_ids)[:, 0]
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(-((rollout.reward - mean[index]) * logp).mean())
        optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.parametrize("on_exhausted", ["train", "skip"])
def test_a_plain_lightning_module_following_the_contract_gets_the_filtering(on_exhausted):
    torch.manual_seed(0)
    module = Bandit()
    # max_rounds=1 runs out now and then: "train" steps then hold 1-3 groups; "skip" steps are skipped
    sampling = DynamicSampling(max_rounds=1, on_exhausted=on_exhausted)
    trainer = quiet_trainer(8, [sampling], max_epochs=-1)
    trainer.fit(module)
    assert trainer.global_step == 8 == len(module.trained_on)
    assert all(uniform_groups(rollout) == 0 for rollout in module.trained_on)
    groups = [rollout.num_groups for rollout in module.trained_on]
    if on_exhausted == "skip":
        assert groups == [4] * 8 and sampling.totals["steps"] > 8  # skipped steps are not optimiser steps
    else:
        assert all(1 <= g <= 4 for g in groups) and min(groups) < 4  # it ran out on some steps and trained
    assert sampling.totals["groups_kept"] == sum(groups)
    assert trainer.callback_metrics["dynamic_sampling/groups_drawn"] >= 4


def test_a_wholly_informative_first_rollout_below_num_groups_is_topped_up_by_the_draws():
    """The first rollout alone stands only when it is the target: here its 2 groups are short of num_groups=4."""
    first, more = make_rollout([[0, 1], [1, 0]], tag="a"), make_rollout([[1, 0], [0, 2]], tag="b")
    module = FakeModule(more)
    out = rollout_end(DynamicSampling(num_groups=4, max_rounds=1), module, first)
    assert list(groups_by_prompt(out)) == ["a0", "a1", "b0", "b1"] and module.drawn == 1


def test_with_atol_zero_only_exactly_equal_rewards_make_a_group_uniform_and_the_earliest_group_is_kept():
    """``> atol``: a group whose rewards are equal is dropped at atol 0; groups are taken in order of first row."""
    rollout = make_rollout([[1, 1], [0, 1e-9]])
    out = DynamicSampling(atol=0.0, max_rounds=0).on_rollout_end(TRAINER, FakeModule(), rollout)
    assert list(groups_by_prompt(out)) == ["1"]
    later_id_first = make_rollout([[0, 1], [1, 0]])
    later_id_first.group = torch.tensor([5, 5, 1, 1])  # group 5's rows come first
    out = DynamicSampling(num_groups=1).on_rollout_end(TRAINER, FakeModule(), later_id_first)
    assert out.reward.tolist() == [0.0, 1.0]  # group 5, drawn first, not group 1 (the lower id)


def test_informative_frac_counts_informative_groups_of_those_drawn_surplus_included():
    module = FakeModule()
    rollout_end(DynamicSampling(num_groups=1, max_rounds=0), module, make_rollout([[0, 1], [1, 0], [2, 0], [1, 1]]))
    assert module.logged["informative_frac"] == 0.75 and module.logged["groups_surplus"] == 2
