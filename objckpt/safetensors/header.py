"""The safetensors header: its dtypes, a strict parser and the writer.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of
UTF-8 JSON mapping each tensor's name to ``{"dtype", "shape", "data_offsets"}``
(plus an optional ``"__metadata__"`` of strings), then the byte buffer the
offsets point into, relative to its start. The parser holds a file to the spec
as strictly as the ``safetensors`` library does, since a header comes from
someone else's bucket: a bounded header size read before anything else, valid
UTF-8, one JSON object with no name twice, known dtypes, shapes whose element
count times the dtype's size is exactly the tensor's byte length (in Python
ints: no overflow) and that numpy can hold (:data:`MAX_ARRAY_BYTES`), and
offsets that tile the buffer in order from 0 to its end, with no overlap and no
hole. Anything else is a :class:`~objckpt.errors.FormatError` naming the file,
the tensor and the numbers.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from objckpt.core.dtypes import dtype_from_name
from objckpt.core.strict import is_int
from objckpt.errors import FormatError

#: safetensors dtype → objckpt's dtype name (:mod:`objckpt.core.dtypes`). Sub-byte dtypes
#: (safetensors packs F4/F6 two to a byte, numpy holds one per byte) are not in it.
ST_TO_DTYPE: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
}
DTYPE_TO_ST: dict[str, str] = {v: k for k, v in ST_TO_DTYPE.items()}

#: The largest header a reader accepts (the safetensors library's own bound: 100 MB).
MAX_HEADER_BYTES = 100_000_000
#: The most dimensions a tensor may have.
MAX_RANK = 64
#: What numpy can hold: a tensor's non-zero dimensions times its element size stay below this,
#: a zero-size tensor's too (``np.zeros((0, 2**62), np.float32)`` is a ``ValueError``).
MAX_ARRAY_BYTES = 2**63
#: The reserved name of the header's free-form string metadata.
METADATA_KEY = "__metadata__"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file.

    Attributes:
        name: its name in the header.
        dtype: objckpt's dtype name (``bfloat16``).
        shape: its shape.
        start: where its bytes start in the file (absolute, header included).
        end: where they end (exclusive).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """The tensor's length in bytes."""
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A parsed header: the tensors in file order, the metadata, where the buffer starts."""

    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str]
    data_start: int


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of one of :data:`ST_TO_DTYPE`'s values."""
    dtype = dtype_from_name(name)
    if dtype is None:  # pragma: no cover  (every value of the table is one of objckpt's dtypes)
        raise FormatError(f"dtype {name!r} is not available here")
    return dtype


