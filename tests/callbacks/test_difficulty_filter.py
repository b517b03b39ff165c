"""DifficultyFilter: windowed pass rates, skipping outside the band, re-tests, fallback, checkpoints, a real fit."""

import json
import warnings

import pytest
import torch
from typing_extensions import override

from gpo.callbacks.difficulty_filter import DifficultyFilter, select_prompts
from gpo.rollout import HFEngine, Sampling
from gpo.testing import save_tiny_model
from gpo.train.hooks import RolloutCallback
from tests.callbacks.fake_trainer import fake_trainer, published
from tests.callbacks.grouped import grouped_rollout
from tests.tiny import prompts, quiet_trainer, tiny_module


class FakeModule:
    """Its ``trainer`` holds what the filter publishes."""

    def __init__(self):
        self.trainer = fake_trainer()

    @property
    def logged(self) -> dict[str, float]:
        return published(self.trainer, "")


def make_rollout(prompts, rewards, fields=None):
    return grouped_rollout(prompts, rewards, fields=fields)


def make_batch(prompts, fields=None):
    return {"prompt_ids": [[ord(c) for c in p] for p in prompts], "prompt": list(prompts), "fields": fields or {}}


def step(flt, module, prompts, rewards_by_prompt, fields=None):
    """One step: filter ``prompts``, then score the kept ones with the given rewards; returns the kept prompts."""
    kept = flt.on_prompts(module.trainer, module, make_batch(prompts, fields)) or make_batch(prompts, fields)
    flt.on_rollout_end(
        module.trainer, module, make_rollout(kept["prompt"], [rewards_by_prompt[p] for p in kept["prompt"]])
    )
    flt.on_train_batch_end(module.trainer, module, None, None, 0)  # the filter publishes its metrics
    return kept["prompt"]


# 4 completions per group: "easy" passes 4/4 (rate 1.0), "hard" 0/4, "mid" 2/4 (inside [0.2, 0.8])
REWARDS = {"easy": [1.0] * 4, "hard": [0.0] * 4, "mid": [1.0, 0.0, 0.0, 1.0]}


def test_prompts_outside_the_band_are_skipped_and_retested_after_retest_every_steps():
    flt, module = DifficultyFilter(retest_every=3), FakeModule()
    prompts = ["easy", "hard", "mid"]
    assert step(flt, module, prompts, REWARDS) == prompts  # step 1: nothing known, all tested
    assert module.logged["difficulty/inside"] == 1 and module.logged["difficulty/below"] == 1
    assert module.logged["difficulty/above"] == 1
    assert step(flt, module, prompts, REWARDS) == ["mid"]  # step 2: easy/hard tested 1 step ago
    assert module.logged["difficulty/seen"] == 3 and module.logged["difficulty/skipped"] == 2
    assert step(flt, module, prompts, REWARDS) == ["mid"]  # step 3: 2 steps ago, still fresh
    assert step(flt, module, prompts, REWARDS) == prompts  # step 4: 3 steps ago = retest_every -> re-tested
    assert step(flt, module, prompts, REWARDS) == ["mid"]


def test_a_retest_alone_decides_so_a_prompt_that_got_harder_comes_back():
    flt, module = DifficultyFilter(retest_every=2, window=4), FakeModule()
    step(flt, module, ["p"], {"p": [1.0] * 4})  # step 1: 4/4 -> above
    with pytest.warns(UserWarning, match="every prompt of the batch is outside"):
        assert flt.on_prompts(module.trainer, module, make_batch(["p"]))["prompt"] == ["p"]  # step 2: fallback keeps it
    flt.on_rollout_end(module.trainer, module, make_rollout(["p"], [[0.0, 1.0, 0.0, 1.0]]))  # 2/4; window: 6/8 = 0.75
    flt.on_train_batch_end(module.trainer, module, None, None, 0)
    assert module.logged["difficulty/fallback"] == 1.0
    assert flt.pass_rate("p") == 0.75  # both groups fresh, pooled: (4 + 2) / 8
    step(flt, module, ["q"], {"q": [0.0] * 4})  # steps 3, 4: p untouched
    step(flt, module, ["q"], {"q": [0.0] * 4})
    assert flt.pass_rate("p") is None and "p" not in flt.history  # newest group 2 steps old: stale, forgotten


