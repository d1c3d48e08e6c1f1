"""crc32c of any buffer, hardware-accelerated; the opt-in SHA-256 digest of a piece.

The ``crc32c`` package takes any buffer (numpy arrays, memoryview slices)
without a copy and releases the GIL on large inputs; google-crc32c only takes
``bytes``, which would force a copy of every blob.

CRC-32C catches accidents (bits flipped in flight or at rest), not forgery: it
is linear, so whoever can write a copy of a blob can change its bytes and keep
every crc32c. A checkpoint saved with ``Options(digest="sha256")`` also records
each piece's SHA-256 (``hashlib``, which releases the GIL too), and readers
check it wherever they check the crc32c.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable
from typing import Any

import crc32c as _crc32c

#: The digests ``Options.digest`` may name.
DIGESTS = ("sha256",)
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def crc32c(data: Any, value: int = 0) -> int:
    """The CRC-32C (Castagnoli) of a bytes-like object, as an unsigned 32-bit int.

    ``value``: the CRC of the bytes before ``data``, to checksum a piece that
    arrives in consecutive parts.
    """
    return int(_crc32c.crc32c(data, value))


def sha256_hex(data: Any) -> str:
    """The SHA-256 of a bytes-like object, as 64 lowercase hex digits."""
    return hashlib.sha256(data).hexdigest()


def is_sha256_hex(value: Any) -> bool:
    """Whether ``value`` is a SHA-256 as checkpoints write it: 64 lowercase hex digits."""
    return isinstance(value, str) and _SHA256_HEX.fullmatch(value) is not None


def damage(data: Any, crc: int, sha256: str | None) -> str | None:
    """What is wrong with a piece's bytes: None, ``"checksum"`` (its crc32c differs) or
    ``"sha256"`` (its crc32c matches, its SHA-256 does not: changed on purpose)."""
    if crc32c(data) != crc:
        return "checksum"
    if sha256 is not None and sha256_hex(data) != sha256:
        return "sha256"
    return None


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


@functools.lru_cache(maxsize=4096)
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
    microseconds of arithmetic, no bytes touched again). The operator for a
    length is cached: a checkpoint's pieces come in few lengths.
    """
    return _multiply(_x_to_the_8n(second_length), first) ^ second


_ZEROS = memoryview(bytes(1 << 16))


@functools.lru_cache(maxsize=4096)
def crc32c_of_zeros(n: int) -> int:
    """The CRC-32C of ``n`` zero bytes (a blob's gaps), without ``n`` bytes in memory."""
    if n <= len(_ZEROS):
        return crc32c(_ZEROS[:n])
    half = n // 2
    return crc32c_combine(crc32c_of_zeros(half), crc32c_of_zeros(n - half), n - half)


def blob_crc32c(pieces: Iterable[tuple[int, int, int]], size: int) -> int:
    """The CRC-32C of a whole blob from its pieces' CRCs: no byte read again.

    A blob is its pieces at their offsets and zeros everywhere else (spacers,
    alignment, the tail; :mod:`objckpt.core.plan`), so its CRC is the pieces'
    CRCs and the gaps' combined in offset order.

    Args:
        pieces: ``(offset, length, crc32c)`` of each piece, in any order.
        size: the blob's size in bytes.

    Raises:
        ValueError: pieces that overlap or reach past ``size`` (no such blob is written).
    """
    total, end = 0, 0
    for offset, length, crc in sorted(pieces):
        if offset < end or offset + length > size:
            raise ValueError(f"pieces overlap or pass the blob's end ({size} bytes) at offset {offset}")
        if offset > end:
            total = _shifted(total, offset - end) ^ crc32c_of_zeros(offset - end)
        total = _shifted(total, length) ^ crc
        end = offset + length
    if size > end:
        total = _shifted(total, size - end) ^ crc32c_of_zeros(size - end)
    return total


def _shifted(crc: int, n: int) -> int:
    """``crc`` followed by ``n`` bytes' worth of shift (``crc32c_combine(crc, 0, n)``), by table:
    a checkpoint's pieces and gaps come in few lengths, so each length's tables are built once."""
    t0, t1, t2, t3 = _shift_tables(n)
    return t0[crc & 0xFF] ^ t1[(crc >> 8) & 0xFF] ^ t2[(crc >> 16) & 0xFF] ^ t3[crc >> 24]


@functools.lru_cache(maxsize=1024)
def _shift_tables(n: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The shift by ``n`` bytes of each value of each byte of a CRC (the shift is linear in the CRC)."""
    x = _x_to_the_8n(n)
    tables = []
    for k in range(4):
        bits = [_multiply(x, 1 << (8 * k + bit)) for bit in range(8)]
        table = [0] * 256
        for v in range(1, 256):
            low = v & -v
            table[v] = table[v ^ low] ^ bits[low.bit_length() - 1]
        tables.append(table)
    return tables[0], tables[1], tables[2], tables[3]
