"""The piece codec of ``Options(compression="zstd")``: byte planes, then zstd (format version 4).

A float's bytes are not alike: the high byte of a bf16 weight (sign and exponent) carries
about 2.8 bits, its low byte (mantissa) nearly 8. zstd over the bytes as they lie sees them
interleaved and finds little (≈ 1.27× on bf16 weights); split into planes first (byte ``j``
of every value together: a byte shuffle by itemsize) the high plane shrinks near its
entropy and the mantissa planes are left as they are. So a piece is stored as its planes,
each a zstd frame when that saves at least 1/32 of the plane, else its bytes raw (zstd
spends time on a mantissa plane and gains nothing). See docs/FORMAT.md ("Compressed pieces").

Encoded piece of ``n`` values of ``z`` bytes: ``z`` little-endian u32 words, plane ``j``'s
stored length with bit 31 set when the plane is raw, then the planes in order. Decoding is
bounded: each plane must declare exactly ``n`` bytes of content before it is inflated, and
inflate to exactly that, so a hostile piece cannot make a reader hold more than its box.

The codec library is ``zstandard`` (the ``compression`` extra); no I/O here.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np

from objckpt.errors import FormatError

#: The codec name a version 4 leaf records (``"codec"``).
CODEC = "shuffle-zstd"
#: Compressed leaves are saved in pieces of at most this many raw bytes (docs/PERFORMANCE.md
#: "Compression" says why): a read that needs part of a saved shard fetches only the chunks
#: its box meets, and each chunk is one independent zstd job for a core.
CHUNK_BYTES = 1 << 20
_RAW = 1 << 31
_WORD = struct.Struct("<I")
#: A plane is stored raw unless zstd saves at least 1/32 of it.
_MIN_GAIN = 32

_local = threading.local()  # a compressor and decompressor per thread (neither is thread-safe)


def zstandard() -> Any:
    """The ``zstandard`` module, or an ImportError naming the extra that installs it."""
    try:
        import zstandard as zstd  # noqa: PLC0415 - optional dependency, imported on first use
    except ImportError:
        raise ImportError(
            'Options(compression="zstd") needs the zstandard package: pip install zstandard (objckpt[compression])'
        ) from None
    return zstd


def _compressor() -> Any:
    c = getattr(_local, "compressor", None)
    if c is None:
        zstd = zstandard()
        # Fast strategy with a tiny match table and long matches only: the planes worth
        # compressing (exponents) are low-entropy noise that the entropy coder shrinks and
        # matches barely do (docs/PERFORMANCE.md "Compression" compares it with level 1).
        params = zstd.ZstdCompressionParameters(
            window_log=17,
            hash_log=6,
            chain_log=6,
            search_log=1,
            min_match=7,
            target_length=0,
            strategy=zstd.STRATEGY_FAST,
            write_content_size=True,
            write_checksum=False,
        )
        c = _local.compressor = zstd.ZstdCompressor(compression_params=params)
    return c


def _decompressor() -> Any:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard().ZstdDecompressor()
    return d


def encoded_bound(nbytes: int, itemsize: int) -> int:
    """The most bytes :func:`encode` makes of ``nbytes`` raw bytes (a reader's check, a buffer's size)."""
    return nbytes + 4 * itemsize


def encode(raw: memoryview | np.ndarray, itemsize: int) -> bytes:
    """A piece's C-ordered bytes ``raw`` (values of ``itemsize`` bytes) encoded: planes, then zstd."""
    data = np.frombuffer(raw, dtype=np.uint8)
    n = len(data) // itemsize
    planes = _split(data, n, itemsize)
    compressor = _compressor()
    words: list[bytes | memoryview] = []
    bodies: list[bytes | memoryview] = []
    for plane in planes:
        body = compressor.compress(plane) if n else b""
        if n and len(body) <= n - n // _MIN_GAIN:
            words.append(_WORD.pack(len(body)))
            bodies.append(body)
        else:
            words.append(_WORD.pack(n | _RAW))
            bodies.append(memoryview(plane))
    return b"".join(words + bodies)