def test_stale_prompts_are_forgotten_whatever_their_order_of_first_sight():
    """The history is kept in order of last update, so forgetting stops at the first fresh prompt: a prompt seen
    first but updated since must not hide a stale one behind it."""
    flt, module = DifficultyFilter(retest_every=2), FakeModule()
    for prompt in ["a", "b", "a", "c"]:  # steps 1-4
        step(flt, module, [prompt], {prompt: [0.0, 1.0]})
    assert list(flt.history) == ["a", "c"]  # b, last seen at step 2, is 2 steps old at step 4: stale


def test_the_band_counts_are_taken_on_the_steps_the_loggers_write():
    flt, module = DifficultyFilter(), FakeModule()
    module.trainer.log_every_n_steps = 2
    step(flt, module, ["mid"], REWARDS)  # batch 0: not a logged batch
    assert "difficulty/inside" not in module.logged and module.logged["difficulty/seen"] == 1
    module.trainer.fit_loop.epoch_loop.total_batch_idx = 1
    step(flt, module, ["mid"], REWARDS)
    assert module.logged["difficulty/inside"] == 1


def test_pass_rate_pools_the_last_window_groups():
    flt, module = DifficultyFilter(window=2, pass_threshold=0.5), FakeModule()
    flt.on_prompts(module.trainer, module, make_batch(["p"]))
    flt.on_rollout_end(module.trainer, module, make_rollout(["p", "p"], [[0.0] * 4, [0.5, 0.7]]))  # 0/4, then 2/2
    assert flt.pass_rate("p") == pytest.approx(2 / 6)
    flt.on_rollout_end(module.trainer, module, make_rollout(["p"], [[0.4, 0.6, 0.6, 0.6, 0.6, 0.6]]))  # 5/6; 0/4 leaves
    assert flt.pass_rate("p") == pytest.approx((2 + 5) / (2 + 6))


def test_all_skipped_keeps_the_whole_batch_and_warns_once():
    flt, module = DifficultyFilter(), FakeModule()
    step(flt, module, ["easy", "hard"], REWARDS)
    with pytest.warns(UserWarning, match=r"at step 2 every prompt .* outside the pass-rate band \[0.2, 0.8\]"):
        assert step(flt, module, ["easy", "hard"], REWARDS) == ["easy", "hard"]
    assert module.logged["difficulty/fallback"] == 1.0 and module.logged["difficulty/skipped"] == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(flt, module, ["hard"], REWARDS)  # no second warning
    assert step(flt, module, ["hard", "mid"], REWARDS) == ["mid"]
    assert module.logged["difficulty/fallback"] == 0.0


def test_key_column_tracks_prompts_by_id_and_fields_stay_aligned():
    flt, module = DifficultyFilter(key_column="id"), FakeModule()
    fields = {"id": [7, 8], "answer": ["a", "b"]}
    batch = make_batch(["same", "same"], fields)
    flt.on_prompts(module.trainer, module, batch)
    flt.on_rollout_end(module.trainer, module, make_rollout(["same", "same"], [[1.0] * 2, [1.0, 0.0]], fields))
    assert flt.pass_rate(7) == 1.0 and flt.pass_rate(8) == 0.5
    kept = flt.on_prompts(module.trainer, module, batch)
    assert kept["fields"] == {"id": [8], "answer": ["b"]} and kept["prompt_ids"] == [batch["prompt_ids"][1]]
    with pytest.raises(ValueError, match=r"key_column='id' is not among the batch fields \(answer\)"):
        flt.on_prompts(module.trainer, module, make_batch(["x"], {"answer": ["a"]}))


