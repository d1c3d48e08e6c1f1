"""Which steps a manager saves: its save rules and the preemption notice, one decision per step.

:class:`SaveSchedule` is the manager's ``should_save`` and ``reached_preemption``: the
step rules of :class:`~objckpt.manager.save_policy.SavePolicy`, the time and continuous
rules (decided by the primary process and sent to the others, so every process takes the
same decision: :func:`~objckpt.manager.save_policy.primary_decides`), and JAX's
preemption sync point (:mod:`objckpt.manager.preemption`). Each answer is kept for its
step, so ``should_save(step)`` then ``save(step, ...)`` decide once.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from objckpt.manager.preemption import Preemption
from objckpt.manager.save_policy import SavePolicy, primary_decides

if TYPE_CHECKING:
    from objckpt.multihost import Coordinator

_now = time.monotonic  # the clock of min_interval_seconds (tests replace it)


class SaveSchedule:
    """The save rules and the preemption notice of one manager.

    Args:
        policy: the save rules.
        preemption: the preemption notice (JAX's sync point, or a caught SIGTERM).
        coordinator: this process's place in the job (the primary decides the time rules).
        root_url: the manager's root (names the key-value exchange of a decision).
        timeout: seconds a process waits for the primary's decision.
    """

    def __init__(
        self, policy: SavePolicy, preemption: Preemption, coordinator: Coordinator, root_url: str, timeout: float
    ) -> None:
        self.policy = policy
        self.preemption = preemption
        self._coordinator = coordinator
        self._root_url = root_url
        self._timeout = timeout
        self._last_save_started = _now()
        self._decided: tuple[int, bool] | None = None  # (step, should_save) of the last step asked
        self._preempted: tuple[int, bool] | None = None  # (step, reached_preemption) likewise

    def should_save(self, step: int, *, saving: bool) -> bool:
        """Whether ``step`` saves (``saving``: a save is still in flight, for the continuous rule)."""
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]
        decision = self.reached_preemption(step) or self.policy.by_step(step)
        if not decision and self.policy.is_dynamic:
            local = self.policy.dynamic(now=_now(), last_save_started=self._last_save_started, saving=saving)
            decision = primary_decides(self._coordinator, self._root_url, local, timeout=self._timeout)
        self._decided = (step, decision)
        return decision

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption notice has reached every process and ``step`` is where they all save."""
        if self._preempted is None or self._preempted[0] != step:
            self._preempted = (step, self.preemption.reached(step))
        return self._preempted[1]

    def started(self) -> None:
        """A save has started now: the time rules count from here, and the next step is asked anew."""
        self._last_save_started = _now()
        self._decided = None
