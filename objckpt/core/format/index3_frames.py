"""Version 3 index frames: each frame's rows checked and read into columns, and a whole index
object read at once.

A reader holds the head (:mod:`objckpt.core.format.index3`, which pins each frame by its
checksum); here each frame it fetches is checked before it is decompressed (its checksums,
then to exactly its declared length: no zip bombs), every row is validated with numpy
(:mod:`objckpt.core.format.index3_bounds`: boxes inside their leaf, no box named twice, no
leaf covered past its elements, bytes inside their blob), and only the wanted rows become
rows of a :class:`~objckpt.core.format.rows.Rows` (:func:`add_frame`). See ``docs/FORMAT.md`` ("version 3"). No I/O.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection
from typing import Any, NamedTuple

import numpy as np

from objckpt.core.checksum import crc32c, sha256_hex
from objckpt.core.format.index import IndexDoc
from objckpt.core.format.index3 import ROW_FIXED, ROW_LENGTH, ROW_SHA, Head, Pinned, leaf_array, parse_head
from objckpt.core.format.index3_bounds import LeafTable, Tally, box_text, cover, distinct_boxes, repeated
from objckpt.core.format.rows import RowsBuilder
from objckpt.core.format.schema import Manifest
from objckpt.errors import FormatError


class Group(NamedTuple):
    """A frame's rows of one rank: their positions in the frame (``sel``), their boxes (starts
    then stops; None for rank 0), and the distinct (box, itemsize) pairs they name: ``distinct``
    (starts, stops, itemsize per pair; each named by some row) and each row's pair (``inverse``). Rows are checked, and
    boxes interned, per distinct pair: a layer stack's leaves repeat a few thousand boxes."""

    sel: np.ndarray
    box: np.ndarray | None
    distinct: np.ndarray
    inverse: np.ndarray


class FrameRows(NamedTuple):
    """A frame's checked rows of the wanted leaves, as columns, and their :class:`Group` per rank."""

    leaf: np.ndarray
    blob: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    crc: np.ndarray
    shas: np.ndarray | None
    groups: list[Group]


def add_frame(builder: RowsBuilder, base: int, rows: FrameRows) -> None:
    """A checked frame's wanted rows into ``builder`` (``base``: where its index object's blobs
    start in the builder's list, :meth:`RowsBuilder.add_blobs`): columns, no piece objects.
    A builder that keeps stored lengths (version 4) takes each row's."""
    for g in rows.groups:
        length = rows.length if builder.stored else None
        if len(g.sel) == len(rows.leaf):  # every row of the frame: its columns as they are
            builder.add(base, rows.leaf, g.distinct, g.inverse, rows.blob, rows.offset, rows.crc, rows.shas, length)
            continue
        shas = None if rows.shas is None else rows.shas[g.sel]
        columns = rows.leaf[g.sel], rows.blob[g.sel], rows.offset[g.sel], rows.crc[g.sel]
        builder.add(
            base, columns[0], g.distinct, g.inverse, *columns[1:], shas, None if length is None else length[g.sel]
        )


