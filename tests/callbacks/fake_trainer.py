"""A stand-in for the parts of a Lightning ``Trainer`` that gpo's callbacks read, and that
``gpo.train.metrics.publish_values`` writes their metrics into."""

from types import SimpleNamespace


def fake_trainer(global_step: int = 0, batch_idx: int | None = None, **callback_metrics) -> SimpleNamespace:
    """A trainer at ``global_step`` and training batch ``batch_idx`` (default: ``global_step``, as before the batch's
    optimiser step; after it, in ``on_train_batch_end``, ``global_step`` is one more) with no loggers (nothing is
    written anywhere): what callbacks publish lands in its ``callback_metrics``, which start as
    ``callback_metrics``."""
    batch_idx = global_step if batch_idx is None else batch_idx
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(total_batch_idx=batch_idx))
    return SimpleNamespace(
        global_step=global_step, callback_metrics=dict(callback_metrics), progress_bar_metrics={}, loggers=[],
        log_every_n_steps=1, max_steps=-1, should_stop=False, fit_loop=loop,
    )  # fmt: skip


def published(trainer: SimpleNamespace, prefix: str) -> dict[str, float]:
    """The metrics published under ``prefix`` (without it), as floats."""
    metrics = trainer.callback_metrics
    return {key.removeprefix(prefix): float(value) for key, value in metrics.items() if key.startswith(prefix)}
