"""What a prefix holds in safetensors: its files and their checked headers (reads only headers).

A URL is read as safetensors when it names a ``.safetensors`` object, or a
directory (prefix) holding ``model.safetensors.index.json`` (Hugging Face's
sharded layout) or ``model.safetensors``. The index is held to its shape (a
``weight_map`` of tensor names to plain file names beside it) and every file's
header to the spec (:mod:`objckpt.safetensors.header`); the index must name
each tensor of each file once, and nothing else. A header costs one ranged
read of its file's first 64 KiB (a second one when it is longer), at most
:data:`~objckpt.safetensors.header.MAX_HEADER_BYTES`, and with an index at most
what the tensors the index gives its file can take. Headers are read
:data:`HEADERS_AT_ONCE` at a time, started as others end, each checked against
the index as it arrives; the first error cancels the rest, so an index naming a
million files costs a window of reads, not a million tasks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from objckpt.errors import FormatError, ObjectNotFoundError
from objckpt.safetensors.header import MAX_HEADER_BYTES, Header, TensorEntry, header_length, parse_header
from objckpt.safetensors.shards import INDEX_FILE, SINGLE_FILE
from objckpt.transfer.engine import first_error

#: Bytes read first from each file: the length and, usually, the whole header.
FIRST_READ = 64 * 1024
#: The largest index document read.
MAX_INDEX_BYTES = 64 * 2**20
#: Headers read at once.
HEADERS_AT_ONCE = 16
#: A header's bytes for each tensor the index gives its file, besides the name (JSON escapes
#: included): a rank-64 shape of 20-digit dimensions, the offsets, the dtype and whitespace.
HEADER_PER_TENSOR = 4096
#: A header's bytes besides its tensors: ``__metadata__`` and padding.
HEADER_SLACK = 1 << 20
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*\.safetensors$")


@dataclass(frozen=True)
class Tensors:
    """The safetensors files of one URL, their headers checked.

    Attributes:
        files: each file's key (relative to the store the files were read from) and header, in order.
        by_name: each tensor's entry (no other object per tensor: a header may list millions).
        sizes: each file's size.
        index: the index document's key, or None for a single file.
        digests: each file's header's SHA-256 (``verify`` sees a header unchanged without parsing it again).
        weight_map: the index's map of each tensor to its file (checked to be exactly the
            files' tensors), or None for a single file.
    """

    files: dict[str, Header]
    by_name: dict[str, TensorEntry]
    sizes: dict[str, int]
    index: str | None
    digests: dict[str, bytes]
    weight_map: dict[str, str] | None

    def file_of(self, name: str) -> str:
        """The key of the file holding tensor ``name``."""
        return self.weight_map[name] if self.weight_map is not None else next(iter(self.files))


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
    try:  # one byte past the limit, never the whole object: an index may claim gigabytes
        raw = bytes(await store.get_range(INDEX_FILE, start=0, end=MAX_INDEX_BYTES + 1))
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
        raise FormatError(f"{where}: more than the index limit of {MAX_INDEX_BYTES} bytes")
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


async def read_header(store: Any, key: str, *, where: str, limit: int = MAX_HEADER_BYTES) -> tuple[bytes, int]:
    """One file's header (the JSON bytes, unchecked) and its size: a HEAD and a first ranged
    read at once (one round trip), then a second read only for a header longer than the
    first; a header longer than ``limit`` is refused from its first 8 bytes."""
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
    n = header_length(first, where=where, file_size=size, limit=limit)
    raw = first[8 : 8 + n]
    if len(raw) < n:
        raw += bytes(await store.get_range(key, start=len(first), end=8 + n))
    if len(raw) != n:
        raise FormatError(f"{where}: the header is {n} bytes, {len(raw)} were read (the file changed?)")
    return raw, size


async def each(items: list[str], fn: Callable[[str], Awaitable[None]], *, parallel: int) -> None:
    """``fn`` over ``items``, at most ``parallel`` at once, started as others end; the first
    error cancels the rest, waits for them and is raised."""
    source = iter(items)

    async def worker() -> None:
        for item in source:
            await fn(item)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(parallel, len(items))):
                group.create_task(worker())
    except BaseExceptionGroup as errors:  # callers expect the error itself, not a group
        raise first_error(errors) from None


async def read_tensors(store: Any, found: list[str] | tuple[str, dict[str, str]]) -> Tensors:
    """Every file's header (:data:`HEADERS_AT_ONCE` at a time), each checked against the index
    as it arrives and bounded by the tensors the index gives its file. ``found``: the index's
    key and ``weight_map``, or one file (a name is in one file of an index, and once in a file).

    Raises:
        FormatError: a header off the spec or over its bound, a tensor in two files, or an
            index that does not name exactly the files' tensors (the first difference named).
    """
    index, weight_map, keys = None, None, found if isinstance(found, list) else []
    bounds: dict[str, int] = {}  # each file's longest header the index allows
    if isinstance(found, tuple):
        index, weight_map = found
        for name, file in weight_map.items():  # HEADER_SLACK, and a tensor's room and escaped name
            bounds[file] = bounds.get(file, HEADER_SLACK) + HEADER_PER_TENSOR + 12 * len(name)
        keys = list(bounds)
    read: dict[str, tuple[Header, int, bytes]] = {}
    mapped = weight_map or {}

    async def one(key: str) -> None:
        where = f"{store.url}/{key}"
        limit = min(bounds.get(key, MAX_HEADER_BYTES), MAX_HEADER_BYTES)
        raw, size = await read_header(store, key, where=where, limit=limit)
        header = parse_header(raw, where=where, file_size=size)
        for t in header.tensors if index is not None else ():
            if mapped.get(t.name) != key:
                raise FormatError(
                    f"{where} holds tensor {t.name!r}, which {INDEX_FILE} maps to {mapped.get(t.name, 'no file')!r}"
                )
        read[key] = header, size, hashlib.sha256(raw).digest()

    await each(keys, one, parallel=HEADERS_AT_ONCE)
    files = {k: read[k][0] for k in keys}
    sizes = {k: read[k][1] for k in keys}
    digests = {k: read[k][2] for k in keys}
    by_name = {t.name: t for header in files.values() for t in header.tensors}  # no name in two: see above
    if weight_map is not None:
        missing = [name for name in weight_map if name not in by_name]
        if missing:
            raise FormatError(
                f"{store.url}/{INDEX_FILE} names tensor {missing[0]!r} in {weight_map[missing[0]]},"
                f" which does not hold it ({len(missing)} such tensor(s))"
            )
    return Tensors(files, by_name, sizes, index, digests, weight_map)
