"""Where a store's large responses start in memory, past a 64-byte boundary.

A read whose bytes land on a :data:`DEVICE_ALIGNMENT` boundary can become a
restored array without a copy. Where a response lands is the client's doing:
Python clients (fsspec) return ``bytes`` (:func:`bytes_phase`), native ones
(obstore) fill a ``malloc`` buffer (:func:`malloc_phase`). Each is probed once
per process, so a store can say where its responses start and restore can
start a read early so that its bytes land aligned.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

# XLA's CPU client adopts a host buffer without copying it when the buffer is
# aligned to this many bytes (less aligned ones are copied). On accelerators the
# transfer is a DMA either way.
DEVICE_ALIGNMENT = 64

# Larger than glibc's largest dynamic mmap threshold (32 MiB): a probe this size
# gets a fresh mapping, where large responses land, and not a chunk that memory
# freed earlier in the process's life left in the heap at another phase. Neither
# probe touches its pages: np.empty leaves them alone, and ``bytes`` of a size is
# a calloc, which takes a mapping's zeros.
_PROBE_BYTES = 64 << 20


@functools.cache
def bytes_phase() -> int:
    """Where a large new ``bytes`` object's data starts past a 64-byte boundary.

    Stores built on Python clients (fsspec) return responses as ``bytes``;
    knowing the phase lets restore start a read early so the bytes land aligned.
    """
    return _phase(bytes(_PROBE_BYTES))


@functools.cache
def malloc_phase() -> int:
    """Where a large ``malloc`` result starts past a 64-byte boundary (what native
    clients such as obstore get for their response buffers)."""
    return _phase(np.empty(_PROBE_BYTES, dtype=np.uint8))


def _phase(buffer: Any) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data) % DEVICE_ALIGNMENT
