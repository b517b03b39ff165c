"""CompletionSamples: which samples are picked, the Markdown file, the loggers that show text, a real fit."""

from pathlib import Path
from types import SimpleNamespace
from unittest.mock import Mock

import pytest
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

from gpo.callbacks.completion_samples import COLUMNS, CompletionSamples
from gpo.cli import default_loggers
from tests.callbacks.grouped import grouped_rollout
from tests.tiny import prompts, quiet_trainer, tiny_module


def make_rollout(prompts, completions, rewards):
    return grouped_rollout(prompts, rewards, completions=completions)


def fake_trainer(log_dir, step=7, loggers=(), zero=True):
    return SimpleNamespace(
        log_dir=str(log_dir), default_root_dir=str(log_dir), global_step=step, is_global_zero=zero, loggers=loggers
    )


# group means: p0 0.3, p1 0.8, p2 0.0
ROLLOUT = (["p0", "p1", "p2"], [["a0", "b0"], ["a1", "b1"], ["a2", "b2"]], [[0.2, 0.4], [1.0, 0.6], [0.0, 0.0]])


def test_picks_alternate_between_the_best_and_the_worst_groups():
    rows = CompletionSamples(num_samples=4).pick(make_rollout(*ROLLOUT))
    assert rows == [
        ["high", 0.8, 1.0, "p1", "a1"],  # best group, its best completion
        ["low", 0.0, 0.0, "p2", "b2"],  # worst group, its worst completion (tie: the later row)
        ["high", 0.3, 0.4, "p0", "b0"],  # second best group
        ["low", 0.3, 0.2, "p0", "a0"],  # second worst group: the same one; its worst completion
    ]
    assert len(CompletionSamples(num_samples=9).pick(make_rollout(*ROLLOUT))) == 6  # then a2 (high) and b1 (low)


def test_writes_a_readable_markdown_file(tmp_path):
    CompletionSamples(num_samples=2).on_rollout_end(fake_trainer(tmp_path), None, make_rollout(*ROLLOUT))
    text = (tmp_path / "samples" / "step_000007.md").read_text()
    assert text == "\n".join(
        [
            "# Samples at step 7",
            "",
            "## 1. high-reward group (group mean 0.8, this completion 1)",
            "",
            "**prompt**",
            "",
            "```text",
            "p1",
            "```",
            "",
            "**completion**",
            "",
            "```text",
            "a1",
            "```",
            "",
            "## 2. low-reward group (group mean 0, this completion 0)",
            "",
            "**prompt**",
            "",
            "```text",
            "p2",
            "```",
            "",
            "**completion**",
            "",
            "```text",
            "b2",
            "```",
            "",
        ]
    )


def test_long_texts_are_cut_and_backticks_get_a_longer_fence(tmp_path):
    rollout = make_rollout(["q"], [["x" * 30, "```py\nprint()\n```"]], [[1.0, 0.0]])
    CompletionSamples(num_samples=2, max_chars=20).on_rollout_end(fake_trainer(tmp_path), None, rollout)
    text = (tmp_path / "samples" / "step_000007.md").read_text()
    assert "x" * 20 + "... [10 more characters]\n" in text
    assert "````text\n```py\nprint()\n```\n````" in text


def test_every_n_steps_counts_rollouts_and_only_global_zero_writes(tmp_path):
    samples = CompletionSamples(every_n_steps=2)
    for step in range(5):
        samples.on_rollout_end(fake_trainer(tmp_path, step=10 * step), None, make_rollout(*ROLLOUT))
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [
        "step_000000.md",
        "step_000020.md",
        "step_000040.md",
    ]
    other = CompletionSamples(every_n_steps=1)
    other.on_rollout_end(fake_trainer(tmp_path / "rank1", zero=False), None, make_rollout(*ROLLOUT))
    assert other.rollouts_seen == 1 and not (tmp_path / "rank1").exists()


