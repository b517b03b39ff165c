"""StepProgressBar: a progress bar that counts optimiser steps towards ``trainer.max_steps``."""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from typing_extensions import override

from gpo.callbacks.settings import check_count

#: Seconds between two redraws at least (tqdm's own floor): each costs about 0.3 ms on a CPU (the metrics copied to the
#: host, formatted and written), a few percent of a fast step, and no one reads ten redraws a second.
REDRAW_INTERVAL_S = 0.1


class AboveTheBars(logging.Handler):
    """Writes log records on lines of their own above the progress bars, which tqdm clears and draws again below
    them; Python's last-resort handler would write them after the bar's last redraw, on the bar's own line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            Tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging's contract: a failed write is reported, never raised
            self.handleError(record)


class StepProgressBar(TQDMProgressBar):
    """A progress bar that counts optimiser steps towards ``trainer.max_steps``.

    Lightning's tqdm bar, counting optimiser steps (``trainer.global_step``) out of ``trainer.max_steps`` over the
    whole run when ``max_steps`` is set (``Epoch 2, step: 15%|...| 152/1000``).

    Lightning's own bar counts the batches of the current epoch, and for a run bounded by ``max_steps`` alone caps
    that total at the steps left; a batch that takes several optimiser steps (``model.optim.number_of_minibatches``
    or ``ppo_epochs`` above 1) or a resumed run then shows totals such as ``152/1``. Without ``max_steps`` this bar
    is Lightning's. Metrics that reach the bar as tensors (gpo publishes them without a host copy) are shown as
    numbers. Needs nothing from the LightningModule.

    The count moves every step; the bar is redrawn (with its metrics) at most every ``REDRAW_INTERVAL_S`` seconds,
    and at the last step. While the bars are drawn, gpo's warnings (a server that stopped answering, a reward that
    failed) are written on lines of their own above them, unless logging has been set up with handlers of its own.

    Args:
        refresh_rate: redraw the bar every this many batches at most (and at the last step).
    """

    def __init__(self, refresh_rate: int = 1) -> None:
        check_count("refresh_rate", refresh_rate, 1, "optimiser steps between redraws")
        super().__init__(refresh_rate=refresh_rate)
        self._redrawn_at = -math.inf  # time.monotonic() of the last redraw
        self._above = AboveTheBars()

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        gpo_log = logging.getLogger("gpo")
        if self.is_enabled and not gpo_log.hasHandlers():  # else Python's last resort is not what prints them
            gpo_log.addHandler(self._above)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        logging.getLogger("gpo").removeHandler(self._above)
        super().teardown(trainer, pl_module, stage)

    @override
    def on_train_start(self, trainer: L.Trainer, *_: Any) -> None:
        super().on_train_start(trainer)
        if trainer.max_steps > 0:  # a run resumed mid-epoch gets no on_train_epoch_start before its first batch
            self._count_steps(trainer)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if trainer.max_steps <= 0:
            super().on_train_epoch_start(trainer)
            return
        self._count_steps(trainer)

    def _count_steps(self, trainer: L.Trainer) -> None:
        """Show ``global_step`` out of ``max_steps``, counting on from the steps already done (a resumed run)."""
        bar = self.train_progress_bar
        if bar.total != trainer.max_steps:
            bar.reset(total=trainer.max_steps)
            bar.initial = bar.n = trainer.global_step
        bar.set_description(f"Epoch {trainer.current_epoch}, step")

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.max_steps <= 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar, now = self.train_progress_bar, time.monotonic()
        bar.n = trainer.global_step  # shown at the next redraw
        bar.total = max(bar.total, bar.n)  # a batch of several steps may pass max_steps: tqdm would draw "14/?"
        due = (batch_idx + 1) % self.refresh_rate == 0 and now - self._redrawn_at >= REDRAW_INTERVAL_S
        if due or trainer.global_step >= trainer.max_steps:
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # also redraws the bar
            self._redrawn_at = now

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """Close the bars still drawn and end their line: the error that stopped the run is printed on its own."""
        logging.getLogger("gpo").removeHandler(self._above)  # Lightning calls no teardown after an error
        bars = (self._train_progress_bar, self._val_progress_bar, self._test_progress_bar, self._predict_progress_bar)
        drawn = [bar for bar in bars if bar is not None and not bar.disable]
        for bar in reversed(drawn):  # the lowest first (an evaluation's, below the training bar), then up
            bar.close()  # a bar kept on screen (leave) ends its line; one that is not is cleared from it
        cleared = [bar for bar in drawn if not bar.leave]
        if cleared and len(cleared) == len(drawn):
            cleared[0].fp.write("\n")

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        return {key: value.item() if isinstance(value, torch.Tensor) else value for key, value in metrics.items()}
