"""Ctrl-C while training: the step finishes, ``last.ckpt`` is written, the run stops as Lightning stops at Ctrl-C
(exit 1). Lightning alone stops where Ctrl-C lands, mid-step, without a checkpoint. The checkpoint is written by the
same path as at SIGTERM, whose exact resume ``test_resume.py`` shows; here the pipelined run, whose checkpoint also
holds the rollouts collected ahead, in a file of its own so that it runs beside the resume tests."""

import signal

from gpo.tasks import make_task, write_jsonl
from gpo.testing import save_tiny_model
from tests.reliability.test_resume import CONFIG, interrupt_after_first_checkpoint


def test_ctrl_c_finishes_the_step_writes_its_checkpoint_and_stops(tmp_path):
    save_tiny_model(tmp_path / "model", "llama", seed=0)
    write_jsonl(make_task("sort_digits", 20, seed=0), tmp_path / "train.jsonl")
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(model=tmp_path / "model", train=tmp_path / "train.jsonl", extra_callbacks="",
                                    entropy="{coef: 0.01}", lag=1))  # fmt: skip
    code, step, saved_at_the_signal = interrupt_after_first_checkpoint(config, tmp_path / "run", signal.SIGINT)
    assert code == 1 and saved_at_the_signal  # Lightning's exit code at Ctrl-C; its last periodic checkpoint is older
    assert step % 4 == 0 and 8 < step < 36  # after a whole batch (4 optimiser steps) past the periodic one at 8


def test_a_second_ctrl_c_stops_at_once_and_a_callback_fitted_again_starts_without_the_first_runs_marks(tmp_path):
    """The first Ctrl-C marks the run (it stops after the step); a second one raises where it lands. A trainer that
    fits again with the same callback starts unmarked: it would otherwise stop after its first step."""
    import lightning as L
    import pytest

    from gpo.callbacks import ResumeCheckpoint
    from tests.reliability.test_run_folder import Linear

    callback = ResumeCheckpoint(dirpath=tmp_path)
    callback._note_sigint(signal.SIGINT, None)
    assert callback._sigint_seen
    with pytest.raises(KeyboardInterrupt):
        callback._note_sigint(signal.SIGINT, None)
    trainer = L.Trainer(max_steps=3, callbacks=[callback], logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(Linear())
    assert trainer.global_step == 3