def test_score_index_judges_on_one_reward_function():
    flt, module = DifficultyFilter(score_index=1), FakeModule()
    rollout = make_rollout(["p"], [[5.0, 5.0]])  # the mixed reward would pass both
    rollout.scores = torch.tensor([[5.0, 1.0], [5.0, 0.0]])
    flt.on_prompts(module.trainer, module, make_batch(["p"]))
    flt.on_rollout_end(module.trainer, module, rollout)
    assert flt.pass_rate("p") == 0.5
    with pytest.raises(ValueError, match="score_index=3 but the rollout has 2 score columns"):
        DifficultyFilter(score_index=3).on_rollout_end(module.trainer, module, rollout)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"low": 0.9, "high": 0.1}, "high=0.1 must be a finite number >= 0.9 and <= 1"),
        ({"high": 1.5}, "high=1.5"),
        ({"low": "a"}, r"low='a' must be a finite number >= 0 and <= 1 \(the lowest pass rate kept\)"),
        ({"pass_threshold": float("nan")}, "pass_threshold=nan must be a finite number"),
        ({"window": 2.5}, "window=2.5 must be an int >= 1"),
        ({"score_index": True}, "score_index=True must be an int >= 0"),
        ({"window": 0}, "window=0 must be an int >= 1"),
        ({"retest_every": 0}, "retest_every=0 must be an int >= 1"),
        ({"score_index": -1}, "score_index=-1 must be an int >= 0"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DifficultyFilter(**kwargs)


def test_state_dict_round_trip_through_torch_save(tmp_path):
    flt, module = DifficultyFilter(retest_every=3, window=2), FakeModule()
    for _ in range(2):
        step(flt, module, ["easy", "hard", "mid"], REWARDS)
    torch.save(flt.state_dict(), tmp_path / "state.pt")
    restored = DifficultyFilter(retest_every=3, window=2)
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert restored.state_dict() == flt.state_dict() and restored.step == 2
    assert {k: list(v) for k, v in restored.history.items()} == {k: list(v) for k, v in flt.history.items()}
    for _ in range(3):  # both make the same decisions from here on
        assert step(restored, module, ["easy", "hard", "mid"], REWARDS) == step(
            flt, module, ["easy", "hard", "mid"], REWARDS
        )


def test_select_prompts_passes_other_keys_through():
    batch = {**make_batch(["a", "b", "c"], {"x": [1, 2, 3]}), "extra": "kept"}
    assert select_prompts(batch, [0, 2]) == {
        "prompt_ids": [[97], [99]],
        "prompt": ["a", "c"],
        "fields": {"x": [1, 3]},
        "extra": "kept",
    }


# ---- inside a real Trainer with GPOModule --------------------------------------------------------------------


def by_prompt(prompts, completions, **_):
    return [REWARDS[p][i % 4] for i, p in enumerate(prompts)]  # rows of a group are adjacent, 4 per group


class SeenPrompts(RolloutCallback):
    def __init__(self):
        self.steps = []

    @override
    def on_rollout_end(self, trainer, module, rollout):
        self.steps.append(sorted(set(rollout.prompts)))


def fit(root, steps, flt, ckpt_path=None):
    model = str(root / "model")
    module = tiny_module(model, [by_prompt], engine=HFEngine(sampling=Sampling(max_new_tokens=2)))
    seen = SeenPrompts()
    trainer = quiet_trainer(steps, [flt, seen], default_root_dir=root)
    trainer.fit(module, prompts(model, str(root / "train.jsonl"), 3), ckpt_path=ckpt_path)
    return trainer, seen.steps


def test_filters_a_real_run_and_resumes_from_a_checkpoint(tmp_path):
    save_tiny_model(tmp_path / "model")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in REWARDS))
    trainer, seen = fit(tmp_path, 4, DifficultyFilter(retest_every=3))
    everything = ["easy", "hard", "mid"]
    assert seen == [everything, ["mid"], ["mid"], everything]
    logged = trainer.callback_metrics
    assert logged["difficulty/skipped"] == 0 and logged["difficulty/seen"] == 3
    assert (logged["difficulty/inside"], logged["difficulty/below"], logged["difficulty/above"]) == (1, 1, 1)

    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"]
    state = next(v for k, v in saved.items() if k.startswith("DifficultyFilter"))
    assert state["step"] == 4 and sorted(state["keys"]) == everything

    resumed = DifficultyFilter(retest_every=3)
    trainer, seen = fit(tmp_path, 5, resumed, ckpt_path=tmp_path / "last.ckpt")
    assert seen == [["mid"]]  # easy and hard were re-tested at step 4, before the checkpoint
    assert resumed.step == 5 and trainer.global_step == 5


