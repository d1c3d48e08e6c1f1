"""Staging buffers for a save: a bounded pool, recycled from one blob to the next.

Why recycle: the first write to fresh pages (the kernel zeroing and mapping
them) costs about ten times the copy into them (docs/PERFORMANCE.md). A save that keeps only a few blobs' worth of buffers and reuses them pays the
first touch once per buffer instead of once per byte of the model, and holds
that much memory instead of a copy of the model.

The pool is shared by the thread that copies (``take``) and the I/O loop that
uploads (``give``). A buffer goes back to the pool only after an upload that
sent it once: an attempt abandoned on timeout may still be reading it inside
the store client, so such a buffer is left to the garbage collector instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from objckpt.transfer.buffers import host_buffer


class StagingPool:
    """At most ``limit`` bytes of equally sized staging buffers (at least one).

    Args:
        limit: bytes of buffers alive at once, free ones included.
        capacity: the size of every buffer (the largest blob of the save).
    """

    def __init__(self, limit: int, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self.max_buffers = max(1, limit // self.capacity)
        self.allocated = 0  # buffers made and not dropped
        self.reused = 0  # takes served by a recycled buffer
        self._free: list[np.ndarray] = []
        self._cond = threading.Condition()

    def take(self, abort: threading.Event, on_wait: Callable[[], None]) -> np.ndarray | None:
        """A whole buffer of ``capacity`` bytes, waiting while all are in use.

        ``on_wait`` is called once before waiting (the caller may release held
        uploads). Returns None if ``abort`` is set while waiting. A recycled
        buffer holds an earlier blob's bytes: the caller overwrites or zeroes what it sends.
        """
        with self._cond:
            if not self._free and self.allocated >= self.max_buffers:
                on_wait()
            while not self._free and self.allocated >= self.max_buffers:
                if abort.is_set():
                    return None
                self._cond.wait(0.1)
            if self._free:
                self.reused += 1
                return self._free.pop()
            self.allocated += 1
        return host_buffer(self.capacity)

    def give(self, buffer: np.ndarray, *, reusable: bool) -> None:
        """Hand back a buffer from :meth:`take`; ``reusable=False`` drops it (its slot frees up)."""
        with self._cond:
            if reusable:
                self._free.append(buffer)
            else:
                self.allocated -= 1
            self._cond.notify_all()
