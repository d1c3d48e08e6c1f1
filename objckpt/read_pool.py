"""Recycled host buffers for the ranged reads restore copies out of, then frees.

Why: the first write to fresh pages is what such a read costs, not the bytes
on the wire. A restore onto another sharding copies every response into its
target boxes; with a new buffer per response, the kernel zeroes and maps a
page for every byte read, on top of the target arrays' own pages (perf, 1 GiB
resharded restore on this project's VM: as many page-clearing samples in the
response buffers as in the targets). Recycling a window's worth of buffers
touches those pages once. It needs a store that receives a body into a
caller's buffer (``Store.reads_into``); reads that become arrays do not come
here, they keep their buffers.

Used from the event loop thread only: a buffer is taken before its read and
given back after its bytes were checked and copied.
"""

from __future__ import annotations

import numpy as np

from objckpt._memory import host_buffer

_GRANULE = 1 << 20  # sizes round up to this, so reads of similar size share buffers


class ReadBufferPool:
    """Host buffers for copied reads: at most ``limit`` bytes, none kept that no read will need.

    ``take`` returns the smallest free buffer that fits, else a new one; buffers
    in use are bounded by the caller (restore's read window), so the pool holds
    at most the window plus one read. ``expected`` is how many bytes the takes
    will ask for in all: once the free buffers cover what is still to come, a
    returned buffer is dropped, so the pool shrinks as the restored arrays grow
    and does not add to the restore's peak at its end.
    """

    def __init__(self, limit: int, expected: int) -> None:
        self.limit = max(int(limit), 0)
        self.pending = int(expected)  # bytes still to be taken
        self.allocated = 0  # bytes of buffers made and not dropped
        self.reused = 0  # takes served by a free buffer
        self._free: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` bytes (its old contents are stale)."""
        self.pending -= nbytes
        fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
        if fits:
            self.reused += 1
            return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        size = -(-max(nbytes, 1) // _GRANULE) * _GRANULE
        self._free.sort(key=lambda b: b.nbytes)
        while self._free and self.allocated + size > self.limit:
            self.allocated -= self._free.pop(0).nbytes  # smallest first: they fit the fewest reads
        self.allocated += size
        return host_buffer(size)

    def give(self, buffer: np.ndarray) -> None:
        """Hand back a buffer from :meth:`take` once nothing reads or writes it."""
        if sum(b.nbytes for b in self._free) >= self.pending:
            self.allocated -= buffer.nbytes  # the free ones cover every read still to come
            return
        self._free.append(buffer)
