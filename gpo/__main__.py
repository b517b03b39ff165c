"""``python -m gpo``: the same as the ``gpo`` command."""

from gpo.cli import run

run()
