"""ResumeCheckpoint: keep one ``last.ckpt`` current for exact resume, and stop gracefully on SIGTERM."""

from __future__ import annotations

import signal
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from gpo.callbacks.settings import check_count
from gpo.parallel import collectives
from gpo.train.checkpointing import RunLock
from gpo.train.loggers import ContinuedCSVLogger, OneEventTensorBoardLogger

SIGTERM_EXIT_CODE = 143  # 128 + SIGTERM, what shells and schedulers report for a terminated job


class ResumeCheckpoint(ModelCheckpoint):
    """Keeps ``<dirpath>/last.ckpt`` current, so a run can always be resumed.

    Writes ``<dirpath>/last.ckpt`` every ``every_n_train_steps`` optimiser steps, after the last step, and when the
    process receives SIGTERM; ``--ckpt_path last`` then continues the run exactly (see docs/reliability.md). When an
    evaluation follows the step, the checkpoint is written after it: a crash during the evaluation resumes from the
    checkpoint before, and the step is evaluated again.

    On SIGTERM the current training step finishes, the checkpoint is written, and the run stops by raising
    Lightning's ``SIGTERMException`` with exit code 143; without this callback a single-process Lightning run
    notices SIGTERM only at the end of an epoch. Ctrl-C (SIGINT) while training does the same, then stops as
    Lightning stops at Ctrl-C (``KeyboardInterrupt``, exit code 1); a second Ctrl-C stops at once, without the
    checkpoint (Lightning alone stops wherever the first one lands, mid-step, and saves nothing). With several
    processes every rank stops after the same step, whichever got the signal (one all-reduce of two flags per
    training batch). In a single-process run, SIGTERM or Ctrl-C during an evaluation (which runs after a whole step)
    stops it after the held-out batch under way and writes the checkpoint, which resumes by evaluating that step again
    from its first batch; SIGTERM exits 143 there too (Lightning alone ends such a run with exit code 0, as if it had
    finished). Files are replaced atomically when the trainer's checkpoint IO is gpo's ``AtomicCheckpointIO``
    (``GPOModule`` installs it).

    One run at a time per folder: a second run started on the folder of a live one stops at once, and a fresh run
    refuses a folder that holds an earlier run's ``last.ckpt`` (continue it with ``--ckpt_path last``, or choose
    another folder); see ``gpo.train.checkpointing.RunLock``.

    Works with any LightningModule. ``gpo fit`` adds one (``<default_root_dir>/checkpoints``, every 100 steps) unless
    ``trainer.callbacks`` already holds a ``ModelCheckpoint``.

    Args:
        dirpath: folder of ``last.ckpt``; None: ``<trainer.default_root_dir>/checkpoints`` (not Lightning's
            ``<log_dir>/checkpoints``, which moves with every new logger version and so hides ``last``).
        every_n_train_steps: optimiser steps between checkpoints.
        save_top_k: also keep the latest this many checkpoints, ``step<N>.ckpt`` (-1: all; 0: only ``last.ckpt``).
    """

    def __init__(self, dirpath: str | Path | None = None, every_n_train_steps: int = 100, save_top_k: int = 0) -> None:
        check_count("every_n_train_steps", every_n_train_steps, 1, "optimiser steps between checkpoints")
        check_count("save_top_k", save_top_k, -1, "-1 keeps all, 0 last.ckpt alone, K the latest K")
        super().__init__(
            dirpath=dirpath,
            filename="step{step:06d}",
            auto_insert_metric_name=False,  # step000100.ckpt, not stepstep=100.ckpt
            monitor="step",  # the latest save_top_k are the best (Lightning keeps none by count without a monitor)
            mode="max",
            save_last=True,
            save_top_k=save_top_k,
            every_n_train_steps=every_n_train_steps,
            enable_version_counter=False,  # one last.ckpt, replaced in place, never last-v1.ckpt
        )
        self._lock: RunLock | None = None
        self._sigterm_seen = False  # this process received SIGTERM (runs of several processes: on_train_start)
        self._sigint_seen = False  # this process received Ctrl-C (SIGINT) while training
        self._sigint_before: signal.Handlers | Callable | None = None  # the SIGINT handler to put back
        self._save_after_evaluation = False  # a checkpoint is due at the end of the evaluation under way
        self._evaluation_reopened = False  # resumed from a checkpoint written during an evaluation (a signal)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._default_dirpath(trainer)
        if stage == "fit":
            self._claim_folder(trainer)
        super().setup(trainer, pl_module, stage)

    def _claim_folder(self, trainer: Trainer) -> None:
        """Refuse a folder another live run writes to, then lock it for this run (global rank 0 writes the lock,
        after every rank has checked)."""
        self._lock = RunLock(self.dirpath)
        self._lock.check()
        trainer.strategy.barrier("gpo_run_lock")
        if trainer.is_global_zero:
            self._lock.acquire()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Ctrl-C marks the process that gets it (the step goes on). With several processes SIGTERM does too; the
        ranks agree at the end of each training batch (``_stop_requested``) and stop together. Lightning's own
        handler, installed just before, broadcasts from inside the signal handler while a rank may be in another
        collective, and its loops stop the signalled rank alone: either way the run hangs (Lightning issue
        #20806)."""
        self._sigterm_seen = self._sigint_seen = False  # a callback fitted again starts afresh
        self._save_after_evaluation = False
        self._last_global_step_saved = trainer.global_step  # a resumed run's checkpoint holds this step already
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread
        if trainer.world_size > 1:
            signal.signal(signal.SIGTERM, self._note_sigterm)  # Lightning's teardown restores the handler before it
        self._sigint_before = signal.signal(signal.SIGINT, self._note_sigint)

    def _note_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._sigterm_seen = True

    def _note_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self._sigint_seen:  # the second Ctrl-C: stop where it lands, as Lightning does
            self._restore_sigint()
            raise KeyboardInterrupt
        self._sigint_seen = True
        print("\nCtrl-C: stopping with a checkpoint after this step or held-out batch; again: at once, without one",
              file=sys.stderr, flush=True)  # fmt: skip

    def _restore_sigint(self) -> None:
        if self._sigint_before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._sigint_before)
            self._sigint_before = None

    def _stop_requested(self, trainer: Trainer) -> tuple[bool, bool]:
        """Whether to stop after this batch, for SIGTERM and for Ctrl-C: in one process Lightning's SIGTERM flag and
        this callback's Ctrl-C one; with several, whether any rank got either (one all-reduce a batch, so that
        every rank stops after the same step)."""
        if trainer.world_size == 1:
            return trainer.received_sigterm, self._sigint_seen
        seen = torch.tensor([float(self._sigterm_seen), float(self._sigint_seen)], device=trainer.strategy.root_device)
        sigterm, sigint = collectives.reduce_over_ranks(seen, "max").tolist()
        return bool(sigterm), bool(sigint)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Known only now: whether this run resumed a checkpoint (Lightning loads it after the setup hooks).
        if trainer.ckpt_path is None:
            check_no_earlier_run(self.dirpath)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release(trainer)
        self._restore_sigint()
        super().teardown(trainer, pl_module, stage)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stopped_by_lightning(trainer, exception)
        self._release(trainer)  # a run that fails (a setting refused at setup, a crash) gets no teardown
        self._restore_sigint()

    def _release(self, trainer: Trainer) -> None:
        if self._lock is not None and trainer.is_global_zero:
            self._lock.release()

    @override
    def _find_last_checkpoints(self, trainer: Trainer) -> set[str]:
        self._default_dirpath(trainer)  # Lightning resolves ckpt_path="last" before any setup hook runs
        found = super()._find_last_checkpoints(trainer)
        alone = trainer.checkpoint_callbacks == [self]  # else another callback's checkpoint may be resumed
        if alone and not any(self._fs.exists(path) for path in found):  # set once in a job that may be requeued
            if trainer.state.fn != TrainerFn.FITTING:  # nothing to evaluate: the untrained policy would pass for it
                raise FileNotFoundError(
                    f"--ckpt_path last: no checkpoint in {self.dirpath}. Give a .ckpt file, or leave --ckpt_path "
                    "out to evaluate the policy as model.policy loads it."
                )
            rank_zero_info(f"--ckpt_path last: no checkpoint in {self.dirpath} yet; starting from the initial weights.")
            # and not Lightning's words for the same, whose hint to set save_last does not apply (this one does)
            warnings.filterwarnings("ignore", message=r'.*\(ckpt_path="last"\) is set, but there is no last checkpoint')
        return found

    def _default_dirpath(self, trainer: Trainer) -> None:
        if self.dirpath is None:
            self.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args, **kwargs) -> None:
        # Counted from the last save, not as global_step % n: a batch may take several optimiser steps. The last
        # step is saved here too, not only at on_train_end: by then Lightning has closed the epoch, and a run
        # extended to a larger max_steps would start the next epoch instead of finishing this one.
        due = trainer.global_step - self._last_global_step_saved >= self._every_n_train_steps
        last = 0 < trainer.max_steps <= trainer.global_step
        sigterm, sigint = self._stop_requested(trainer)
        # Due before an evaluation: saved at its end (a crash in it resumes from the checkpoint before, and evaluates)
        self._save_after_evaluation = (due or last) and not (sigterm or sigint) and evaluation_follows(trainer)
        if sigterm or sigint:
            self._save_stopped(trainer, "SIGTERM" if sigterm else "Ctrl-C")
            raise SIGTERMException(SIGTERM_EXIT_CODE) if sigterm else KeyboardInterrupt
        if (due or last) and not self._save_after_evaluation:
            self._save_now(trainer)

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args, **kwargs) -> None:
        """Ctrl-C during an evaluation of a one-process fit stops after this held-out batch, as Lightning's loop stops
        at SIGTERM. With several processes both wait for the next training batch's end, where the ranks agree."""
        if self._sigint_seen and trainer.world_size == 1 and trainer.validating:
            self._save_stopped(trainer, "Ctrl-C")
            raise KeyboardInterrupt

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The checkpoint of a step whose evaluation follows it is written once that evaluation has ended: a
        checkpoint written before would resume after the evaluation, whose ``val/*`` row a crash had cut short."""
        if self._save_after_evaluation:
            self._save_now(trainer)
            self._save_after_evaluation = False

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._evaluation_reopened:  # the evaluation a signal cut short, from its start: counts made whole again
            total = trainer.fit_loop.epoch_loop.val_loop.batch_progress.total
            total.ready = total.started = total.completed
            for logger in trainer.loggers:  # the earlier run logged this step's training values: gpo's keep them
                if isinstance(logger, ContinuedCSVLogger | OneEventTensorBoardLogger):
                    logger.evaluation_repeated_first()
            self._evaluation_reopened = False

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save_now(trainer)

    def _stopped_by_lightning(self, trainer: Trainer, exception: BaseException) -> None:
        """Lightning's own loops (its evaluation loop above all) stop at SIGTERM with a ``SIGTERMException`` without
        exit code: a scheduler would read 0 as done. It becomes 143; a run being fitted first writes the checkpoint
        of its last whole step (one process: under DDP the others may not be here to take part in a save)."""
        if not isinstance(exception, SIGTERMException) or exception.code is not None:
            return
        exception.code = SIGTERM_EXIT_CODE
        if trainer.state.fn != TrainerFn.FITTING:
            rank_zero_info("SIGTERM: stopped")
            return
        if trainer.world_size == 1:
            self._save_stopped(trainer, "SIGTERM")
        else:
            rank_zero_info(f"SIGTERM: stopped after step {trainer.global_step}; resume from the last checkpoint")

    def _save_stopped(self, trainer: Trainer, signal_name: str) -> None:
        """The checkpoint of a run stopped by a signal after its last whole step; stopped during that step's
        evaluation (one process), one that resumes by evaluating the step again from its first held-out batch."""
        evaluating = trainer.validating
        if evaluating:
            reopen_evaluation(trainer)
            self._evaluation_reopened = True  # saved with the checkpoint, for the resumed run
        self._save_now(trainer)
        if evaluating and 0 < trainer.max_steps <= trainer.global_step:  # the last step's: nothing left to resume
            rank_zero_info(
                f"{signal_name}: stopped during the evaluation after the last step ({trainer.global_step}). Evaluate "
                f"{self.last_model_path} with `gpo validate --config ... --ckpt_path last` (in Python: "
                "trainer.validate(module, ckpt_path='last')), or raise trainer.max_steps and resume it."
            )
        else:
            step = trainer.global_step
            rank_zero_info(f"{signal_name}: stopped after step {step}; resume from {self.last_model_path}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "evaluation_reopened": self._evaluation_reopened}

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        step = checkpoint["global_step"]
        if trainer.state.fn == TrainerFn.FITTING and 0 <= trainer.max_steps < step:  # Lightning would stop at once
            rank_zero_warn(
                f"resumed at step {step}, past trainer.max_steps={trainer.max_steps}: nothing to train. Raise "
                f"trainer.max_steps above {step} to train on (gpo validate --ckpt_path last evaluates the checkpoint)."
            )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        moved_from = state_dict.get("dirpath")
        if moved_from and self.dirpath and moved_from != self.dirpath:  # a run folder moved or copied, then resumed
            state_dict = moved_checkpoint_paths(state_dict, Path(moved_from), Path(self.dirpath))
        super().load_state_dict(state_dict)
        self._evaluation_reopened = state_dict.get("evaluation_reopened", False)  # absent: written before 2026-11-28

    def _save_now(self, trainer: Trainer) -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            if self.save_top_k != 0:
                self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)


def evaluation_follows(trainer: Trainer) -> bool:
    """Whether Lightning evaluates right after the training batch that just ended (``trainer.val_check_interval``,
    the epoch's end, early stopping): its own test, read at ``on_train_batch_end``."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return trainer.enable_validation and epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)


def reopen_evaluation(trainer: Trainer) -> None:
    """Mark the evaluation under way as stopped inside its first batch: a checkpoint written now then resumes by
    evaluating the step again from the start (Lightning's restart mid-evaluation), where one written as the loops stand
    resumes after it, without its ``val/*`` row. The resumed run makes the counts whole (``on_validation_start``)."""
    progress = trainer.fit_loop.epoch_loop.val_loop.batch_progress
    before = progress.total.completed - progress.current.completed  # held-out batches of earlier evaluations
    one_started = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
    progress.total.load_state_dict({name: before + count for name, count in one_started.items()})
    progress.current.load_state_dict(one_started)


def moved_checkpoint_paths(state: dict[str, Any], old: Path, new: Path) -> dict[str, Any]:
    """``ModelCheckpoint``'s saved state with the paths under ``old`` moved under ``new``: Lightning keeps none of
    them from a folder other than its own, and says so in a warning (so ``save_top_k`` would lose count of the files
    it keeps)."""

    def moved(path: str) -> str:
        return str(new / Path(path).relative_to(old)) if path and Path(path).is_relative_to(old) else path

    paths = {key: moved(state[key]) for key in ("best_model_path", "kth_best_model_path", "last_model_path")
             if key in state}  # fmt: skip
    kept = {moved(path): score for path, score in state.get("best_k_models", {}).items()}
    return {**state, **paths, "best_k_models": kept, "dirpath": str(new)}


def check_no_earlier_run(dirpath: str | Path) -> None:
    """Refuse a run that does not resume in the checkpoint folder ``dirpath`` of an earlier run, whose ``last.ckpt``
    it would overwrite (``gpo fit`` asks before the model loads, ``ResumeCheckpoint`` when the fit starts)."""
    last = Path(dirpath) / "last.ckpt"
    if last.is_file():
        raise FileExistsError(
            f"{last} holds an earlier run's checkpoint, which this run would overwrite. Continue that run with "
            "--ckpt_path last (in Python: trainer.fit(..., ckpt_path='last')), or start this one in another folder "
            "(--trainer.default_root_dir DIR, or ResumeCheckpoint(dirpath=DIR))."
        )