def decode(
    data: memoryview | bytes, itemsize: int, nbytes: int, where: str, out: np.ndarray | None = None
) -> np.ndarray:
    """An encoded piece back to its ``nbytes`` raw bytes (uint8), in bounded memory.

    ``where`` names the piece (leaf, blob, bytes) in the error. ``out``: a C-contiguous array of
    ``nbytes`` bytes to join the planes into (a restore passes the piece's place in its box, so
    the values are written once, into memory already faulted in); a new array by default.

    Raises:
        FormatError: the bytes are not an encoded piece of exactly ``nbytes`` bytes (a header
            or plane of the wrong size, a frame that declares or inflates to another size).
    """
    view = memoryview(data).cast("B")
    n, rest = divmod(nbytes, itemsize)
    head = 4 * itemsize
    if rest or len(view) < head:
        raise FormatError(f"{where}: compressed piece of {len(view)} bytes is too short for its header")
    planes: list[np.ndarray] = []
    at = head
    zstd = None
    for j in range(itemsize):
        (word,) = _WORD.unpack_from(view, 4 * j)
        size = word & ~_RAW
        body = view[at : at + size]
        if len(body) != size:
            raise FormatError(f"{where}: plane {j} of {size} bytes runs past the piece's {len(view)}")
        at += size
        if word & _RAW:
            if size != n:
                raise FormatError(f"{where}: raw plane {j} is {size} bytes, the box holds {n} values")
            planes.append(np.frombuffer(body, dtype=np.uint8))
            continue
        zstd = zstd or zstandard()
        try:
            declared = zstd.frame_content_size(body)
        except zstd.ZstdError as e:
            raise FormatError(f"{where}: plane {j} is not a zstd frame ({e})") from None
        if declared != n:
            raise FormatError(f"{where}: plane {j} declares {declared} bytes, the box holds {n} values")
        # zstd refuses a block that takes a frame past its declared size, so this holds at
        # most one block (128 KiB) more than ``n`` before it fails.
        inflate = _decompressor().decompressobj()
        try:
            plane = inflate.decompress(body)
        except zstd.ZstdError as e:
            raise FormatError(f"{where}: plane {j} does not inflate ({e})") from None
        if len(plane) != n or not inflate.eof or inflate.unused_data:
            raise FormatError(f"{where}: plane {j} does not inflate to exactly one frame of {n} bytes")
        planes.append(np.frombuffer(plane, dtype=np.uint8))
    if at != len(view):
        raise FormatError(f"{where}: {len(view) - at} bytes past the piece's last plane")
    return _join(planes, n, itemsize, np.empty(nbytes, np.uint8) if out is None else out.reshape(-1).view(np.uint8))


def _split(data: np.ndarray, n: int, itemsize: int) -> np.ndarray:
    """The byte planes of ``n`` little-endian values of ``itemsize`` bytes: row ``j`` holds byte
    ``j`` of each. For 2, 4 and 8 bytes by shifts of whole integers (4-5× faster than a strided
    transpose, measured), else by the transpose."""
    if itemsize not in (2, 4, 8):
        return np.ascontiguousarray(data.reshape(n, itemsize).T)
    kind = np.dtype(f"<u{itemsize}")
    values = data.view(kind)
    planes = np.empty((itemsize, n), dtype=np.uint8)
    for j in range(itemsize):
        np.copyto(planes[j], values >> kind.type(8 * j) if j else values, casting="unsafe")
    return planes


def _join(planes: list[np.ndarray], n: int, itemsize: int, out: np.ndarray) -> np.ndarray:
    """The ``n`` values' bytes joined from their planes into ``out`` (uint8; :func:`_split` undone).

    For 2, 4 and 8 bytes by shifts in place, highest plane first: no temporary array, whose
    fresh pages would cost more than the shifts (measured: 1.1 GB/CPU-s with temporaries, 5–10
    without).
    """
    if itemsize not in (2, 4, 8):
        for j, plane in enumerate(planes):
            out.reshape(n, itemsize)[:, j] = plane
        return out
    values = out.view(f"<u{itemsize}")
    np.copyto(values, planes[-1])
    for plane in reversed(planes[:-1]):
        values <<= np.uint8(8)
        values |= plane
    return out
