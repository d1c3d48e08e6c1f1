"""Incremental saves (``save(url, tree, base=previous_url)``): pieces equal to the base's are referenced, not uploaded.

A piece of this save matches a piece of the base when the leaf path, dtype and box are the
same and the SHA-256 of its bytes, computed here, equals the one the base recorded
(``Options(digest="sha256")``, which a save with a base always uses, so that it can be a base
in turn). A matched piece becomes a row pointing into the blob that holds the base's bytes:
the base's own blob, or, when the base referenced it from an earlier checkpoint, that
checkpoint's blob (references never chain: a reader makes the same ranged reads it would for
a blob of its own). The root then lists those checkpoints in ``bases``
(:mod:`objckpt.core.format.bases`).

Which bases serve and which pieces are referenced (siblings under one parent prefix; raw
leaves only; a standalone copy's blobs of its own base uploaded again; a base that cannot
serve logged, costing uploads, never the save): docs/INCREMENTAL.md.

Why it is safe against deleters: the save writes its live-save marker into the base's prefix
too, before it reads the base's manifest, so ``rm``, retention and ``gc`` leave the base
alone while the save runs; the base keeps the blobs it references in earlier checkpoints
(reference counting across a root's committed manifests, :mod:`objckpt.roots.sweep`); and the
commit check HEADs every referenced blob before the index object is written, so a blob
deleted anyway (``rm --force``) stops the commit instead of leaving a step that cannot restore.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from objckpt.core.boxes import copy_piece_into, piece_bytes_of
from objckpt.core.checksum import sha256_hex
from objckpt.core.device_reads import host_copy
from objckpt.core.format import LeafEntry, Manifest
from objckpt.core.format.bases import Base, check_name, check_ref_key, is_ref, ref_key, split_ref
from objckpt.core.pieces import Piece
from objckpt.core.plan import OwnedPiece
from objckpt.errors import FormatError, IntegrityError
from objckpt.layouts.manifest_io import read_checkpoint
from objckpt.saving.upload import PieceRecord
from objckpt.storage.base import Store
from objckpt.transfer import runtime
from objckpt.transfer.handle import Handle
from objckpt.transfer.retries import parent_of

log = logging.getLogger("objckpt")

#: Leaf kinds whose pieces may be references (items' values stay in the save's own blobs).
_REFERABLE = ("array", "ndarray", "str", "bytes")
#: The base's pieces a save may reference, by (path, dtype, start, stop), each with its blob's size.
Candidates = dict[tuple[str, str, tuple[int, ...], tuple[int, ...]], tuple[Piece, int]]
#: Threads hashing pieces at once (bounded by the cores).
_HASH_THREADS = 8


@dataclass(frozen=True)
class Matched:
    """What a save with a base writes: the pieces it uploads, and the rows that reference a base."""

    upload: list[OwnedPiece]
    refs: list[PieceRecord] = field(default_factory=list)
    ref_blobs: dict[str, int] = field(default_factory=dict)  # reference key -> the blob's size
    bases: tuple[Base, ...] = ()  # every checkpoint a reference may lead to, by name


def base_name(url: str, base: str) -> str:
    """The base's name beside the checkpoint at ``url``.

    Raises:
        ValueError: ``base`` is not a sibling of ``url`` (another parent prefix), or is ``url``.
    """
    parent, _, own = url.rstrip("/").rpartition("/")
    base_parent, _, name = base.rstrip("/").rpartition("/")
    if not parent or base_parent != parent or not check_name(name) or name == own:
        raise ValueError(
            f"base {base!r} must be another checkpoint beside {url!r} (under the same parent prefix,"
            " as a manager root's steps are)"
        )
    return name


def base_store(store: Store, name: str) -> Store:
    """The store of the sibling checkpoint ``name``."""
    return parent_of(store).child(name)


async def read_base(store: Store, name: str, *, size_limit: int) -> Manifest:
    """The base's manifest with every piece (its root and every index object, checked as ``verify`` checks them)."""
    return await read_checkpoint(base_store(store, name), size_limit=size_limit)


def against_base(
    handle: Handle, owned: list[OwnedPiece], entries: list[LeafEntry], name: str, coded: frozenset[int]
) -> Matched:
    """:func:`match` against the base ``name``, read with ``handle``; ``coded``: this save's compressed leaves.

    A base that cannot serve is logged and costs uploads, never the save: one that does not read
    (an index object damaged) is no base at all; a blob of it that is gone (``rm --force``)
    leaves its pieces to be uploaded. The blobs are HEADed while the pieces are hashed.
    """
    try:
        base = runtime.run_sync(read_base(handle.store, name, size_limit=handle.options.manifest_size_limit))
    except (FormatError, IntegrityError, FileNotFoundError) as e:
        log.warning("objckpt incremental save: base %s cannot serve (%s); this save uploads every piece", name, e)
        return Matched(owned)

    candidates = _candidates(base, name)
    heads = runtime.submit(_missing(handle, {p.blob for p, _ in candidates.values()}))
    return match(owned, entries, candidates, base, name, coded=coded, missing=heads.result)


