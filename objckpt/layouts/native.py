"""objckpt's own layout (format versions 1, 2 and 3), read as a :class:`NativeCheckpoint`.

The root manifest says the version. Version 1 holds every piece in the root;
version 2 lists one index object per saving process, read on demand: a restore
reads those of the processes that wrote the boxes it needs
(:meth:`NativeCheckpoint.read_needed`), the tools that look at a whole
checkpoint (``verify``, ``cp``, ``gc``) read them all
(:meth:`NativeCheckpoint.read_whole`). Version 3 lists them too; a restore reads
of each only its head and the frames of the leaves it needs
(:mod:`objckpt.layouts.index3_io`). Which reads a version needs is decided
here and in :mod:`objckpt.layouts.manifest_io`, nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from objckpt.core.format import LeafEntry, Manifest
from objckpt.core.format.v2 import leaves_by_writer
from objckpt.layouts.base import CheckpointInfo, LeafInfo
from objckpt.layouts.manifest_io import read_every_piece, read_indexes, read_manifest
from objckpt.storage import Store

if TYPE_CHECKING:
    from objckpt.core.boxes import Box  # JAX: never imported at run time here (objckpt ls/rm run without it)

FORMAT = "objckpt"


class NativeCheckpoint:
    """An objckpt checkpoint opened at ``store``: its manifest, and the pieces read so far.

    The reader keeps the manifest it has read up to now: a method that reads index
    objects returns the manifest with their pieces, and later calls build on it.

    ``holds_process``: None for a whole checkpoint; for a copy of one process's part (a
    local-tier step, :mod:`objckpt.layouts.process_copy`), that process: its pieces cover
    only what that process saved, and a box they do not cover is missing from the copy,
    not a malformed checkpoint.
    """

    format = FORMAT

    def __init__(self, store: Store, manifest: Manifest, *, size_limit: int, holds_process: int | None = None) -> None:
        self.store = store
        self._manifest = manifest
        self._size_limit = size_limit
        self.holds_process = holds_process

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def version(self) -> int:
        return self._manifest.version

    @property
    def manifest(self) -> Manifest:
        """The manifest with the pieces read so far (all of them for version 1)."""
        return self._manifest

    @property
    def pieces_on_demand(self) -> bool:
        """The root lists index objects whose pieces are read when needed (version 2), rather
        than every piece (version 1): a restore reads the ones it needs and checks they cover it."""
        return bool(self._manifest.indexes)

    def info(self) -> CheckpointInfo:
        return info_from_manifest(self.url, self._manifest)

    async def read_needed(self, boxes: Mapping[int, Iterable[Box]]) -> Manifest:
        """The manifest with the pieces that cover ``boxes`` (global boxes by leaf index).

        Version 2: reads the index objects of the processes that wrote those boxes,
        keeping only the rows of those leaves (the layout's arithmetic names them:
        :func:`objckpt.core.format.v2.leaves_by_writer`). Version 1: nothing to read.
        Every version's pieces come back as rows (:meth:`Manifest.in_columns`): what a restore plans from.
        """
        if not self._manifest.indexes:
            self._manifest = self._manifest.in_columns()
            return self._manifest
        leaves = leaves_by_writer(self._manifest, boxes)
        self._manifest = await read_indexes(
            self.store, self._manifest, leaves, size_limit=self._size_limit, leaves=leaves, columnar=True
        )
        return self._manifest

    async def read_every_index(self) -> Manifest:
        """The manifest with every index object's pieces, read afresh from the root
        (for a restore whose chosen index objects did not cover a box)."""
        root = dataclasses.replace(
            self._manifest, leaves=_without_pieces(self._manifest.leaves), blobs=(), loaded=frozenset()
        )
        every = range(len(root.indexes))
        self._manifest = await read_indexes(self.store, root, every, size_limit=self._size_limit, columnar=True)
        return self._manifest

    async def read_whole(self) -> Manifest:
        """The manifest with every piece and blob, checked to tile each leaf exactly
        (what ``verify``, ``cp`` and ``gc`` read)."""
        self._manifest = await read_every_piece(self.store, self._manifest, size_limit=self._size_limit)
        return self._manifest


async def open_native(store: Store, *, size_limit: int) -> NativeCheckpoint:
    """The objckpt checkpoint at ``store`` (its root manifest read and validated).

    Raises:
        CheckpointNotFoundError: no manifest.
        FormatError: the manifest is malformed or too large.
    """
    return NativeCheckpoint(store, await read_manifest(store, size_limit=size_limit), size_limit=size_limit)


def leaf_info(entry: LeafEntry) -> LeafInfo:
    """What ``inspect`` shows of one saved leaf."""
    value = [ref["length"] for ref in entry.value] if entry.kind == "per_process" else entry.value
    return LeafInfo(entry.path, entry.kind, entry.shape, entry.dtype, entry.nbytes, entry.sharding, value, entry.codec)


def info_from_manifest(url: str, manifest: Manifest) -> CheckpointInfo:
    """``inspect``'s description of an objckpt checkpoint, from its root manifest alone."""
    from objckpt.core.tree import build  # imports JAX: here, so that importing this module does not

    infos = [leaf_info(e) for e in manifest.leaves]
    return CheckpointInfo(
        url=url,
        tree=build(manifest.tree, lambda i: infos[i]),
        leaves={i.path: i for i in infos},
        total_bytes=manifest.total_bytes,
        num_blobs=manifest.num_blobs,
        format_version=manifest.version,
        created=manifest.created,
        save_id=manifest.save_id,
        num_processes=manifest.num_processes,
        metadata=manifest.metadata,
        format=FORMAT,
        stored_bytes=sum(r.blob_bytes for r in manifest.indexes)
        if manifest.version >= 2
        else sum(b.size for b in manifest.blobs),
    )


def _without_pieces(leaves: tuple[LeafEntry, ...]) -> tuple[LeafEntry, ...]:
    return tuple(dataclasses.replace(leaf, pieces=()) for leaf in leaves)
