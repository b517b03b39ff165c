"""Dropping the log messages of other libraries that a gpo user cannot act on, by how they start."""

from __future__ import annotations

import logging


class DroppedMessages(logging.Filter):
    """Drops the records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def drop_messages(logger: str, *starts: str) -> None:
    """Drop the messages of ``logger`` that start with one of ``starts``; asking again for the same does nothing (an
    engine set up several times, several CLIs in one process)."""
    target = logging.getLogger(logger)
    if not any(isinstance(f, DroppedMessages) and f.starts == starts for f in target.filters):
        target.addFilter(DroppedMessages(starts))
