"""Retention policies: which committed steps a manager keeps.

Each policy is a small object answering one question, "which of these steps do
you keep?"; the manager keeps the union, plus the latest committed step
always. With no policy at all nothing is ever deleted.

Only committed steps are ever candidates, so a save in flight (no manifest yet)
is never picked; the manager's delete also leaves alone a step that holds a
live-save marker (another writer saving into it, :mod:`objckpt.saving.live_markers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class StepRecord:
    """A committed step and the metrics it was saved with (if any).

    Attributes:
        step: the step number.
        metrics: the ``metrics=`` it was saved with (empty if none).
    """

    step: int
    metrics: dict[str, Any]


class RetentionPolicy(Protocol):
    """Which committed steps to keep: a manager deletes each step that no policy keeps.

    Any object with this ``keep`` method is one (``Retention(policies=[...])``); the
    newest committed step is kept whatever the policies say.
    """

    def keep(self, steps: Sequence[StepRecord]) -> set[int]:
        """The steps (of ``steps``, sorted ascending) this policy keeps."""
        ...


@dataclass(frozen=True)
class KeepLast:
    """Keep the ``n`` most recent steps.

    Attributes:
        n: how many (0 keeps none).
    """

    n: int

    def keep(self, steps: Sequence[StepRecord]) -> set[int]:
        """The last ``n`` of ``steps``."""
        return {s.step for s in steps[-self.n :]} if self.n > 0 else set()


@dataclass(frozen=True)
class KeepEvery:
    """Keep every step whose number is a multiple of ``k``, forever.

    Attributes:
        k: the interval in steps.
    """

    k: int

    def keep(self, steps: Sequence[StepRecord]) -> set[int]:
        """The steps of ``steps`` that are multiples of ``k``."""
        return {s.step for s in steps if s.step % self.k == 0}


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``n`` best steps by ``metric`` (``mode`` "max" or "min").

    Steps saved without the metric are never "best" (other policies may keep them).

    Attributes:
        n: how many.
        metric: the name of the metric, as passed in ``save(..., metrics={...})``.
        mode: ``"max"`` (the highest values are best) or ``"min"``.
    """

    n: int
    metric: str
    mode: str = "max"

    def __post_init__(self) -> None:
        if self.mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.mode!r}")

    def keep(self, steps: Sequence[StepRecord]) -> set[int]:
        """The ``n`` steps of ``steps`` with the best finite value of ``metric``."""
        scored = [s for s in steps if isinstance(s.metrics.get(self.metric), (int, float))]
        scored.sort(key=lambda s: float(s.metrics[self.metric]), reverse=self.mode == "max")
        return {s.step for s in scored[: self.n]}


def steps_to_delete(steps: Sequence[StepRecord], policies: Sequence[RetentionPolicy]) -> list[int]:
    """Committed steps that no policy keeps; never the latest, never any without policies."""
    if not policies or not steps:
        return []
    ordered = sorted(steps, key=lambda s: s.step)
    kept = {ordered[-1].step}
    for policy in policies:
        kept |= policy.keep(ordered)
    return [s.step for s in ordered if s.step not in kept]
