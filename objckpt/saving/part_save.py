"""A local save's background phase: one process's part of a step, written as an objckpt checkpoint.

The snapshot of a local save (:mod:`objckpt.saving.local_snapshot`) is written by the writing
corridor (:func:`objckpt.saving.writer.write`) into a local directory, as a one-process
checkpoint: blobs holding the boxes, one index object with each piece's crc32c, and
``manifest.json`` last. Only this process takes part (no barrier, nothing through the
coordination service, no object-store traffic): the local tier agrees across processes when
it restores, not when it saves. Its checksums, encoding and file writes run within
``Options.save_threads`` (one thread by default, as an async save's do), so the training step
keeps the host.
"""

from __future__ import annotations

import dataclasses

from objckpt.core.plan import packing_order
from objckpt.multihost import Coordinator
from objckpt.options import Options
from objckpt.saving.blob_sizing import split_pieces
from objckpt.saving.local_snapshot import Snapshot
from objckpt.saving.writer import Source, write
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
    pieces = split_pieces(sorted(snap.pieces, key=packing_order), max_bytes=options.blob_size)
    source = Source(snap.skeleton, snap.entries, [pieces], snap.nbytes, metadata=snap.metadata)
    handle = Handle.open(url, None, options)
    try:
        tag = f"local/{snap.step}"
        write(handle, source, save_id=snap.save_id, tag=tag, coordinator=Coordinator()).future.result()
    finally:
        handle.close()
