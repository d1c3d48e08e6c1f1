"""Reading one format version 3 index object in part: its head, then only the frames a reader needs.

The I/O half of :mod:`objckpt.core.format.index3` (which checks and decodes the
bytes): one ranged GET for the head (the root gives its length; a small object
is read whole in that one GET), then the frames that hold the wanted leaves, as
few ranged GETs as their positions allow. A read that fails its checks is read
again, up to :data:`MANIFEST_READS` reads, before it is a :class:`FormatError`
naming the object; bytes that matched their checksums and still fail a check (a
crafted object, not one changed in flight) are a :class:`FormatError` at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

import numpy as np

from objckpt.core.format import Manifest
from objckpt.core.format.index import IndexDoc
from objckpt.core.format.index3 import Head, Pinned, leaf_array, parse_head
from objckpt.core.format.index3_bounds import LeafTable, Tally, check_blob_bytes
from objckpt.core.format.index3_frames import add_frame, check_frame
from objckpt.core.format.rows import RowsBuilder
from objckpt.errors import FormatError
from objckpt.layouts.rereads import until_checked
from objckpt.storage import Store

#: An index object no larger than this is read whole with its head (one GET, not two).
WHOLE_BELOW = 64 << 10
#: Frames closer than this are read in one GET (the bytes between are read and dropped).
FRAME_GAP = 16 << 10
#: The largest GET of frames.
FRAME_READ = 8 << 20
_BYTES = ("blob", "offset", "length")


async def read_index3(
    store: Store,
    manifest: Manifest,
    process: int,
    table: LeafTable,
    *,
    size_limit: int,
    rows: RowsBuilder,
    leaves: Collection[int] | None = None,
) -> IndexDoc:
    """Process ``process``'s index object: its blobs (the document), and the pieces of ``leaves``
    (None: all) into ``rows`` as columns (added once every frame read has passed its checks, so a
    read that is retried adds nothing twice).

    The elements its rows cover are added to ``table``'s sums once every frame read has passed
    its checks (:meth:`LeafTable.merge`).

    Raises:
        FormatError: the object is missing, larger than ``size_limit``, or fails a check
            (head, a frame's checksum or size, a row) on every one of its reads; or its rows
            and those of the objects read before with ``table`` cover more of a leaf than it holds.
            Read whole (``leaves`` None): two of its rows share a byte of a blob.
    """
    ref = manifest.indexes[process]
    doc_name = f"index object {ref.key}"
    if ref.size > size_limit:
        raise FormatError(f"{doc_name} is {ref.size} bytes, over the limit of {size_limit}")

    async def attempt() -> tuple[IndexDoc, Tally] | Pinned:
        try:
            return await _read_once(store, manifest, process, table, leaves, doc_name, rows)
        except Pinned as e:  # bytes that matched their checksums: a re-read gives the same
            return e

    try:
        got = await until_checked(attempt, store)
    except FileNotFoundError:
        raise FormatError(
            f"index object {ref.key} (process {process}) listed in the manifest of {store.url} is missing"
        ) from None
    if isinstance(got, Pinned):
        raise FormatError(str(got)) from None
    doc, tally = got
    table.merge(tally, doc_name)
    return doc


async def _read_once(
    store: Store,
    manifest: Manifest,
    process: int,
    table: LeafTable,
    leaves: Collection[int] | None,
    doc_name: str,
    rows: RowsBuilder,
) -> tuple[IndexDoc, Tally]:
    ref = manifest.indexes[process]
    wanted = None if leaves is None else leaf_array(leaves)
    whole = ref.size <= WHOLE_BELOW
    first = await store.get_range(ref.key, start=0, end=ref.size + 1 if whole else ref.head)
    if len(first) > ref.size:  # one byte more than the root says tells a longer object
        raise FormatError(f"{doc_name} is longer than the {ref.size} bytes the manifest says")
    head = parse_head(first, manifest, process, table)
    picks = head.frames_for(wanted)
    tally = Tally()
    if not picks:
        return IndexDoc(process, head.blobs, {}), tally
    if whole:
        bodies = [first[head.frames[k].offset : head.frames[k].offset + head.frames[k].length] for k in picks]
    else:
        bodies = await _fetch_frames(store, ref.key, head, picks, doc_name)
    checked = [check_frame(head, k, body, table, doc_name, wanted, tally) for k, body in zip(picks, bodies)]
    if leaves is None:  # every row of the object: none shares a blob's byte with another
        try:
            check_blob_bytes(head.keys, *(np.concatenate([getattr(f, c) for f in checked]) for c in _BYTES))
        except FormatError as e:
            raise Pinned(f"{doc_name}: {e}") from None
    base = rows.add_blobs(head.keys)
    for frame in checked:
        add_frame(rows, base, frame)
    return IndexDoc(process, head.blobs, {}), tally


async def _fetch_frames(store: Store, key: str, head: Head, picks: list[int], doc_name: str) -> list[bytes]:
    """The bytes of frames ``picks`` (ascending), read as coalesced ranged GETs in parallel; the
    GET of the object's last frame asks one byte more, to tell an object longer than the root says."""
    runs: list[list[int]] = []
    for k in picks:
        f = head.frames[k]
        if runs:
            last = head.frames[runs[-1][-1]]
            begin = head.frames[runs[-1][0]].offset
            end = last.offset + last.length
            if f.offset - end <= FRAME_GAP and f.offset + f.length - begin <= FRAME_READ:
                runs[-1].append(k)
                continue
        runs.append([k])

    async def run(ks: list[int]) -> list[bytes]:
        begin = head.frames[ks[0]].offset
        end = head.frames[ks[-1]].offset + head.frames[ks[-1]].length
        tail = ks[-1] == len(head.frames) - 1
        data = await store.get_range(key, start=begin, end=end + tail)
        if len(data) > end - begin:
            raise FormatError(f"{doc_name} is longer than the {end} bytes the manifest says")
        return [data[head.frames[k].offset - begin : head.frames[k].offset - begin + head.frames[k].length] for k in ks]

    got = await asyncio.gather(*(run(ks) for ks in runs))
    return [body for part in got for body in part]
