"""What a prefix holds in safetensors: its files and their checked headers (reads only headers).

A URL is read as safetensors when it names a ``.safetensors`` object, or a
directory (prefix) holding ``model.safetensors.index.json`` (Hugging Face's
sharded layout) or ``model.safetensors``. The index is held to its shape (a
``weight_map`` of tensor names to plain file names beside it) and every file's
header to the spec (:mod:`objckpt.safetensors.header`); the index must name
each tensor of each file once, and nothing else. A header costs one ranged
read of its file's first 64 KiB (a second one when it is longer), at most
:data:`~objckpt.safetensors.header.MAX_HEADER_BYTES`.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from objckpt.errors import FormatError, ObjectNotFoundError
from objckpt.safetensors.header import Header, TensorEntry, header_length, parse_header
from objckpt.safetensors.shards import INDEX_FILE, SINGLE_FILE

#: Bytes read first from each file: the length and, usually, the whole header.
FIRST_READ = 64 * 1024
#: The largest index document read.
MAX_INDEX_BYTES = 64 * 2**20
#: Headers read at once.
HEADERS_AT_ONCE = 16
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*\.safetensors$")


@dataclass(frozen=True)
class Tensors:
    """The safetensors files of one URL, their headers checked.

    Attributes:
        files: each file's key (relative to the store the files were read from) and header, in order.
        by_name: each tensor's file key and entry.
        sizes: each file's size.
        index: the index document's key, or None for a single file.
    """

    files: dict[str, Header]
    by_name: dict[str, tuple[str, TensorEntry]]
    sizes: dict[str, int]
    index: str | None


def split_file_url(url: str) -> tuple[str, str] | None:
    """``(directory URL, file name)`` for a URL naming a ``.safetensors`` object, else None."""
    head, sep, tail = url.rstrip("/").rpartition("/")
    if not sep or not tail.endswith(".safetensors") or not head or head.endswith(":/") or head.endswith(":"):
        return None
    return head, tail


async def find_files(store: Any, *, single: str | None = None) -> list[str] | tuple[str, dict[str, str]] | None:
    """The files at ``store``: ``[single]`` when asked for one, ``(index key, weight_map)`` for
    a sharded directory, ``[model.safetensors]``, or None when nothing of safetensors is there."""
    if single is not None:
        return [single]
    try:
        raw = await store.get(INDEX_FILE)
    except (ObjectNotFoundError, FileNotFoundError):
        raw = None
    if raw is not None:
        return INDEX_FILE, parse_index(raw, where=f"{store.url}/{INDEX_FILE}")
    try:
        await store.head(SINGLE_FILE)
    except (ObjectNotFoundError, FileNotFoundError):
        return None
    return [SINGLE_FILE]


def parse_index(raw: bytes, *, where: str) -> dict[str, str]:
    """The ``weight_map`` of ``model.safetensors.index.json``, checked.

    Raises:
        FormatError: too large, not UTF-8 JSON, no ``weight_map`` of names to plain
            ``.safetensors`` file names, or a ``metadata.total_size`` that is no integer.
    """
    if len(raw) > MAX_INDEX_BYTES:
        raise FormatError(f"{where}: {len(raw)} bytes exceeds the index limit of {MAX_INDEX_BYTES} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{where}: not a UTF-8 JSON document ({str(e)[:200]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise FormatError(f"{where}: no 'weight_map' object")
    total = (doc.get("metadata") or {}).get("total_size") if isinstance(doc.get("metadata"), dict) else None
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
        raise FormatError(f"{where}: metadata.total_size {total!r} is not a byte count")
    weight_map = doc["weight_map"]
    for name, file in weight_map.items():
        if not isinstance(file, str) or not _FILE_NAME.match(file):
            raise FormatError(f"{where}: tensor {name!r} maps to {file!r}, not a .safetensors file beside the index")
    return weight_map


async def read_header(store: Any, key: str, *, where: str) -> tuple[Header, int]:
    """One file's checked header and its size: a HEAD and a first ranged read at once (one
    round trip), then a second read only for a header longer than the first."""
    answers: tuple[Any, Any] = await asyncio.gather(
        store.head(key), store.get_range(key, start=0, end=FIRST_READ), return_exceptions=True
    )
    info, first_read = answers
    if isinstance(info, BaseException):
        raise info
    size = int(info.size)
    if isinstance(first_read, BaseException):
        if size >= 8:
            raise first_read
        first_read = b""  # a store may refuse a range of an empty or tiny file: too short either way
    first = bytes(first_read)[:size]
    n = header_length(first, where=where, file_size=size)
    raw = first[8 : 8 + n]
    if len(raw) < n:
        raw += bytes(await store.get_range(key, start=len(first), end=8 + n))
    if len(raw) != n:
        raise FormatError(f"{where}: the header is {n} bytes, {len(raw)} were read (the file changed?)")
    return parse_header(raw, where=where, file_size=size), size


async def read_tensors(store: Any, found: list[str] | tuple[str, dict[str, str]]) -> Tensors:
    """Every file's header (:data:`HEADERS_AT_ONCE` at a time), checked against the index.

    Raises:
        FormatError: a header off the spec, a tensor in two files, or an index that does not
            name exactly the files' tensors (the first difference named).
    """
    if isinstance(found, tuple):
        index, weight_map = found
        keys = list(dict.fromkeys(weight_map.values()))
    else:
        index, weight_map, keys = None, None, found
    limit = asyncio.Semaphore(HEADERS_AT_ONCE)

    async def one(key: str) -> tuple[Header, int]:
        async with limit:
            return await read_header(store, key, where=f"{store.url}/{key}")

    results = await asyncio.gather(*(one(k) for k in keys))
    files = {k: h for k, (h, _) in zip(keys, results, strict=True)}
    sizes = {k: s for k, (_, s) in zip(keys, results, strict=True)}
    by_name: dict[str, tuple[str, TensorEntry]] = {}
    for key, header in files.items():
        for t in header.tensors:
            if t.name in by_name:
                raise FormatError(f"tensor {t.name!r} is in both {store.url}/{by_name[t.name][0]} and {key}")
            by_name[t.name] = (key, t)
            if weight_map is not None and weight_map.get(t.name) != key:
                raise FormatError(
                    f"{store.url}/{key} holds tensor {t.name!r}, which {INDEX_FILE} maps to"
                    f" {weight_map.get(t.name, 'no file')!r}"
                )
    if weight_map is not None:
        missing = [name for name in weight_map if name not in by_name]
        if missing:
            raise FormatError(
                f"{store.url}/{INDEX_FILE} names tensor {missing[0]!r} in {weight_map[missing[0]]},"
                f" which does not hold it ({len(missing)} such tensor(s))"
            )
    return Tensors(files, by_name, sizes, index)