def test_loggers_with_text_support_receive_the_samples(tmp_path, monkeypatch):
    tensorboard = TensorBoardLogger(tmp_path / "tb")
    add_text = Mock()
    monkeypatch.setattr(tensorboard.experiment, "add_text", add_text)
    wandb, mlflow = Mock(spec=WandbLogger), Mock(spec=MLFlowLogger)
    mlflow.run_id = "run-1"
    loggers = [CSVLogger(tmp_path / "csv"), tensorboard, wandb, mlflow]
    CompletionSamples(num_samples=1).on_rollout_end(
        fake_trainer(tmp_path, loggers=loggers), None, make_rollout(*ROLLOUT)
    )
    text = (tmp_path / "samples" / "step_000007.md").read_text()
    add_text.assert_called_once_with("samples", text, global_step=7)
    wandb.log_text.assert_called_once_with(
        key="samples", columns=COLUMNS, data=[[7, "high", 0.8, 1.0, "p1", "a1"]], step=7
    )
    mlflow.experiment.log_text.assert_called_once_with("run-1", text, "samples/step_000007.md")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, "every_n_steps=0 must be an int >= 1"),
        ({"num_samples": 0}, "num_samples=0 must be an int >= 1"),
        ({"max_chars": 0}, "max_chars=0 must be an int >= 1"),
        ({"every_n_steps": 2.5}, "every_n_steps=2.5 must be an int >= 1"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompletionSamples(**kwargs)


def test_state_dict_round_trip(tmp_path):
    samples = CompletionSamples(every_n_steps=3)
    for _ in range(4):
        samples.on_rollout_end(fake_trainer(tmp_path), None, make_rollout(*ROLLOUT))
    restored = CompletionSamples(every_n_steps=3)
    restored.load_state_dict(samples.state_dict())
    assert restored.state_dict() == {"rollouts_seen": 4, "owed": False}


def test_a_due_sample_whose_rollout_is_empty_waits_for_the_next_rollout_with_rows(tmp_path):
    """DAPO's dynamic sampling skips early steps with an empty rollout: their sample must not be lost until the next
    due step (every_n_steps later). The turn owed is saved in checkpoints."""
    samples = CompletionSamples(every_n_steps=100)
    full = make_rollout(*ROLLOUT)
    empty = full.select([])
    samples.on_rollout_end(fake_trainer(tmp_path, step=0), None, empty)
    restored = CompletionSamples(every_n_steps=100)
    restored.load_state_dict(samples.state_dict())
    for step in (1, 2):
        restored.on_rollout_end(fake_trainer(tmp_path, step=step), None, full)
    assert [p.name for p in (tmp_path / "samples").iterdir()] == ["step_000001.md"]


def test_a_rollout_without_prompt_texts_is_refused_by_name(tmp_path):
    rollout = make_rollout(*ROLLOUT)
    rollout.prompts = []
    with pytest.raises(ValueError, match=r"CompletionSamples needs a scored rollout with texts"):
        CompletionSamples().on_rollout_end(fake_trainer(tmp_path), None, rollout)


# ---- inside a real Trainer with GPOModule --------------------------------------------------------------------


def test_writes_samples_during_a_real_run_and_resumes_the_schedule(tiny_assets, tmp_path, monkeypatch):
    model, data = tiny_assets
    loggers = default_loggers(str(tmp_path))  # CSV + TensorBoard, as `gpo fit` uses
    texts = []
    monkeypatch.setattr(loggers[1].experiment, "add_text", lambda tag, text, global_step: texts.append(global_step))

    def fit(steps, samples, ckpt_path=None):
        trainer = quiet_trainer(steps, [samples], logger=loggers)
        trainer.fit(tiny_module(model), prompts(model, data), ckpt_path=ckpt_path)
        return trainer

    trainer = fit(3, CompletionSamples(every_n_steps=2, num_samples=2))
    folder = Path(trainer.log_dir) / "samples"
    assert folder.parent.name == "version_0" and texts == [0, 2]
    assert sorted(p.name for p in folder.iterdir()) == ["step_000000.md", "step_000002.md"]
    text = (folder / "step_000002.md").read_text()
    assert text.startswith("# Samples at step 2\n") and "## 2. low-reward group" in text  # picks differ
    assert "=\n```" in text  # a sort_digits prompt such as "381=" in its fenced block

    trainer.save_checkpoint(tmp_path / "last.ckpt")
    resumed = CompletionSamples(every_n_steps=2, num_samples=2)
    fit(5, resumed, ckpt_path=tmp_path / "last.ckpt")
    assert resumed.rollouts_seen == 5 and texts == [0, 2, 4]  # the 4th rollout (0-based) is due


def test_a_group_of_one_completion_is_shown_once_and_a_text_of_exactly_max_chars_whole(tmp_path):
    """The group's best completion is also its worst: one row, not two. A text at the limit is not cut."""
    rows = CompletionSamples(num_samples=4).pick(make_rollout(["p0"], [["only"]], [[0.5]]))
    assert rows == [["high", 0.5, 0.5, "p0", "only"]]
    rollout = make_rollout(["q"], [["y" * 20]], [[1.0]])
    CompletionSamples(num_samples=1, max_chars=20).on_rollout_end(fake_trainer(tmp_path), None, rollout)
    text = (tmp_path / "samples" / "step_000007.md").read_text()
    assert "y" * 20 + "\n" in text and "more characters" not in text
