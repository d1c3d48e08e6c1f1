"""How many requests an operation keeps in flight: a window that backs off when the store says so.

A store that is overloaded answers 503 SlowDown (S3) or 429 (GCS, S3) instead
of doing the work. Retrying each such request after a backoff, at the same
concurrency, keeps the pressure on: the retries of 32 requests meet the same
overloaded prefix, and a request that draws ten refusals in a row fails the
save. So the transfer engine paces itself the way TCP paces a congested link
(additive increase, multiplicative decrease):

- the window starts at ``maximum`` (``Options.max_concurrency``): a store that
  never pushes back is driven at full speed from the first request;
- a throttled request halves it, once per round: requests that were already in
  flight when the window was last cut saw the same congestion, and cutting
  again for each of them would collapse the window to one;
- each request that succeeds widens it by ``1 / window`` (one more request per
  round of successes), up to ``maximum``.

Only throttling answers (:class:`~objckpt.errors.ThrottledError`) cut the
window: a reset or a timeout is as likely one bad connection as an overloaded
store, and halving a restore's concurrency for each would cost far more than
the retry.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("objckpt")

Outcome = Literal["ok", "throttled", "other"]


@dataclass(frozen=True)
class Ticket:
    """One request's slot: the round (cuts so far) it started in."""

    round: int


class AdaptiveLimit:
    """An asyncio semaphore whose size follows the store's throttling answers (AIMD)."""

    def __init__(self, maximum: int, *, minimum: int = 1, name: str = "", adaptive: bool = True) -> None:
        """``adaptive=False``: a plain semaphore of ``maximum`` slots (throttling is still retried)."""
        if not 1 <= minimum <= maximum:
            raise ValueError(f"bad window bounds: minimum={minimum}, maximum={maximum}")
        self.maximum = maximum
        self.minimum = minimum
        self.name = name
        self.adaptive = adaptive
        self.window = float(maximum)
        self.lowest = maximum  # the smallest the window has been (a sign of throttling in stats and logs)
        self.cuts = 0
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def limit(self) -> int:
        """Requests allowed in flight now."""
        return max(self.minimum, int(self.window))

    async def acquire(self) -> Ticket:
        """Wait for a slot (first come, first served)."""
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            return Ticket(self.cuts)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release_slot()  # granted as it was cancelled: pass the slot on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise
        return Ticket(self.cuts)

    def release(self, ticket: Ticket, outcome: Outcome) -> None:
        """Give the slot back, saying how its request went."""
        if outcome == "ok":
            self.window = min(float(self.maximum), self.window + 1.0 / self.window)
        elif outcome == "throttled" and ticket.round == self.cuts and self.adaptive:
            before = self.limit
            self.window = max(float(self.minimum), self.window / 2)
            self.cuts += 1
            self.lowest = min(self.lowest, self.limit)
            log.info(
                "objckpt: %s is throttling; requests in flight %d -> %d", self.name or "the store", before, self.limit
            )
        self._release_slot()

    def _release_slot(self) -> None:
        self.in_flight -= 1
        while self._waiters and self.in_flight < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)
