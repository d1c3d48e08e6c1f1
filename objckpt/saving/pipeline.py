"""The one way a checkpoint is written: begin → upload → commit.

``save``/``save_async`` (:mod:`objckpt.saving.api`) and ``convert_orbax``
(:mod:`objckpt.orbax.convert`) plan their blobs differently (a tree's shards, or
slabs read from an Orbax checkpoint) and write them the same way:

1. :func:`check_destination`: the store takes create-if-absent writes and holds no
   committed checkpoint yet (the manifest's create-if-absent write settles a race
   that gets past this);
2. :func:`begin`: the live-save marker goes up before the first blob, so ``gc``,
   ``rm`` and retention keep off the save (:mod:`objckpt.saving.live_markers`);
3. :func:`upload`: blobs are sent in place or staged, and uploaded by the handle's
   engine (:mod:`objckpt.saving.upload`), as often as the writer has blobs;
4. :func:`commit`: on the I/O loop, wait for the uploads, write this process's index
   object, agree with the other processes, and write the root manifest
   (:mod:`objckpt.saving.commit`); the marker comes down however it ends.
   :func:`abandon` takes it down for a save that fails before its commit.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

from objckpt.core.format import MANIFEST_KEY, LeafEntry
from objckpt.core.plan import BlobPlan
from objckpt.core.writer_rule import Mesh
from objckpt.errors import CheckpointExistsError, StoreError
from objckpt.multihost import Coordinator
from objckpt.saving.commit import Commit, Save
from objckpt.saving.live_markers import LiveMarker, MarkerGroup, marker_key
from objckpt.saving.upload import PieceRecord, snapshot_and_upload
from objckpt.storage.base import Store
from objckpt.transfer import runtime
from objckpt.transfer.handle import Handle

Uploads = list[concurrent.futures.Future[list[PieceRecord]]]


def check_destination(handle: Handle) -> None:
    """Refuse a store that cannot create-if-absent, or that already holds a committed checkpoint.

    Raises:
        StoreError: the store cannot create objects only-if-absent.
        CheckpointExistsError: a committed checkpoint is there (left intact).
    """
    if not handle.traits.supports_create:
        raise StoreError(
            f"{handle.url}: this store cannot create objects only-if-absent, so a commit could overwrite"
            " another writer's checkpoint; use a store that supports it (S3, GCS, local disk, memory)"
        )
    if runtime.run_sync(_exists(handle)):  # the retrying store bounds it
        raise CheckpointExistsError(f"a committed checkpoint already exists at {handle.url}")


async def _exists(handle: Handle) -> bool:
    try:
        await handle.store.head(MANIFEST_KEY)
    except FileNotFoundError:
        return False
    return True


def begin(handle: Handle, *, coordinator: Coordinator, tag: str, save_id: str, bases: Sequence[Store] = ()) -> Save:
    """Start writing save ``save_id`` (coordinated under ``tag``): its live-save marker is written,
    before any blob, so that deleters see it first; likewise in each of ``bases``, the checkpoints
    an incremental save may reference, before their manifests are read."""
    key, lease = marker_key(save_id, coordinator.process_index), handle.options.live_marker_lease
    own = LiveMarker(handle.store, key, lease=lease)
    marker: LiveMarker | MarkerGroup = own
    if bases:
        marker = MarkerGroup([own, *(LiveMarker(b, key, lease=lease) for b in bases)])
    try:
        runtime.run_sync(marker.begin())
    except BaseException:
        runtime.run_sync(marker.end())
        raise
    return Save(handle=handle, coordinator=coordinator, tag=tag, save_id=save_id, marker=marker)


def upload(save: Save, blobs: list[BlobPlan], *, hold_uploads: bool, coded: frozenset[int] = frozenset()) -> Uploads:
    """Send ``blobs`` (the blocking phase: see :func:`~objckpt.saving.upload.snapshot_and_upload`);
    the futures of their piece records. ``coded``: the leaves whose pieces are compressed."""
    return snapshot_and_upload(blobs, save.handle, hold_uploads=hold_uploads, coded=coded)


async def commit(
    save: Save,
    uploads: Uploads,
    *,
    skeleton: dict[str, Any],
    entries: list[LeafEntry],
    meshes: tuple[Mesh, ...],
    metadata: dict[str, Any],
    started: float,
    coded: frozenset[int] = frozenset(),
) -> None:
    """Wait for ``uploads``, commit the checkpoint (or abort it on every process), then take the
    marker down; on the I/O loop. ``started``: when the uploads began, for the log's rate.
    ``coded``: the leaves whose pieces were compressed (their entries name the codec)."""
    commit = Commit(save, skeleton=skeleton, entries=entries, meshes=meshes, metadata=metadata, coded=coded)
    await commit.run(uploads, started)


def abandon(save: Save) -> None:
    """Take down the marker of a save that failed before its commit (from the caller's thread)."""
    runtime.run_sync(save.marker.end())
