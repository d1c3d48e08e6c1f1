"""Host memory for array bytes: aligned buffers, plain-page mappings, faulting pages in,
and (when ``Options.tune_malloc`` asks) glibc's mmap threshold.

Nothing here changes process-wide state unless a caller asks: :func:`tune_malloc`
runs only for an operation whose options set ``tune_malloc``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import threading
from typing import Any

import numpy as np

from objckpt.storage.phase import DEVICE_ALIGNMENT

_M_MMAP_THRESHOLD = -3
_done = False
_lock = threading.Lock()


def tune_malloc(threshold: int = 1 << 20) -> bool:
    """Fix glibc's mmap threshold once per process; True if it was set.

    glibc serves large allocations with mmap but raises that threshold (up to
    32 MiB) each time such a block is freed; afterwards 8–32 MiB staging and
    response buffers come from the heap and, once freed, stay in the process's
    RSS. A fixed threshold (which also turns the dynamic adjustment off) hands
    them back. Process-wide, so only ``Options.tune_malloc`` calls it.
    """
    global _done
    with _lock:
        if _done:
            return False
        _done = True
        return _mallopt(_M_MMAP_THRESHOLD, threshold)


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim(0)``); False where
    there is no glibc.

    A save's host copies off an accelerator are allocated by the device runtime, whose 1–32 MiB
    blocks come from glibc's heaps once its mmap threshold has risen: freed, they stay in the
    process's RSS (measured on a TPU v5e: +3.3 GiB after a 4 GiB save committed, in a process
    that had restored before). Called once a save or a restore ends. It changes no setting,
    only returns memory nobody holds; it takes milliseconds.
    """
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)``; False where there is none (musl, macOS)."""
    try:
        # The symbols already loaded into this process, libc's among them: asking
        # ctypes.util.find_library instead runs ldconfig in a subprocess.
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(param, value))
    except (OSError, AttributeError):
        return False


# Buffers this large get their own anonymous mapping (page-aligned, zero-filled).
_MAPPED_MIN = 1 << 20
# Private, not ``mmap``'s default shared: a shared anonymous mapping is backed by
# shmem, whose page faults and teardown cost more.
_PRIVATE: dict[str, int] = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}


def host_buffer(nbytes: int, *, zeroed: bool = True) -> np.ndarray:
    """A 64-byte aligned uint8 buffer for array bytes (staging or restored), zero-filled
    unless ``zeroed`` is False.

    Large ones are anonymous mappings of plain pages rather than numpy's own
    allocation, which asks for transparent huge pages on anything over 4 MiB,
    whose first touch can stall on compaction; that first touch is exactly what
    a save or restore does. Freed with the
    last array that views it. A mapping is zero-filled for free; a small buffer
    from the heap is not (``calloc`` clears it, writing every byte once more),
    hence ``zeroed=False`` for a buffer whose every byte is about to be written.
    """
    if nbytes >= _MAPPED_MIN:
        return np.frombuffer(mmap.mmap(-1, nbytes, **_PRIVATE), dtype=np.uint8)
    raw = (np.zeros if zeroed else np.empty)(nbytes + DEVICE_ALIGNMENT, dtype=np.uint8)
    offset = -raw.ctypes.data % DEVICE_ALIGNMENT
    return raw[offset : offset + nbytes]


def aligned_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-filled C-contiguous array on a :data:`DEVICE_ALIGNMENT` boundary (see :func:`host_buffer`).

    Restore fills these and hands them to ``jax.device_put``; on the CPU backend
    an aligned buffer becomes the device array itself, which saves a copy of
    every restored byte.
    """
    dtype = np.dtype(dtype)
    return host_buffer(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)


def aligned_offsets(shapes: list[tuple[int, ...]], dtype: np.dtype) -> tuple[list[int], int]:
    """Where each array of :func:`aligned_arrays` starts in its buffer, and the buffer's size."""
    itemsize = np.dtype(dtype).itemsize
    offsets = [0]
    for shape in shapes:
        offsets.append(offsets[-1] + -(-math.prod(shape) * itemsize // DEVICE_ALIGNMENT) * DEVICE_ALIGNMENT)
    return offsets[:-1], offsets[-1]


def aligned_arrays(shapes: list[tuple[int, ...]], dtype: np.dtype, *, zeroed: bool = True) -> list[np.ndarray]:
    """Several C-contiguous arrays cut from one buffer, each on a :data:`DEVICE_ALIGNMENT` boundary.

    For the boxes of one small leaf: one allocation instead of one per box (a
    small model restored onto another sharding has thousands of small boxes).
    The buffer lives as long as
    any of the arrays (or the device arrays that alias them) does.
    """
    dtype = np.dtype(dtype)
    offsets, total = aligned_offsets(shapes, dtype)
    buffer = host_buffer(total, zeroed=zeroed)
    return [
        buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
        for shape, offset in zip(shapes, offsets)
    ]


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
#: Bytes faulted in per step: one numpy fill of :func:`touch_pages`, one ``madvise`` call of :func:`fault_in`.
_TOUCH_STEP = 4 << 20


def mapped_buffer(nbytes: int) -> np.ndarray:
    """A fresh private anonymous mapping (at least one byte), no page of it faulted in yet.

    Not ``MAP_POPULATE``: Python's ``mmap`` holds the GIL through the call, so
    a thread mapping memory that way blocks every other thread meanwhile.
    Pages go in afterwards, by :func:`touch_pages` or :func:`fault_in`.
    """
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1), **_PRIVATE), dtype=np.uint8)


def touch_pages(buffer: np.ndarray) -> None:
    """Fault in a fresh mapping's pages by writing a zero to each, 4 MiB at a time.

    For memory made on a thread while others start up, where :func:`fault_in`
    would cost more than it saves: ``madvise`` holds the process's mmap lock
    for reading while it works, and a thread that maps memory (a new thread's
    stack, a new arena of Python's allocator, a growing heap) waits for that
    lock, whereas a page fault takes only its own mapping's lock (Linux 6.4+).
    ``madvise`` costs fewer CPU-s per page, so it stays for buffers made mid-restore.
    """
    for at in range(0, buffer.nbytes, _TOUCH_STEP):
        buffer[at : at + _TOUCH_STEP : mmap.PAGESIZE] = 0


def fault_in(buffer: np.ndarray) -> bool:
    """Fault in every page of a fresh mapped buffer before it is written; False where the
    kernel cannot (nothing done: the writes will fault the pages in instead).

    For the box buffers of large leaves that a restore onto another sharding
    copies into, made on the receiving thread when a box's first piece lands.
    ``madvise(MADV_POPULATE_WRITE)`` faults them in a loop in the kernel, with
    the GIL released, rather than one page fault per 4 KiB inside the scatter
    copies. It goes 4 MiB per call so that the mmap lock it holds for reading
    (see :func:`touch_pages`) keeps no other thread's allocation waiting long.
    A buffer under 1 MiB comes from the heap, mostly faulted in already: left alone.
    """
    if buffer.nbytes < _MAPPED_MIN:
        return False
    flat = buffer.reshape(-1).view(np.uint8)
    for at in range(0, flat.nbytes, _TOUCH_STEP):
        if not _populate(flat[at : at + _TOUCH_STEP]):
            return False
    return True


def _populate(buffer: np.ndarray) -> bool:
    madvise = _libc_madvise()
    if madvise is None:
        return False
    return bool(madvise(buffer.ctypes.data, buffer.nbytes, _MADV_POPULATE_WRITE) == 0)


@functools.cache
def _libc_madvise() -> Any:
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
