"""Engines for tests that run them in the rollout worker: the worker imports this module, so it imports only what
the worker has already (gpo's rollout modules), not the test modules' Lightning."""

from __future__ import annotations

import os

from gpo.rollout.hf import HFEngine

MARK = "GPO_TEST_MARK"


class NamesTheMark(HFEngine):
    """Fails every ``generate`` with the value of the ``MARK`` environment variable in its message."""

    def generate(self, *args, **kwargs):
        raise RuntimeError(f"{MARK}={os.environ.get(MARK)}")
