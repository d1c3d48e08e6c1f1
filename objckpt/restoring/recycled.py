"""Host buffers for boxes bound for an accelerator, reused once their copy to the device has ended.

A box bound for an accelerator lives in host memory only from its first read until
``device_put`` has copied it to its devices. Fresh memory for each box costs twice. Reads'
threads allocate with numpy, from glibc arenas of their own, whose freed memory the next
box, landing on another thread, may not reuse: boxes fault fresh pages in, and freed ones stay
in the process's free lists (docs/PERFORMANCE.md measures both on a TPU host).

:class:`RecycledBuffers` keeps the memory itself instead. A box gets the smallest free
mapping it fits (one not much larger than it), or a fresh one whose pages the caller faults
in; the mapping comes back (:meth:`RecycledBuffers.give_back`) once the copy made from it
has ended (:class:`objckpt.restoring.copies_in_flight.CopiesInFlight` sees that), and is
kept for the next box while the free mappings stay under ``keep`` bytes. Host memory then
follows the boxes being read and copied, plus at most ``keep``; all of it goes with the restore.

Only for leaves whose devices are not the host's (:attr:`objckpt.restoring.leaf_plan.LeafPlan.recycles`):
on the CPU backend ``device_put`` may adopt the host buffer as the array itself, and a
buffer reused there would overwrite a restored leaf.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable

import numpy as np

from objckpt.restoring.copies_in_flight import TRANSFER_WINDOW
from objckpt.transfer.buffers import mapped_buffer

#: Free mappings kept for reuse, in bytes: the copies in flight turn over about this much.
KEEP_BYTES = TRANSFER_WINDOW
#: Boxes smaller than this take numpy's memory (the heap's small pages, mostly faulted in).
SMALLEST = 1 << 20
#: Fresh mappings are made in multiples of this, so boxes of nearly one size share them.
GRANULE = 1 << 20


class RecycledBuffers:
    """Mappings lent out as boxes' host buffers and taken back once their copies have ended.

    ``ended`` (no arguments) is called before a fresh mapping is made: it gives back the
    buffers of every copy that has ended meanwhile, so one of them may serve instead.
    ``mapped`` makes a mapping of n bytes (:func:`~objckpt.transfer.buffers.mapped_buffer`);
    a test passes its own to count them.
    """

    def __init__(
        self,
        keep: int = KEEP_BYTES,
        *,
        ended: Callable[[], object] = lambda: None,
        mapped: Callable[[int], np.ndarray] = mapped_buffer,
    ) -> None:
        self.keep = keep
        self._ended = ended
        self._mapped = mapped
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []  # mappings not lent, smallest first
        self._free_bytes = 0
        self._lent: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(buffer) → (buffer, its mapping)
        self.made = 0  # fresh mappings (tests and benchmarks read these)
        self.reused = 0
        self.held = 0  # bytes of every mapping lent or free
        self.held_peak = 0

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray | None]:
        """A buffer of ``shape`` and ``dtype`` to land one box in, and the fresh mapping under it
        whose pages the caller faults in (None when the mapping is a reused one, or the box is
        small enough for numpy's memory: those are not lent and never come back)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < SMALLEST:
            return np.empty(shape, dtype), None
        mapping = self._reusable(nbytes)
        if mapping is None:
            self._ended()  # copies that have ended since give their mappings back
            mapping = self._reusable(nbytes)
        fresh = None
        if mapping is None:
            fresh = mapping = self._mapped(-(-nbytes // GRANULE) * GRANULE)
        buffer = mapping[:nbytes].view(dtype).reshape(shape)
        with self._lock:
            self._lent[id(buffer)] = (buffer, mapping)
            if fresh is not None:
                self.made += 1
                self.held += mapping.nbytes
                self.held_peak = max(self.held_peak, self.held)
            else:
                self.reused += 1
        return buffer, fresh

    def _reusable(self, nbytes: int) -> np.ndarray | None:
        """The smallest free mapping of at least ``nbytes``, taken off the free list, unless it
        is over twice that (a large mapping stays free for a large box)."""
        with self._lock:
            at = bisect.bisect_left([m.nbytes for m in self._free], nbytes)
            if at == len(self._free) or self._free[at].nbytes > 2 * nbytes + GRANULE:
                return None
            mapping = self._free.pop(at)
            self._free_bytes -= mapping.nbytes
            return mapping

    def give_back(self, buffers: Iterable[np.ndarray]) -> None:
        """Take back buffers :meth:`take` lent, whose copies to their devices have ended
        (others are ignored: a response's bytes landed as they were, a small box's numpy array).
        Each mapping is kept for the next box while the free ones stay under ``keep``
        bytes, else let go, its memory returned to the system."""
        with self._lock:
            for buffer in buffers:
                lent = self._lent.pop(id(buffer), None)
                if lent is None:
                    continue
                mapping = lent[1]
                if self._free_bytes + mapping.nbytes <= self.keep:
                    at = bisect.bisect_left([m.nbytes for m in self._free], mapping.nbytes)
                    self._free.insert(at, mapping)
                    self._free_bytes += mapping.nbytes
                else:
                    self.held -= mapping.nbytes

    @property
    def lent(self) -> int:
        """How many buffers are lent and not yet given back."""
        with self._lock:
            return len(self._lent)
