"""The settings parser of ``gpo fit``: Lightning's, refusing every setting it does not know."""

from __future__ import annotations

from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser


class SettingsParser(LightningArgumentParser):
    """``LightningArgumentParser`` that refuses an unknown setting whose value is an empty mapping.

    jsonargparse (4.53) drops such a key without a word where it refuses the same key with any other value: with
    ``ppo_clip: {}`` on CISPO (which has no PPO clip) or ``trainer: {foo: {}}``, the run would train as if the line
    were not there. Such a value is made null before the parser reads it, so the parser refuses the key as it
    refuses every unknown setting. The parsers jsonargparse builds for a class's own settings (``model.algorithm``'s
    ``init_args``) are of this class too: they copy the parser they serve."""

    def _apply_actions(self, cfg: Namespace | dict[str, Any], *args: Any, **kwargs: Any) -> Namespace:
        parent = kwargs.get("parent_key") or (args[0] if args else "")
        settings = {action.dest for action in self._actions}
        for node, name in unknown_empty_settings(cfg, settings, set(self.groups), parent):
            node[name] = None
        return super()._apply_actions(cfg, *args, **kwargs)


def unknown_empty_settings(cfg: Any, settings: set[str], groups: set[str], prefix: str = "") -> list[tuple[Any, str]]:
    """``(mapping, name)`` of each key under ``cfg`` (a dict or Namespace, at ``prefix``) that names none of the
    parser's ``settings`` (their destinations) or ``groups`` (``model``, ``trainer``) and whose value is a mapping
    with no value in it (``{}``, ``{a: {}}``). A setting's own value is its parser's to check (a class's settings
    have a parser of their own)."""
    found = []
    for name, value in _items(cfg) or []:
        key = f"{prefix}.{name}" if prefix else name
        within = key in groups or (key not in settings and any(s.startswith(key + ".") for s in settings))
        if within:
            found += unknown_empty_settings(value, settings, groups, key)
        elif key not in settings and _holds_no_value(value):
            found.append((cfg, name))
    return found


def _items(value: Any) -> list[tuple[str, Any]] | None:
    """The entries of a dict or Namespace one level down; None for any other value."""
    if isinstance(value, Namespace):
        return list(vars(value).items())
    if isinstance(value, dict):
        return list(value.items())
    return None


def _holds_no_value(value: Any) -> bool:
    entries = _items(value)
    return entries is not None and all(_holds_no_value(inner) for _, inner in entries)
