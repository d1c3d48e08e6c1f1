"""crc32c of any buffer, hardware-accelerated.

The ``crc32c`` package takes any buffer (numpy arrays, memoryview slices)
without a copy and releases the GIL on large inputs; google-crc32c only takes
``bytes``, which would force a copy of every blob.
"""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c


def crc32c(data: Any, value: int = 0) -> int:
    """The CRC-32C (Castagnoli) of a bytes-like object, as an unsigned 32-bit int.

    ``value``: the CRC of the bytes before ``data``, to checksum a piece that
    arrives in consecutive parts.
    """
    return int(_crc32c.crc32c(data, value))


# CRC-32C's polynomial, bit-reflected (the bit order the checksum is computed in).
_POLY = 0x82F63B78


def _multiply(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial, both reflected (x^0 in the top bit)."""
    product = 0
    bit = 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _x_to_the_8n(n: int) -> int:
    """x^(8n) modulo the CRC polynomial: the effect of appending n zero bytes."""
    result = 1 << 31  # x^0
    square = 1 << 23  # x^8: one byte
    while n:
        if n & 1:
            result = _multiply(square, result)
        square = _multiply(square, square)
        n >>= 1
    return result


def crc32c_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32C of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``.

    Lets parts of one piece be checksummed on different threads, in any order,
    and checked against the piece's CRC once all have arrived (a few
    microseconds of arithmetic, no bytes touched again).
    """
    return _multiply(_x_to_the_8n(second_length), first) ^ second
