"""A local save's background phase: one process's part of a step, written as an objckpt checkpoint.

The snapshot of a local save (:mod:`objckpt.saving.local_snapshot`) is written by the one save
pipeline (:mod:`objckpt.saving.pipeline`: begin → upload → commit) into a local directory, as a
one-process checkpoint: blobs holding the boxes, one index object with each piece's crc32c,
and ``manifest.json`` last. Only this process takes part (no barrier, nothing through the
coordination service, no object-store traffic): the local tier agrees across processes when
it restores, not when it saves. Its checksums, encoding and file writes run within
``Options.save_threads`` (one thread by default, as an async save's do), so the training step
keeps the host.
"""

from __future__ import annotations

import dataclasses
import time

from objckpt.core.plan import blob_key, packing_order, plan_blobs
from objckpt.multihost import Coordinator
from objckpt.options import Options
from objckpt.saving import pipeline
from objckpt.saving.blob_sizing import save_blob_size, split_pieces
from objckpt.saving.local_snapshot import Snapshot
from objckpt.transfer import runtime
from objckpt.transfer.cpu_slots import save_threads_for
from objckpt.transfer.handle import Handle


def save_part(url: str, snap: Snapshot, options: Options) -> None:
    """Write ``snap`` as a one-process checkpoint at ``url`` (an empty local directory), manifest last.

    Raises:
        CheckpointExistsError: a checkpoint is committed there already.
        StoreError: a write failed.
    """
    if options.save_threads is None:
        options = dataclasses.replace(options, save_threads=save_threads_for(hold_uploads=True))
    options = dataclasses.replace(options, digest=None, compression=None, format_version=3)
    handle = Handle.open(url, None, options)
    try:
        pipeline.check_destination(handle)
        owned = split_pieces(sorted(snap.pieces, key=packing_order), max_bytes=options.blob_size)
        blob_size = save_blob_size(options, snap.nbytes, processes=1, hold_uploads=False)
        save = pipeline.begin(handle, coordinator=Coordinator(), tag=f"local/{snap.step}", save_id=snap.save_id)
        started = time.perf_counter()
        try:
            blobs = plan_blobs(owned, blob_size=blob_size, key=lambda seq: blob_key(snap.save_id, 0, seq))
            uploads = pipeline.upload(save, blobs, hold_uploads=False)
        except BaseException:
            pipeline.abandon(save)
            raise
        commit = pipeline.commit(
            save,
            uploads,
            skeleton=snap.skeleton,
            entries=snap.entries,
            meshes=(),
            metadata=snap.metadata,
            started=started,
        )
        runtime.run_sync(commit)
    finally:
        handle.close()
