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
from collections.abc import Callable, Sequence
from typing import Any

import jax

#: Host bytes whose copy to an accelerator may be in flight at once during a restore
#: (:class:`CopiesInFlight`): enough to keep the copies streaming, small against any state.
TRANSFER_WINDOW = 256 << 20


class CopiesInFlight:
    """Copies to an accelerator started and not yet seen done, at most ``limit`` bytes of them
    beyond the one just started: :meth:`started` waits for the oldest past that.

    Each copy may name the host buffers it was made from; once the copy is seen done (waited
    for, or found ready by ``ready``, which never blocks) they go to ``done``, which recycles
    them (:class:`objckpt.restoring.recycled.RecycledBuffers`).
    """

    def __init__(
        self,
        limit: int,
        wait: Callable[[Any], Any] = jax.block_until_ready,
        *,
        ready: Callable[[Any], bool] | None = None,
        done: Callable[[list[Any]], object] = lambda hosts: None,
    ) -> None:
        self.limit, self._wait, self._done = limit, wait, done
        self._ready = ready or copies_ended
        self._lock = threading.Lock()
        self._flight: collections.deque[tuple[Any, int, list[Any]]] = collections.deque()
        self._bytes = 0
        self.peak = 0  # most bytes seen in flight (tests and benchmarks read it)

    def started(self, arrays: Any, nbytes: int, hosts: Sequence[Any] = ()) -> None:
        """``arrays`` (any pytree of device arrays) were just put from ``nbytes`` of host memory
        (``hosts``: the buffers to hand to ``done`` once the copy has ended)."""
        with self._lock:
            self._flight.append((arrays, nbytes, list(hosts)))
            self._bytes += nbytes
            self.peak = max(self.peak, self._bytes)
        while True:
            with self._lock:
                if self._bytes <= self.limit or not self._flight:
                    break
                oldest, size, held = self._flight.popleft()
            self._wait(oldest)  # outside the lock: other threads keep landing meanwhile
            with self._lock:
                self._bytes -= size
            self._done(held)
        self.release_ended()

    def release_ended(self) -> None:
        """Hand ``done`` the buffers of the oldest copies that have ended by now, without waiting.

        Stops at the first copy with no buffers to hand back: nothing waits for those to be
        recycled, so the window alone retires them, in order.
        """
        while True:
            with self._lock:
                if not self._flight or not self._flight[0][2] or not self._ready(self._flight[0][0]):
                    return
                _, size, held = self._flight.popleft()
                self._bytes -= size
            self._done(held)


def copies_ended(arrays: Any) -> bool:
    """Whether every array of a pytree is ready, its copy to the device over (never blocks;
    an object that cannot say counts as not ready)."""
    for array in jax.tree.leaves(arrays):
        is_ready = getattr(array, "is_ready", None)
        if is_ready is None or not is_ready():
            return False
    return True
