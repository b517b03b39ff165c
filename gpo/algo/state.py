"""What an algorithm part keeps from one step to the next, for checkpoints."""

from __future__ import annotations

from typing import Any


class PartState:
    """Every part (advantage estimator, ratio gate, loss aggregator, reward mixer, token weight, token mask) keeps
    nothing across steps unless it says so. A part whose results depend on earlier steps (a running reward
    baseline, an adaptive bound) overrides both methods with plain values and tensors: ``GPOModule`` saves them in
    its checkpoints and gives them back on resume, so the resumed run goes on from that state. Its public
    attributes of plain values are its settings (compared on resume), except those named in its state."""

    def state_dict(self) -> dict[str, Any]:
        """The state that outlives a step (none by default)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what ``state_dict`` returned."""