def check_frame(
    head: Head,
    k: int,
    body: bytes,
    table: LeafTable,
    doc_name: str,
    keep: Collection[int] | np.ndarray | None = None,
    tally: Tally | None = None,
) -> FrameRows:
    """Frame ``k`` checked (its checksums, its decompressed length, every row), with the rows of
    the leaves ``keep`` (None: all) picked out.

    Beyond each row on its own: no two rows of a leaf name one box, and the rows of each leaf
    cover no more than its elements; ``tally`` (its index object's, frames checked in order)
    carries a leaf's sum from frame to frame and takes this frame's. Each check is a few numpy
    passes over the frame, and the frame's inflated bytes are let go when it returns: what a
    crafted object makes a reader hold is bounded by what its leaves can hold.

    Raises:
        FormatError: naming the index object, the frame and what is wrong.
    """
    f = head.frames[k]
    where = f"frame {k} (bytes [{f.offset}, {f.offset + f.length}))"

    pinned = False  # set once the frame matched its checksums: from then on errors are Pinned

    def bad(what: str) -> FormatError:
        return (Pinned if pinned else FormatError)(f"{doc_name} {where}: {what}")

    if len(body) != f.length:
        raise bad(f"{len(body)} bytes were read, the head says {f.length}")
    if crc32c(body) != f.crc32c:
        raise bad("does not match its crc32c in the head")
    if f.sha256 is not None and sha256_hex(body) != f.sha256:
        raise bad("does not match its sha256 in the head (its crc32c does)")
    pinned = True
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(body, f.raw_length)
    except zlib.error as e:
        raise bad(f"not a zlib stream ({e})") from None
    if len(raw) != f.raw_length or not inflate.eof or inflate.unconsumed_tail or inflate.unused_data:
        raise bad(f"does not decompress to exactly {f.raw_length} bytes")
    n = f.rows
    delta = _unplanar(raw, 0, n, "<i4").astype(np.int64)
    blob = _unplanar(raw, 4 * n, n, "<u4")
    offset = _unplanar(raw, 8 * n, n, "<u8")
    crc = np.frombuffer(raw, "<u4", n, 16 * n).copy()  # a copy: nothing keeps ``raw`` alive
    if delta[0] != 0 or (delta[1:] < 0).any():
        raise bad(f"rows must be sorted by leaf (row {int(np.argmax(delta < 0))} goes back)")
    leaf = np.cumsum(delta) + f.first
    if leaf[-1] != f.last:
        raise bad(f"rows must run from leaf {f.first} to leaf {f.last}, not to {int(leaf[-1])}")
    rank = table.rank[leaf]
    if (rank < 0).any():
        raise bad(f"row {int(np.argmax(rank < 0))} names leaf {int(leaf[rank < 0][0])}, which has no stored data")
    width = 2 * rank
    digest = f.sha256 is not None
    uniform = int(rank[0]) if rank.min() == rank.max() else None  # one rank: rows as they lie
    count = n * 2 * uniform if uniform is not None else int(width.sum())
    stored = ROW_LENGTH * n if table.lengths else 0
    if ROW_FIXED * n + 8 * count + stored + (ROW_SHA * n if digest else 0) != f.raw_length:
        raise bad(f"{f.raw_length} bytes do not hold {n} rows of these leaves")
    if (blob >= len(head.keys)).any():
        raise bad(f"row {int(np.argmax(blob >= len(head.keys)))}: blob position not in 'blobs'")
    coords = _unplanar(raw, ROW_FIXED * n, count, "<i8")
    length = np.empty(n, dtype=np.int64)
    groups: list[Group] = []
    starts = None if uniform is not None else np.concatenate(([0], np.cumsum(width)[:-1]))
    for r in [uniform] if uniform is not None else np.unique(rank).tolist():
        sel = np.arange(n) if uniform is not None else np.flatnonzero(rank == r)
        grid = coords.reshape(n, 2 * r) if starts is None else coords[starts[sel][:, None] + np.arange(2 * r)]
        distinct, inverse, nbytes, outside = distinct_boxes(grid, table.kind[leaf[sel]], r, table)
        if outside is not None:
            row = int(sel[np.argmax(outside[inverse])])
            raise bad(f"row {row}: box outside leaf {int(leaf[row])}'s shape (or empty)")
        if nbytes is None:
            raise bad("a box of more than 2**62 bytes")
        twice = repeated(leaf[sel] - f.first, f.last - f.first + 1, inverse, len(distinct))
        if twice is not None:
            a, b = sel[twice[0]], sel[twice[1]]
            raise bad(
                f"rows {a} and {b} both name leaf {int(leaf[a])}'s box {box_text(distinct[inverse[twice[0]]], r)}"
            )
        length[sel] = nbytes[inverse]
        groups.append(Group(sel, grid if r else None, distinct, inverse))
    covered = length  # the raw bytes of each row's box: what it covers of its leaf
    if stored:
        length = _stored_lengths(_unplanar(raw, ROW_FIXED * n + 8 * count, n, "<u8"), covered, leaf, table, bad)
    size = np.asarray(head.sizes, dtype=np.int64)[blob]
    fits = offset <= size.astype(np.uint64)
    fits[fits] = offset[fits].astype(np.int64) + length[fits] <= size[fits]
    if not fits.all():
        row = int(np.argmax(~fits))
        raise bad(f"row {row}: bytes beyond blob {head.keys[int(blob[row])]!r}")
    cover(leaf, delta, covered, table, tally, bad)
    shas = None
    if digest:
        shas = np.frombuffer(raw, np.uint8, ROW_SHA * n, f.raw_length - ROW_SHA * n).reshape(n, ROW_SHA).copy()
    wanted = None
    if keep is not None:
        keep = leaf_array(keep)
        inside = np.searchsorted(keep, [f.first, f.last + 1])  # keep is sorted and distinct
        if inside[1] - inside[0] != f.last - f.first + 1:  # not every leaf of the frame is kept
            at = np.minimum(np.searchsorted(keep, leaf), max(len(keep) - 1, 0))
            wanted = keep[at] == leaf if len(keep) else np.zeros(n, dtype=bool)
    picked: list[Group] = []
    if wanted is not None and wanted.all():
        wanted = None
    for g in groups:
        if wanted is not None:
            mask = wanted[g.sel]
            named, inverse = np.unique(g.inverse[mask], return_inverse=True)  # the pairs kept rows name
            g = Group(g.sel[mask], None if g.box is None else g.box[mask], g.distinct[named], inverse.ravel())
        if len(g.sel):
            picked.append(g)
    return FrameRows(leaf, blob, offset, length, crc, shas, picked)


