"""When a training loop saves: the step interval, chosen steps, a time floor, continuous saving.

:class:`SavePolicy` answers "does this step save?" from the step number, the time and
whether a save is still in flight; it does no I/O. The manager asks it once per step
(:meth:`objckpt.CheckpointManager.should_save`), adds the preemption notice
(:mod:`objckpt.manager.preemption`), and in a multi-process job has the primary
process decide the parts that depend on time or on the save in flight and tell the
others (:func:`primary_decides`), so every process takes the same decision.

The names are Orbax's where Orbax has one (``save_interval_steps``, ``save_on_steps``,
continuous checkpointing with a minimum interval): a migrated loop keeps its meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from objckpt.multihost import Coordinator


@dataclass(frozen=True)
class SavePolicy:
    """Which steps save.

    Args:
        save_interval_steps: save every step that is a multiple of N.
        save_on_steps: also save these steps (any iterable of step numbers).
        final_step: the loop's last step; it always saves, so a run that ends
            between intervals keeps its last step.
        min_interval_seconds: save once this many seconds have passed since the
            previous save started (since the manager was made, before any save);
            with ``continuous``, the least time between two saves.
        continuous: save whenever no save is in flight, so the next save starts
            as soon as the previous one has committed.

    With none of these every step saves (Orbax's default interval of 1). The
    step-based rules are pure functions of the step, identical on every process;
    the time and in-flight rules are :meth:`dynamic`.
    """

    save_interval_steps: int | None = None
    save_on_steps: frozenset[int] = field(default_factory=frozenset)
    final_step: int | None = None
    min_interval_seconds: float | None = None
    continuous: bool = False

    def __post_init__(self) -> None:
        if self.save_interval_steps is not None and self.save_interval_steps <= 0:
            raise ValueError(f"save_interval_steps must be positive, got {self.save_interval_steps}")
        if self.min_interval_seconds is not None and self.min_interval_seconds < 0:
            raise ValueError(f"min_interval_seconds must be >= 0, got {self.min_interval_seconds}")
        object.__setattr__(self, "save_on_steps", frozenset(int(s) for s in self.save_on_steps))
        if not self.given:
            object.__setattr__(self, "save_interval_steps", 1)

    @property
    def given(self) -> bool:
        """Whether any rule was asked for (without one, every step saves)."""
        return (
            self.save_interval_steps is not None
            or bool(self.save_on_steps)
            or self.final_step is not None
            or self.min_interval_seconds is not None
            or self.continuous
        )

    @property
    def is_dynamic(self) -> bool:
        """Whether some decisions depend on time or on a save in flight (not only on the step)."""
        return self.continuous or self.min_interval_seconds is not None

    def by_step(self, step: int) -> bool:
        """Whether ``step`` saves by its number alone: the interval, a chosen step, the final step."""
        if self.save_interval_steps is not None and step % self.save_interval_steps == 0:
            return True
        return step in self.save_on_steps or step == self.final_step

    def dynamic(self, *, now: float, last_save_started: float, saving: bool) -> bool:
        """Whether the time or continuous rule saves now.

        Args:
            now: the clock's reading now.
            last_save_started: the same clock's reading when the previous save
                started (or when the manager was made).
            saving: whether a save is still in flight (not yet committed).
        """
        elapsed = self.min_interval_seconds is None or now - last_save_started >= self.min_interval_seconds
        if self.continuous:
            return not saving and elapsed
        return self.min_interval_seconds is not None and elapsed


def primary_decides(coordinator: Coordinator, root_url: str, local: bool, *, timeout: float) -> bool:
    """The primary process's ``local`` decision, on every process (one key-value exchange
    through the coordination service; one process: ``local``)."""
    if coordinator.process_count == 1:
        return local
    from objckpt.multihost import operation_tag

    tag = operation_tag("should_save", root_url)
    mine = (b"1" if local else b"0") if coordinator.is_primary else None
    try:
        return coordinator.broadcast(f"{tag}/decision", mine, timeout=timeout) == b"1"
    finally:
        coordinator.release(tag)