async def _missing(handle: Handle, keys: set[str]) -> set[str]:
    """Which of blobs ``keys`` are gone (a HEAD each, in the save's window)."""

    async def gone(key: str) -> str | None:
        try:
            await handle.engine.head(key)
        except FileNotFoundError:
            return key
        return None

    return {k for k in await asyncio.gather(*map(gone, keys)) if k is not None}


def _candidates(base: Manifest, name: str) -> Candidates:
    """The base's pieces a save may reference, by (path, dtype, start, stop): each with the reference
    key of its blob and that blob's size. Only raw leaves' pieces with a digest (a compressed
    piece's SHA-256 is of its stored bytes) in a blob whose file name the new root can name (a
    standalone copy keeps its base's blobs under that base's save id: those are uploaded again)."""
    known = dict(base.bases) | {name: base.save_id}
    sizes = {b.key: b.size for b in base.blobs}
    out = {}
    for leaf in base.leaves:
        if leaf.kind not in _REFERABLE or leaf.codec is not None:
            continue
        for bp in leaf.pieces:
            key = bp.blob if is_ref(bp.blob) else ref_key(name, bp.blob)
            if bp.sha256 is not None and check_ref_key(key, known):
                out[(leaf.path, str(leaf.dtype), tuple(bp.start), tuple(bp.stop))] = (
                    bp._replace(blob=key),
                    sizes.get(bp.blob, 0),
                )
    return out


def match(
    owned: list[OwnedPiece],
    entries: list[LeafEntry],
    candidates: Candidates,
    base: Manifest,
    name: str,
    *,
    coded: frozenset[int] = frozenset(),
    missing: Callable[[], set[str]] = set,
) -> Matched:
    """Split ``owned`` into pieces to upload and references to the base ``name`` (manifest ``base``).

    Hashes each piece of a raw leaf (not in ``coded``) that has one of ``candidates``; the others
    are uploaded without being hashed here. ``missing()``: the candidates' blobs that are gone.
    """
    if not candidates:
        log.warning(
            "objckpt incremental save: base %s has no piece this save can reference (SHA-256 digests of raw leaves)",
            name,
        )
    upload: list[tuple[int, OwnedPiece]] = []  # by position in ``owned``: the packing order stays
    refs: list[PieceRecord] = []
    ref_blobs: dict[str, int] = {}
    paired: list[tuple[int, OwnedPiece, Piece, int]] = []
    for at, piece in enumerate(owned):
        entry = entries[piece.leaf]
        hit = candidates.get((entry.path, str(entry.dtype), tuple(piece.start), tuple(piece.stop)))
        if entry.kind not in _REFERABLE or piece.leaf in coded or hit is None or hit[0].length != piece.nbytes:
            upload.append((at, piece))
        else:
            paired.append((at, piece, *hit))
    # hashlib lets go of the GIL: the pieces are hashed on every core, not one after another.
    with concurrent.futures.ThreadPoolExecutor(max(1, min(_HASH_THREADS, os.cpu_count() or 1))) as pool:
        digests = list(pool.map(lambda pair: sha256_hex(_bytes_of(pair[1])), paired))
    gone = missing()
    if gone:
        log.warning(
            "objckpt incremental save: base %s cannot serve blob %s (%d missing): their pieces are uploaded",
            name,
            min(gone),
            len(gone),
        )
    for (at, piece, old, blob_size), digest in zip(paired, digests):
        if digest != old.sha256 or old.blob in gone:  # uploaded, and its digest not computed twice
            upload.append((at, dataclasses.replace(piece, sha256=digest)))
            continue
        ref_blobs[old.blob] = max(ref_blobs.get(old.blob, 0), blob_size, old.offset + old.length)
        refs.append(
            (piece.leaf, Piece(piece.start, piece.stop, old.blob, old.offset, old.length, old.crc32c, old.sha256))
        )
    upload.sort(key=lambda pair: pair[0])
    used = {split_ref(k)[0] for k in ref_blobs}
    known = {b[0]: Base(*b) for b in base.bases}
    known[name] = Base(name, base.save_id)
    bases = tuple(known[n] for n in sorted(known))  # every process lists all; the root keeps those used
    log.info(
        "objckpt incremental save: %d of %d pieces (%d of %d bytes) reference %s",
        len(refs),
        len(owned),
        sum(p.length for _, p in refs),
        sum(p.nbytes for p in owned),
        ", ".join(sorted(used)) or "no base",
    )
    return Matched([p for _, p in upload], refs, ref_blobs, bases)


def _bytes_of(piece: OwnedPiece) -> memoryview:
    """The piece's bytes, contiguous (a copy only when they are not one run of its shard's host bytes)."""
    host, _ = host_copy(piece.source[0])
    data = piece_bytes_of(piece, host)
    if data is not None:
        return data
    out = np.empty(piece.shape, dtype=host.dtype)
    copy_piece_into(piece, out, host=host)
    return out.reshape(-1).view(np.uint8).data
