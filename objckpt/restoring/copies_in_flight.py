"""A restore's host→device copies in flight, bounded so host memory follows the copies' pace.

``jax.device_put`` of a host array returns before its bytes reach an accelerator, and the
runtime holds the host array until they do. Were reads to land faster than the copies drain,
host buffers would pile up where the read window does not count them. :class:`CopiesInFlight`
counts the bytes of copies started and not known to be done; past its limit the thread that
started one waits for the oldest, so the reads slow to the copies' pace instead. On a TPU v5e
the copies kept up (an 8 GiB restore peaked alike with 64 MiB, 256 MiB or no limit), so this is
a bound, not a speed-up. On the CPU backend a leaf's buffer is its result: nothing is counted.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import jax

#: Host bytes whose copy to an accelerator may be in flight at once during a restore
#: (:class:`CopiesInFlight`): enough to keep the copies streaming, small against any state.
TRANSFER_WINDOW = 256 << 20


class CopiesInFlight:
    """Copies to an accelerator started and not yet seen done, at most ``limit`` bytes of them
    beyond the one just started: :meth:`started` waits for the oldest past that."""

    def __init__(self, limit: int, wait: Callable[[Any], Any] = jax.block_until_ready) -> None:
        self.limit, self._wait = limit, wait
        self._lock = threading.Lock()
        self._flight: collections.deque[tuple[Any, int]] = collections.deque()
        self._bytes = 0
        self.peak = 0  # most bytes seen in flight (tests and benchmarks read it)

    def started(self, arrays: Any, nbytes: int) -> None:
        """``arrays`` (any pytree of device arrays) were just put from ``nbytes`` of host memory."""
        with self._lock:
            self._flight.append((arrays, nbytes))
            self._bytes += nbytes
            self.peak = max(self.peak, self._bytes)
        while True:
            with self._lock:
                if self._bytes <= self.limit or not self._flight:
                    return
                oldest, size = self._flight.popleft()
            self._wait(oldest)  # outside the lock: other threads keep landing meanwhile
            with self._lock:
                self._bytes -= size