def header_length(prefix: bytes, *, where: str, file_size: int, limit: int = MAX_HEADER_BYTES) -> int:
    """The header length ``N`` that the first 8 bytes of a file of ``file_size`` bytes announce.

    Raises:
        FormatError: the file is shorter than 8 bytes, or ``N`` exceeds ``limit`` or the file.
    """
    if file_size < 8 or len(prefix) < 8:
        raise FormatError(f"{where}: {file_size} bytes is too short for a safetensors file (8-byte header length)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > limit:
        why = "" if limit >= MAX_HEADER_BYTES else ", what the tensors the index gives this file can take"
        raise FormatError(f"{where}: header length {n} bytes exceeds the limit of {limit} bytes{why}")
    if 8 + n > file_size:
        raise FormatError(f"{where}: header length {n} bytes runs past the end of the file ({file_size} bytes)")
    if n < 2:
        raise FormatError(f"{where}: header length {n} bytes cannot hold a JSON object")
    return n


def parse_header(raw: bytes, *, where: str, file_size: int) -> Header:
    """Parse and check the header ``raw`` (the ``N`` bytes after the length) of a file of ``file_size`` bytes.

    Raises:
        FormatError: anything off the spec, naming ``where`` (the file) and the tensor.
    """
    data_start = 8 + len(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{where}: header is not UTF-8 (byte {e.start} of the header)") from None
    if not text.startswith("{"):
        raise FormatError(f"{where}: header does not start with '{{' (a JSON object)")
    try:
        doc = json.loads(text, object_pairs_hook=_objects(where), parse_constant=_no_constant(where))
    except FormatError:
        raise
    except (ValueError, RecursionError) as e:  # JSON errors, ints too long to convert, nesting
        raise FormatError(f"{where}: header is not valid JSON ({_short(e)})") from None
    if not isinstance(doc, dict):  # three names, dtype, shape and data_offsets, not mapped to objects
        raise FormatError(f"{where}: header is not a JSON object of tensors")
    metadata = _metadata(doc.pop(METADATA_KEY, None), where)
    tensors = sorted((_entry(name, value, where, data_start) for name, value in doc.items()), key=_order)
    position, prev = data_start, None
    for t in tensors:
        if t.start < position and prev is not None:
            raise FormatError(
                f"{where}: tensor {t.name!r} bytes [{t.start - data_start}, {t.end - data_start}) overlap"
                f" tensor {prev.name!r} [{prev.start - data_start}, {prev.end - data_start})"
            )
        if t.start > position:
            raise FormatError(
                f"{where}: a hole in the byte buffer at [{position - data_start}, {t.start - data_start})"
                f" before tensor {t.name!r}"
            )
        position, prev = t.end, t
    if position > file_size:
        last = tensors[-1]
        raise FormatError(
            f"{where}: tensor {last.name!r} data_offsets end at {last.end - data_start}, past the end of the"
            f" byte buffer ({file_size - data_start} bytes)"
        )
    if position < file_size:
        raise FormatError(
            f"{where}: {file_size - position} bytes after the last tensor's data (the byte buffer holds"
            f" {file_size - data_start} bytes, the offsets cover {position - data_start})"
        )
    return Header(tuple(tensors), metadata, data_start)


def _order(t: TensorEntry) -> tuple[int, int, str]:
    return (t.start, t.end, t.name)


#: The keys of a tensor's entry, in the order the ``safetensors`` library writes them.
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


def _objects(where: str) -> Any:
    """The parser's hook for each JSON object: a tensor's entry of the right shape becomes the
    flat tuple ``(dtype, shape, begin, end)`` (JSON makes no tuples, so nothing else is one),
    which the collector stops tracking at its first pass, instead of a dict and two lists that
    it walks at every full collection while the header is parsed (millions of them in a large
    header); any other object becomes a dict with no name twice."""

    def hook(pairs: list[tuple[str, Any]]) -> Any:
        if len(pairs) == 3:
            (k0, st_dtype), (k1, shape), (k2, offsets) = pairs
            if (k0, k1, k2) != _ENTRY_KEYS:  # another order of the keys
                entry = dict(pairs)
                st_dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
                k0 = "dtype" if len(entry) == 3 else ""  # else a name twice, refused below
            if k0 and type(st_dtype) is str and type(shape) is list and type(offsets) is list and len(offsets) == 2:
                return (st_dtype, tuple(shape), offsets[0], offsets[1])
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            twice = next(key for key, _ in pairs if key in seen or seen.add(key))  # type: ignore[func-returns-value]
            raise FormatError(f"{where}: header names {twice!r} twice")
        return out

    return hook


def _no_constant(where: str) -> Any:
    def refuse(name: str) -> None:
        raise FormatError(f"{where}: header holds {name}, which is not JSON")

    return refuse


def _short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _metadata(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise FormatError(f"{where}: {METADATA_KEY} must map strings to strings")
    return value


@functools.cache
def _itemsizes() -> dict[str, int]:
    """Each safetensors dtype's element size in bytes."""
    return {st: numpy_dtype(name).itemsize for st, name in ST_TO_DTYPE.items()}


def _entry(name: str, value: Any, where: str, data_start: int) -> TensorEntry:
    if not name:
        raise FormatError(f"{where}: a tensor with an empty name")
    if type(value) is not tuple:  # an object that is no entry of the right shape (see _objects)
        return _refuse_entry(name, value, where)
    st_dtype, shape, begin, end = value
    itemsize = _itemsizes().get(st_dtype)
    if itemsize is None:
        return _refuse_entry(name, value, where)
    count = span = 1  # span: the non-zero dimensions' product, which numpy holds even when count is 0
    for n in shape:
        if type(n) is not int or n < 0:
            return _refuse_entry(name, value, where)
        count *= n
        span *= n or 1
    if type(begin) is not int or type(end) is not int or begin < 0 or end < begin or len(shape) > MAX_RANK:
        return _refuse_entry(name, value, where)
    if end - begin != count * itemsize:
        raise FormatError(
            f"{where}: tensor {name!r}: data_offsets [{begin}, {end}) hold {end - begin} bytes, but"
            f" {st_dtype}{list(shape)} needs {count * itemsize}"
        )
    if span * itemsize >= MAX_ARRAY_BYTES:
        raise FormatError(
            f"{where}: tensor {name!r}: shape {list(shape)} is larger than an array can be (its non-zero"
            f" dimensions times {itemsize} bytes reach 2^63)"
        )
    return TensorEntry(name, ST_TO_DTYPE[st_dtype], shape, data_start + begin, data_start + end)


def _refuse_entry(name: str, value: Any, where: str) -> TensorEntry:
    """The error for an entry the fast checks of :func:`_entry` refused, saying which rule it breaks."""
    what = f"{where}: tensor {name!r}"
    if type(value) is tuple:
        value = {"dtype": value[0], "shape": list(value[1]), "data_offsets": list(value[2:])}
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data_offsets"}:
        keys = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise FormatError(f"{what}: needs exactly dtype, shape and data_offsets, has {keys}")
    st_dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(st_dtype, str) or st_dtype not in ST_TO_DTYPE:
        raise FormatError(f"{what}: dtype {st_dtype!r} is not one objckpt reads ({', '.join(ST_TO_DTYPE)})")
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(is_int(n) and n >= 0 for n in shape):
        raise FormatError(f"{what}: shape {_short(ValueError(repr(shape)))} is not a list of non-negative ints")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(n) and n >= 0 for n in offsets):
        raise FormatError(f"{what}: data_offsets {_short(ValueError(repr(offsets)))} is not [begin, end]")
    raise FormatError(f"{what}: data_offsets {offsets} end before they begin")


def encode_header(tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: Mapping[str, str]) -> bytes:
    """A header (the 8-byte length included) for tensors laid out in the given order, back to back.

    Args:
        tensors: (name, objckpt dtype name, shape, nbytes) in file order.
        metadata: the ``__metadata__`` strings.

    The JSON is padded with spaces to a multiple of 8 bytes, as the safetensors
    library writes it, so every tensor starts 8-byte aligned.
    """
    doc: dict[str, Any] = {METADATA_KEY: dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        doc[name] = {"dtype": DTYPE_TO_ST[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
