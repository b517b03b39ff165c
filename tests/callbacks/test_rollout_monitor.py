"""RolloutMonitor: hand-worked statistics, the collapse warning (all three signals and only then), entropy sources,
checkpoints, and a real fit."""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from gpo.callbacks.rollout_monitor import RolloutMonitor, unique_ngram_ratio
from gpo.models.scorer import TokenScorer
from gpo.rollout.base import Rollout
from gpo.testing import tiny_model
from tests.callbacks.fake_trainer import fake_trainer, published
from tests.tiny import prompts, quiet_trainer, tiny_module


class GivenEntropy:
    """A scorer that hands back a given token entropy."""

    def __init__(self, entropy):
        self.entropy = entropy

    def rollout_scores(self, rollout, *, entropy=False, batch_size=None):
        return SimpleNamespace(entropy=self.entropy)


class FakeModule:
    def __init__(self, scorer=None):
        self.scorer = scorer


def monitored(trainer) -> dict[str, float]:
    """What the monitor published into ``trainer`` (its ``monitor/*`` metrics)."""
    return {f"monitor/{key}": value for key, value in published(trainer, "monitor/").items()}


def make_rollout(ids, mask, group, reward, truncated=None, prompt_len=1):
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    size = ids.shape[0]
    return Rollout(
        prompt_ids=torch.full((size, prompt_len), 2),
        prompt_mask=torch.ones(size, prompt_len, dtype=torch.long),
        completion_ids=ids,
        completion_mask=mask,
        truncated=torch.tensor(truncated or [False] * size),
        group=torch.tensor(group),
        reward=torch.tensor(reward, dtype=torch.float32),
    )


def run_step(monitor, rollout, metrics=None, step=0, token_entropy=None):
    """on_rollout_end then on_train_batch_end of training batch ``step``, as in a training step that logged
    ``metrics`` (its optimiser step done: ``global_step`` is one more), with the module's scorer giving
    ``token_entropy[B, T]``; returns what the monitor logged."""
    module, trainer = FakeModule(GivenEntropy(token_entropy)), fake_trainer(step + 1, step, **(metrics or {}))
    monitor.on_rollout_end(fake_trainer(step), module, rollout)
    monitor.on_train_batch_end(trainer, module, None, None, 0)
    return monitored(trainer)


# Two groups of two: group 0 repeats one completion, group 1 differs.
IDS = [[5, 6, 7, 1], [5, 6, 7, 1], [5, 6, 1, 0], [8, 9, 9, 9]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]
GROUP = [0, 0, 1, 1]


def test_statistics_of_a_hand_worked_rollout():
    rollout = make_rollout(IDS, MASK, GROUP, [1.0, 1.0, 0.0, 1.0], truncated=[False, True, False, True])
    entropy = torch.tensor([[1.0] * 4, [2.0] * 4, [3.0, 3.0, 3.0, 99.0], [0.0] * 4])
    logged = run_step(RolloutMonitor(ngram=2, compute_entropy=True), rollout, token_entropy=entropy)
    expected = {
        "monitor/entropy": (4 * 1 + 4 * 2 + 3 * 3 + 4 * 0) / 15,  # the 99 sits on padding
        "monitor/len_mean": (4 + 4 + 3 + 4) / 4,
        "monitor/len_max": 4.0,
        "monitor/truncated_frac": 0.5,
        # group 0: bigrams 56 67 71 twice -> 3 distinct / 6; group 1: 56 61 | 89 99 99 -> 4 / 5
        "monitor/ngram_unique": (3 / 6 + 4 / 5) / 2,
        # rewards 1 1 0 1: mean 0.75, variance (3 * 0.25^2 + 0.75^2) / 4 = 0.1875
        "monitor/reward_std": math.sqrt(0.1875),
        "monitor/reward_spread": 1.0,
        "monitor/reward_group_std": (0.0 + 0.5) / 2,  # group 1: 0 and 1 -> population std 0.5
        "monitor/zero_adv_frac": 0.5,  # group 0 is uniform
        "monitor/collapse_streak": 0.0,
        "monitor/collapse": 0.0,
    }
    assert logged.keys() == expected.keys()
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value), key