def _stored_lengths(stored: np.ndarray, nbytes: np.ndarray, leaf: np.ndarray, table: LeafTable, bad: Any) -> np.ndarray:
    """Version 4 rows' stored lengths (int64), checked: a raw leaf's row stores its box's bytes,
    a compressed leaf's at least one byte and at most what the codec can make of its box
    (:func:`objckpt.core.codecs.encoded_bound`)."""
    coded = table.coded[leaf]
    bound = nbytes + 4 * table.itemsize[leaf]
    ok = np.where(coded, (stored >= 1) & (stored <= bound.astype(np.uint64)), stored == nbytes.astype(np.uint64))
    if not ok.all():
        row = int(np.argmax(~ok))
        what = f"at most {int(bound[row])} (its codec's bound)" if coded[row] else f"{int(nbytes[row])} (dtype × box)"
        raise bad(f"row {row}: stored length {int(stored[row])} must be {what}")
    return stored.astype(np.int64)


def _unplanar(raw: bytes, offset: int, count: int, dtype: str) -> np.ndarray:
    """The ``count`` values of ``dtype`` stored byte-planar at ``raw[offset:]``."""
    width = np.dtype(dtype).itemsize
    planes = np.frombuffer(raw, np.uint8, count * width, offset).reshape(width, count)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(count)


def parse_index3(data: bytes, manifest: Manifest, process: int, *, leaves: Collection[int] | None = None) -> IndexDoc:
    """A whole version 3 index object (head and every frame) checked and read into pieces (what
    tests read). ``leaves``: keep only the rows of these.

    Raises:
        FormatError: naming the index object and the field or frame.
    """
    ref = manifest.indexes[process]
    doc_name = f"index object {ref.key}"
    if len(data) != ref.size:
        raise FormatError(f"{doc_name} is {len(data)} bytes, the manifest says {ref.size}")
    table = LeafTable(manifest)
    try:
        head = parse_head(data, manifest, process, table)
    except Pinned as e:
        raise FormatError(str(e)) from None
    tally, builder = Tally(), RowsBuilder(ref.sha256 is not None, stored=manifest.version >= 4)
    base = builder.add_blobs(head.keys)
    try:
        for k, f in enumerate(head.frames):
            body = data[f.offset : f.offset + f.length]
            add_frame(builder, base, check_frame(head, k, body, table, doc_name, leaves, tally))
    except Pinned as e:
        raise FormatError(str(e)) from None
    rows = builder.build()
    return IndexDoc(process, head.blobs, {i: list(rows.leaf(i)) for i in rows.bounds})
