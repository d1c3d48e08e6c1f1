"""Memory for the small leaves a restore assembles, mapped and faulted in while it plans.

A restore onto another sharding copies every byte into target boxes that no
saved piece equals. For a small leaf (one buffer for all its boxes, see
:mod:`objckpt.restoring.landing`) a buffer made when the leaf's first piece lands takes
a page fault on each first write, inside the copy, on a thread holding the GIL.
A restore onto the same sharding pays those faults in the store client's own
threads (the response buffers become the arrays), off the GIL.

So, as soon as the leaves are known, :class:`AssemblyArena` maps memory for
every box of such leaves on a thread of its own, cuts the boxes' arrays from
it, and faults every page in by writing to it, while the main thread plans
the reads, the reads start, and the server prepares its first bytes; a leaf's
arrays are handed out once every page of their mapping is in (mappings go in
the leaves' order, so the first reads wait for the first mappings only).

Why writes and not ``madvise(MADV_POPULATE_WRITE)``, which costs fewer CPU-s
per page: it holds the process's mmap lock, and the restore's other threads
map memory just then (new threads' stacks, the allocator's first arenas).
Leaves are grouped into mappings of at most :data:`GROUP_BYTES`, so freeing
some restored leaves can free memory while others live on. Leaves whose boxes
all equal saved pieces are left out: their responses become the arrays. So
are leaves bound for an accelerator (:attr:`objckpt.restoring.leaf_plan.LeafPlan.on_host`).
The memory is what those leaves' buffers would hold anyway, only taken a
little earlier.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable

import numpy as np

from objckpt.core.boxes import Box
from objckpt.transfer.buffers import aligned_offsets, mapped_buffer, touch_pages

log = logging.getLogger("objckpt")

#: Largest mapping the arena makes (one leaf larger than this gets its own).
GROUP_BYTES = 64 << 20


class AssemblyArena:
    """Host arrays for the boxes of some leaves, cut from prefaulted mappings on a thread.

    ``leaves`` gives, per key, its boxes and dtype; the work starts at once,
    and :meth:`buffers` waits for it. The thread also makes the arrays
    themselves (thousands on a small model), which then cost the threads that
    copy into them only a dict lookup. ``group_bytes``, ``mapped`` (makes a
    mapping of n bytes) and ``touch`` (faults a mapping's pages in) default to
    :data:`GROUP_BYTES`, :func:`~objckpt.transfer.buffers.mapped_buffer` and
    :func:`~objckpt.transfer.buffers.touch_pages`.
    """

    def __init__(
        self,
        leaves: Iterable[tuple[int, list[Box], np.dtype]],
        *,
        group_bytes: int = GROUP_BYTES,
        mapped: Callable[[int], np.ndarray] = mapped_buffer,
        touch: Callable[[np.ndarray], object] = touch_pages,
    ) -> None:
        self._group_bytes = group_bytes
        self._mapped = mapped
        self._touch = touch
        self._leaves = list(leaves)
        self._buffers: dict[int, dict[Box, np.ndarray]] = {}
        self._ready = {key: threading.Event() for key, _, _ in self._leaves}  # per leaf: its mapping is in
        if self._leaves:
            threading.Thread(target=self._make, name="objckpt-prefault", daemon=True).start()

    def _make(self) -> None:
        try:
            groups: list[list[tuple[int, list[Box], list[tuple[int, ...]], np.dtype, list[int], int]]] = [[]]
            size = 0
            for key, boxes, dtype in self._leaves:
                shapes = [tuple(b - a for a, b in zip(*box)) for box in boxes]
                offsets, total = aligned_offsets(shapes, dtype)
                if groups[-1] and size + total > self._group_bytes:
                    groups.append([])
                    size = 0
                groups[-1].append((key, boxes, shapes, dtype, [size + o for o in offsets], total))
                size += total
            for group in groups:  # in the leaves' order, each handed out as soon as its pages are in
                memory = self._mapped(sum(leaf[-1] for leaf in group))
                made = {}
                for key, boxes, shapes, dtype, offsets, _ in group:
                    itemsize = np.dtype(dtype).itemsize
                    made[key] = {
                        box: memory[at : at + math.prod(shape) * itemsize].view(dtype).reshape(shape)
                        for box, shape, at in zip(boxes, shapes, offsets)
                    }
                self._touch(memory)  # nobody has these arrays yet: their events are set below
                self._buffers.update(made)
                for key in made:
                    self._ready[key].set()
        except (OSError, MemoryError, ValueError) as e:  # the leaves left get buffers of their own instead
            log.debug("objckpt: no prefaulted memory for some assembled leaves: %s", e)
        finally:
            self._leaves = []
            for event in self._ready.values():
                event.set()

    def buffers(self, key: int) -> dict[Box, np.ndarray] | None:
        """A leaf's arrays, box by box, once its mapping is made; None if it could not be.

        Waits for that leaf's mapping only, not the whole arena, so the first
        reads' threads start copying while later mappings are still being written.
        """
        event = self._ready.get(key)
        if event is not None:
            event.wait()
        return self._buffers.get(key)