def test_entropy_is_the_policys_own_tokens_only():
    """Multi-turn rollouts hold environment tokens in the completion (``completion_mask`` 1, ``loss_mask`` 0): the
    policy never sampled them, and the training ``entropy`` metric leaves them out too."""
    rollout = make_rollout(IDS, MASK, GROUP, [1.0, 1.0, 0.0, 1.0])
    rollout.loss_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]])  # 0: observations
    entropy = torch.tensor([[1.0, 1.0, 50.0, 50.0], [2.0, 2.0, 50.0, 50.0], [3.0, 3.0, 3.0, 99.0], [0.0, 50, 50, 4]])
    logged = run_step(RolloutMonitor(compute_entropy=True), rollout, token_entropy=entropy)
    assert logged["monitor/entropy"] == pytest.approx((2 * 1 + 2 * 2 + 3 * 3 + 0 + 4) / 9)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (1, (4 / 8 + 5 / 7) / 2),  # group 1 unigrams: 5 6 1 8 9 9 9 -> 5 distinct of 7
        (3, (2 / 4 + 3 / 3) / 2),  # group 1: 561 | 899 999
        (4, (1 / 2 + 1 / 1) / 2),  # row 2 has only 3 tokens: no 4-gram
    ],
)
def test_unique_ngram_ratio_for_several_n(n, expected):
    ratio = unique_ngram_ratio(torch.tensor(IDS), torch.tensor(MASK), torch.tensor(GROUP), n)
    assert ratio == pytest.approx(expected)


def test_unique_ngram_ratio_averages_only_the_groups_that_have_ngrams():
    """Group 0's completions are one token long: no bigram, so it is left out, not counted as a ratio of 0."""
    ids = torch.tensor([[5, 0, 0], [6, 0, 0], [7, 8, 7], [7, 8, 7]])
    mask = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    # group 1's bigrams: 78 87 78 87, 2 distinct of 4
    assert unique_ngram_ratio(ids, mask, torch.tensor([0, 0, 1, 1]), 2) == 0.5


def test_unique_ngram_ratio_is_nan_without_ngrams():
    assert math.isnan(unique_ngram_ratio(torch.tensor(IDS), torch.tensor(MASK), torch.tensor(GROUP), 5))
    assert math.isnan(unique_ngram_ratio(torch.tensor(IDS), torch.zeros(4, 4), torch.tensor(GROUP), 1))


def signals(entropy_low=False, diversity_low=False, width_low=False):
    """Two groups of four, 3 tokens each, and the entropy the module logs. High: entropy 2, every bigram distinct
    (ratio 1), group rewards 0 0 1 1 (std 0.5). Low: entropy 0.5, every completion [5 6 7] (2 distinct bigrams of 8:
    0.25), rewards all 1 (std 0)."""
    ids = [[5, 6, 7]] * 8 if diversity_low else [[10 + 3 * r, 11 + 3 * r, 12 + 3 * r] for r in range(8)]
    reward = [1.0] * 8 if width_low else [0.0, 0.0, 1.0, 1.0] * 2
    return make_rollout(ids, [[1, 1, 1]] * 8, [0] * 4 + [1] * 4, reward), {"entropy": 0.5 if entropy_low else 2.0}


ALL_LOW = {"entropy_low": True, "diversity_low": True, "width_low": True}


def test_collapse_warning_fires_after_patience_steps_of_all_three_low_and_once_per_episode():
    monitor = RolloutMonitor(ngram=2, warmup=2, patience=2, collapse_fraction=0.5)
    for step in range(2):
        run_step(monitor, *signals(), step)  # warmup: peaks 2, 1, 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_step(monitor, *signals(**ALL_LOW), 2)["monitor/collapse_streak"] == 1.0
    with pytest.warns(UserWarning, match="collapse") as caught:
        logged = run_step(monitor, *signals(**ALL_LOW), 3)
    assert len(caught) == 1 and logged["monitor/collapse"] == 1.0
    message = str(caught[0].message)
    assert "possible collapse at step 3" in message and "for 2 consecutive steps" in message
    for part in ("entropy 0.5 (peak 2)", "ngram_unique 0.25 (peak 1)", "reward_group_std 0 (peak 0.5)"):
        assert part in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_step(monitor, *signals(**ALL_LOW), 4)["monitor/collapse"] == 1.0  # same episode: no repeat
        assert run_step(monitor, *signals(), 5)["monitor/collapse"] == 0.0  # recovery re-arms the warning
        run_step(monitor, *signals(**ALL_LOW), 6)
    with pytest.warns(UserWarning, match="possible collapse at step 7"):
        run_step(monitor, *signals(**ALL_LOW), 7)


