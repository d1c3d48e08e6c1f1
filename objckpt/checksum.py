"""crc32c of any buffer, hardware-accelerated.

The ``crc32c`` package takes any buffer (numpy arrays, memoryview slices)
without a copy and releases the GIL on large inputs; google-crc32c only takes
``bytes``, which would force a copy of every blob.
"""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c


def crc32c(data: Any) -> int:
    """The CRC-32C (Castagnoli) of a bytes-like object, as an unsigned 32-bit int."""
    return int(_crc32c.crc32c(data))
