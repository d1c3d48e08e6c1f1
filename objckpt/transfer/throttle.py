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

Each operation has its own window, but what one learned about a bucket is kept
for the next (:class:`WindowMemory`, for ``REMEMBER_SECONDS``): a manager that
saves every few minutes to a throttling bucket would otherwise open each save
with a full window and draw a burst of refusals, each of them a request body
sent for nothing. The next operation starts at twice the remembered window
(capped at ``maximum``): one cut brings it back if the bucket still pushes
back, and it has not lost much if the bucket stopped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

log = logging.getLogger("objckpt")

Outcome = Literal["ok", "throttled", "other"]

#: How long what an operation learned about a bucket's throttling is kept for the next one.
REMEMBER_SECONDS = 600.0


class WindowMemory:
    """The last window each bucket was throttled down to, shared by the operations of a process."""

    def __init__(self, seconds: float = REMEMBER_SECONDS) -> None:
        self.seconds = seconds
        self._windows: dict[str, tuple[float, float]] = {}  # bucket -> (window, when)
        self._lock = threading.Lock()  # operations run on several event loops and threads

    @staticmethod
    def bucket(name: str) -> str:
        """``s3://bucket/any/prefix`` -> ``s3://bucket``: throttling is the bucket's, not one checkpoint's."""
        parts = urlsplit(name)
        return f"{parts.scheme}://{parts.netloc}" if parts.netloc else name

    def start(self, name: str, maximum: int) -> float:
        """The window a new operation on ``name`` starts with."""
        with self._lock:
            window, when = self._windows.get(self.bucket(name), (float(maximum), 0.0))
        if time.monotonic() - when > self.seconds:
            return float(maximum)
        return min(float(maximum), 2 * window)

    def update(self, name: str, window: float, maximum: int) -> None:
        """Remember ``window`` (forget the bucket once it is back to ``maximum``)."""
        key = self.bucket(name)
        with self._lock:
            if window >= maximum:
                self._windows.pop(key, None)
            else:
                self._windows[key] = (window, time.monotonic())

    def clear(self) -> None:
        with self._lock:
            self._windows.clear()


#: The process's memory, used by every :class:`AdaptiveLimit` that has a name.
MEMORY = WindowMemory()


@dataclass(frozen=True)
class Ticket:
    """One request's slot: the round (cuts so far) it started in."""

    round: int


class AdaptiveLimit:
    """An asyncio semaphore whose size follows the store's throttling answers (AIMD)."""

    def __init__(
        self,
        maximum: int,
        *,
        minimum: int = 1,
        name: str = "",
        adaptive: bool = True,
        memory: WindowMemory | None = MEMORY,
    ) -> None:
        """``name``: the store's URL, for logs and ``memory`` (no name: nothing remembered).
        ``adaptive=False``: a plain semaphore of ``maximum`` slots (throttling is still retried)."""
        if not 1 <= minimum <= maximum:
            raise ValueError(f"bad window bounds: minimum={minimum}, maximum={maximum}")
        self.maximum = maximum
        self.minimum = minimum
        self.name = name
        self.adaptive = adaptive
        self._memory = memory if adaptive and name else None
        self.window = self._memory.start(name, maximum) if self._memory else float(maximum)
        self.lowest = self.limit  # the smallest the window has been (for tests and diagnostics)
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
        if outcome == "ok" and self.window < self.maximum:
            self.window = min(float(self.maximum), self.window + 1.0 / self.window)
            if self._memory:
                self._memory.update(self.name, self.window, self.maximum)
        elif outcome == "throttled" and ticket.round == self.cuts and self.adaptive:
            before = self.limit
            self.window = max(float(self.minimum), self.window / 2)
            self.cuts += 1
            self.lowest = min(self.lowest, self.limit)
            if self._memory:
                self._memory.update(self.name, self.window, self.maximum)
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