@pytest.mark.parametrize(
    "low",
    [
        {"entropy_low": True},
        {"diversity_low": True},
        {"width_low": True},
        {"entropy_low": True, "diversity_low": True},
        {"entropy_low": True, "width_low": True},
        {"diversity_low": True, "width_low": True},
    ],
)
def test_no_warning_when_only_one_or_two_signals_fall(low):
    monitor = RolloutMonitor(ngram=2, warmup=1, patience=2)
    run_step(monitor, *signals())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(1, 10):
            assert run_step(monitor, *signals(**low), step)["monitor/collapse_streak"] == 0.0


def test_a_signal_at_exactly_the_collapse_fraction_of_its_peak_has_not_fallen():
    monitor = RolloutMonitor(ngram=2, warmup=1, patience=1, collapse_fraction=0.5)
    run_step(monitor, *signals())  # peaks: entropy 2, ngram_unique 1, reward_group_std 0.5
    rollout, _ = signals(diversity_low=True, width_low=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_step(monitor, rollout, {"entropy": 1.0}, 1)["monitor/collapse_streak"] == 0.0  # 1.0 = 0.5 x 2
    with pytest.warns(UserWarning, match="possible collapse at step 2"):
        run_step(monitor, rollout, {"entropy": 0.999}, 2)


def test_a_warning_given_before_a_resume_is_not_given_again_for_the_same_collapse():
    monitor = RolloutMonitor(ngram=2, warmup=1, patience=1)
    run_step(monitor, *signals())
    with pytest.warns(UserWarning, match="possible collapse at step 1"):
        run_step(monitor, *signals(**ALL_LOW), 1)
    resumed = RolloutMonitor(ngram=2, warmup=1, patience=1)
    resumed.load_state_dict(monitor.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_step(resumed, *signals(**ALL_LOW), 2)["monitor/collapse_streak"] == 2.0
    run_step(resumed, *signals(), 3)  # recovery re-arms it
    with pytest.warns(UserWarning, match="possible collapse at step 4"):
        run_step(resumed, *signals(**ALL_LOW), 4)


def test_no_collapse_is_judged_during_warmup():
    monitor = RolloutMonitor(ngram=2, warmup=3, patience=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, signal in enumerate([signals(), signals(**ALL_LOW), signals(**ALL_LOW)]):
            assert run_step(monitor, *signal, step)["monitor/collapse_streak"] == 0.0
    with pytest.warns(UserWarning, match="at step 3"):
        run_step(monitor, *signals(**ALL_LOW), 3)


def test_entropy_from_the_logged_metric_and_without_any_source():
    def without_entropy(**kwargs):
        return signals(**kwargs)[0]

    logged = run_step(RolloutMonitor(), without_entropy(), {"entropy": torch.tensor(0.7)})
    assert logged["monitor/entropy"] == pytest.approx(0.7)

    monitor = RolloutMonitor(ngram=2, warmup=1, patience=1, entropy_metric=None)
    with pytest.warns(UserWarning, match="no token entropy this step"):
        assert "monitor/entropy" not in run_step(monitor, without_entropy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no collapse without entropy, and the missing entropy is reported once
        for step in range(1, 4):
            logged = run_step(monitor, without_entropy(diversity_low=True, width_low=True), None, step)
    assert logged["monitor/collapse_streak"] == 0.0


def test_computed_entropy_matches_a_full_softmax_reference():
    model = tiny_model("llama", seed=1).eval()
    torch.manual_seed(0)
    ids = torch.randint(2, 60, (3, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    rollout = make_rollout(ids.tolist(), mask.tolist(), [0, 0, 1], [0.0, 1.0, 0.0], prompt_len=3)
    rollout.prompt_ids = torch.randint(2, 60, (3, 3))
    with torch.no_grad():
        logits = model(rollout.input_ids, attention_mask=rollout.attention_mask).logits[:, 2:-1]  # [3, 5, V]
        logp = logits.double().log_softmax(-1)
        reference = float((-(logp.exp() * logp).sum(-1) * mask).sum() / mask.sum())
    for batch_size in (None, 1):
        scorer = TokenScorer(model)
        monitor, module = RolloutMonitor(compute_entropy=True, entropy_batch_size=batch_size), FakeModule(scorer)
        trainer = fake_trainer(entropy=torch.tensor(-1.0))
        monitor.on_rollout_end(fake_trainer(), module, rollout)
        monitor.on_train_batch_end(trainer, module, None, None, 0)
        assert monitored(trainer)["monitor/entropy"] == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ngram": 0}, "ngram=0 must be an int >= 1"),
        ({"entropy_batch_size": 0}, "entropy_batch_size=0 must be an int >= 1"),
        ({"collapse_fraction": 1.0}, r"collapse_fraction=1.0 must be a finite number > 0 and < 1"),
        ({"warmup": -1}, "warmup=-1 must be an int >= 0"),
        ({"patience": 0}, "patience=0 must be an int >= 1"),
        ({"ngram": 2.5}, "ngram=2.5 must be an int >= 1"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutMonitor(**kwargs)


def test_state_dict_round_trip_continues_the_streak(tmp_path):
    monitor = RolloutMonitor(ngram=2, warmup=1, patience=3)
    run_step(monitor, *signals(), 0)
    for step in (1, 2):
        run_step(monitor, *signals(**ALL_LOW), step)
    torch.save(monitor.state_dict(), tmp_path / "state.pt")
    restored = RolloutMonitor(ngram=2, warmup=1, patience=3)
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert (
        restored.state_dict()
        == monitor.state_dict()
        == {
            "steps": 3,
            "streak": 2,
            "warned": False,
            "peaks": {"entropy": 2.0, "ngram_unique": 1.0, "reward_group_std": 0.5},
        }
    )
    with pytest.warns(UserWarning, match="possible collapse at step 3"):
        run_step(restored, *signals(**ALL_LOW), 3)


# ---- inside a real Trainer with GPOModule --------------------------------------------------------------------


def test_monitors_a_real_run_and_saves_its_state(tiny_assets, tmp_path):
    model, data = tiny_assets
    monitor = RolloutMonitor(compute_entropy=True, warmup=1)
    trainer = quiet_trainer(3, [monitor], default_root_dir=tmp_path)
    trainer.fit(tiny_module(model), prompts(model, data))
    logged = trainer.callback_metrics
    # one update per step and no dropout: the training pass saw the same policy and tokens as the monitor
    assert float(logged["monitor/entropy"]) == pytest.approx(float(logged["entropy"]), rel=1e-4)
    assert float(logged["monitor/len_mean"]) == pytest.approx(float(logged["completion/len_mean"]))
    assert float(logged["monitor/truncated_frac"]) == pytest.approx(float(logged["completion/truncated_frac"]))
    assert 0 < float(logged["monitor/ngram_unique"]) <= 1
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"]
    state = next(v for k, v in saved.items() if k.startswith("RolloutMonitor"))
    assert state["steps"] == 3 and state["peaks"]["entropy"] > 0


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_unique_ngram_ratio_matches_sets_of_tuples(n):
    """Random completions with a 150k vocabulary, holes in the mask and scattered group ids, against the ratio
    counted with Python sets."""
    generator = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 150_000, (24, 12), generator=generator)
    ids[::3] = ids[::3] % 4  # some rows from 4 tokens: repeats within and across completions
    ids[1] = ids[0]  # a completion copied inside its group
    mask = (torch.rand(24, 12, generator=generator) > 0.15).long()
    group = torch.tensor([40, 7, 7, 40, 1000, 3] * 4)
    ratios = []
    for g in group.unique().tolist():
        grams = [
            tuple(row[i : i + n])
            for row, keep in zip(ids[group == g].tolist(), mask[group == g].tolist(), strict=True)
            for i in range(12 - n + 1)
            if all(keep[i : i + n])
        ]
        if grams:
            ratios.append(len(set(grams)) / len(grams))
    assert unique_ngram_ratio(ids, mask, group, n) == pytest.approx(sum(ratios) / len(ratios), rel=1e-12)


def test_unique_ngram_ratio_keeps_bigrams_apart_whose_keys_a_base_too_small_would_merge():
    """(0, M) and (1, 0) with M the largest id: a key ``first * M + second`` would make them equal."""
    ids, mask, group = torch.tensor([[0, 150_000], [1, 0]]), torch.ones(2, 2), torch.tensor([5, 5])
    assert unique_ngram_ratio(ids, mask, group, 2) == 1.0


def test_an_emptied_rollout_publishes_nothing_and_a_statistic_without_a_value_is_left_out():
    """A step DynamicSampling emptied trains nothing: nothing to measure (its statistics would fail on no rows). A
    statistic with no value (no n-gram in completions shorter than ``ngram``) is left out, not logged as nan."""
    empty = make_rollout(torch.zeros(0, 4, dtype=torch.long).tolist(), torch.zeros(0, 4).tolist(), [], [])
    assert run_step(RolloutMonitor(), empty) == {}
    short = make_rollout([[5, 1, 0, 0], [6, 1, 0, 0]], [[1, 1, 0, 0], [1, 1, 0, 0]], [0, 0], [0.0, 1.0])
    logged = run_step(RolloutMonitor(ngram=3), short)
    assert "monitor/ngram_unique" not in logged and "monitor/len_mean" in logged
