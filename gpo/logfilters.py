"""Dropping the log messages of other libraries that a gpo user cannot act on, by the pattern of their start."""

from __future__ import annotations

import logging
import re


class DroppedMessages(logging.Filter):
    """Drops the records whose message starts with a match of one of the regular expressions ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts, self.pattern = starts, re.compile("|".join(f"(?:{start})" for start in starts))

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def drop_messages(logger: str, *starts: str) -> None:
    """Drop the messages of ``logger`` that start with a match of one of the regular expressions ``starts``; asking
    again for the same does nothing (an engine set up several times, several CLIs in one process)."""
    target = logging.getLogger(logger)
    if not any(isinstance(f, DroppedMessages) and f.starts == starts for f in target.filters):
        target.addFilter(DroppedMessages(starts))