def test_the_shipped_callbacks_config_lists_difficulty_filter_before_dynamic_sampling():
    """DifficultyFilter learns from the rollout it is handed: after DynamicSampling that rollout has lost the uniform
    groups (all failed or all passed), the very prompts it exists to skip."""
    import yaml

    from gpo.cli.shipped import shipped_configs

    listed = [
        c["class_path"] for c in yaml.safe_load(shipped_configs()["callbacks"].read_text())["trainer"]["callbacks"]
    ]
    assert listed.index("gpo.callbacks.DifficultyFilter") < listed.index("gpo.callbacks.DynamicSampling")


def test_dynamic_sampling_listed_before_the_filter_is_refused_when_the_run_starts(tmp_path):
    from gpo.callbacks import DynamicSampling

    save_tiny_model(tmp_path / "model")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in REWARDS))
    model = str(tmp_path / "model")
    module = tiny_module(model, [by_prompt], engine=HFEngine(sampling=Sampling(max_new_tokens=2)))
    trainer = quiet_trainer(2, [DynamicSampling(), DifficultyFilter()], default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="lists DynamicSampling before DifficultyFilter; list DifficultyFilter first"):
        trainer.fit(module, prompts(model, str(tmp_path / "train.jsonl"), 3))


def test_the_band_includes_its_edges_when_admitting_and_counting():
    """A prompt whose pass rate is exactly ``low`` or ``high`` is inside the band: admitted, and counted inside."""
    flt, module = DifficultyFilter(low=0.25, high=0.75, window=1), FakeModule()
    rollout = grouped_rollout(["at_low", "at_high", "below"], [[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    flt.on_prompts(module.trainer, module, {"prompt": ["at_low", "at_high", "below"], "prompt_ids": [[1]] * 3})
    flt.on_rollout_end(module.trainer, module, rollout)
    assert [flt.admits(key) for key in ("at_low", "at_high", "below")] == [True, True, False]
    assert flt.population() == {"inside": 2, "below": 1, "above": 0}


def test_a_resumed_filter_keeps_its_window_and_its_warning_once():
    """After ``load_state_dict`` the pass rate still pools only the last ``window`` groups, and a fallback warned
    about before the checkpoint is not warned about again."""
    flt, module = DifficultyFilter(window=2, low=0.3, high=1.0), FakeModule()
    resumed = DifficultyFilter(window=2, low=0.3, high=1.0)
    flt.on_prompts(module.trainer, module, {"prompt": ["p"], "prompt_ids": [[1]]})
    flt.on_rollout_end(module.trainer, module, grouped_rollout(["p"], [[1, 1]]))  # saved in the checkpoint
    flt._warned_fallback = True
    resumed.load_state_dict(flt.state_dict())
    for rewards in ([0, 0], [0, 0]):  # the saved group, all passing, falls out of the window of 2
        resumed.on_prompts(module.trainer, module, {"prompt": ["p"], "prompt_ids": [[1]]})
        resumed.on_rollout_end(module.trainer, module, grouped_rollout(["p"], [rewards]))
    assert not resumed.admits("p")  # 0 of 4 pass: below the band (with the first group pooled in, 2 of 6: inside)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.on_prompts(module.trainer, module, {"prompt": ["p"], "prompt_ids": [[1]]})  # all skipped: fallback


def test_a_score_index_one_past_the_columns_is_refused_by_name():
    module = FakeModule()
    rollout = grouped_rollout(["p"], [[0, 1]])
    rollout.scores = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="score_index=2 but the rollout has 2 score columns"):
        DifficultyFilter(score_index=2).on_rollout_end(module.trainer, module, rollout)
