"""A local save's two phases: every box this process's devices hold, copied off the devices once; then written.

:func:`snapshot` runs in the caller's thread, like :func:`objckpt.save_async`'s blocking
phase: each box this process's devices hold is taken once (a replica on several local
devices too), its device-to-host copy started at once through an alias
(:mod:`objckpt.core.device_reads`: no host copy is left on the caller's arrays), and kept
where that copy is objckpt's own (an accelerator's), else copied into one buffer objckpt owns, so
the caller may donate its arrays as soon as it returns. The result is what the writing
corridor writes as a one-process checkpoint of this process's part of the step
(:func:`objckpt.locations.local_dirs.write_step`): each leaf's entry, and each box as a piece
whose bytes lie in the buffer; and, for a step due for the store too, the host stage its save
reads (:meth:`Snapshot.serve`).

:func:`save_part` is a local save's background phase: the snapshot written by the writing
corridor into a local directory, as a one-process checkpoint (blobs, one index object with each
piece's crc32c, ``manifest.json`` last). Only this process takes part (no barrier, nothing
through the coordination service, no object store): the local tier agrees across processes when
it restores, not when it saves. Its checksums and file writes run within
``Options.save_threads`` (one thread by default, as an async save's do), so the training step
keeps the host.

A leaf's entry is the one a save of the whole tree would write (one classifier decides both:
:func:`objckpt.saving.classify.classify`, in its ``held`` scope), with two differences that
make it a part: its pieces are the boxes this process holds (every process writes its
replicas of a replicated leaf, so a process never needs another's bytes), and an array saved
with a ``NamedSharding`` records that sharding's mesh by device ids (``sharding.local``:
``mesh``, ``axes``, ``types``, ``devices``, ``spec``), so a restart onto another sharding
of the same devices reads the saved boxes and reshards on the devices
(:mod:`objckpt.layouts.process_copy`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from objckpt.core.boxes import MeshTable
from objckpt.core.device_reads import HeldBytes, host_alias, host_copy, start_host_copy
from objckpt.core.format import LeafEntry
from objckpt.core.metadata import to_json_value
from objckpt.core.plan import OwnedPiece, packing_order
from objckpt.core.tree import flatten
from objckpt.multihost import Coordinator
from objckpt.options import Options
from objckpt.saving.blob_sizing import split_pieces
from objckpt.saving.classify import classify
from objckpt.saving.writer import Source, write
from objckpt.transfer.buffers import host_buffer
from objckpt.transfer.cpu_slots import save_threads_for
from objckpt.transfer.handle import Handle

#: The byte alignment of each box in the snapshot's buffer.
ALIGN = 64


@dataclass
class Snapshot:
    """A local save's blocking phase done: the part's entries and pieces, and the bytes they lie in."""

    root: str
    step: int
    save_id: str
    process_index: int
    process_count: int
    skeleton: dict[str, Any]
    entries: list[LeafEntry]
    pieces: list[OwnedPiece]
    metadata: dict[str, Any]
    buffer: np.ndarray
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def serve(self, pieces: list[OwnedPiece]) -> list[OwnedPiece]:
        """``pieces`` (a save's, of the same tree) reading their bytes from this snapshot's buffer
        where it holds their box, so no box is copied off the devices twice; the others as given."""
        held = {(p.leaf, p.start): p.source[0] for p in self.pieces}
        out = []
        for piece in pieces:
            host = held.get((piece.leaf, tuple(piece.source[1])))
            if host is not None and host.shape == tuple(piece.source[0].shape):
                piece = dataclasses.replace(piece, source=(host, piece.source[1]))
            out.append(piece)
        return out


def snapshot(
    tree: Any,
    *,
    root: str,
    step: int,
    save_id: str,
    process_index: int,
    process_count: int,
    metadata: dict[str, Any],
    buffer: np.ndarray | None = None,
) -> Snapshot:
    """The blocking phase of a local save: this process's boxes copied into one owned buffer.

    ``root``: the manager root the step belongs to (recorded, and checked on every read);
    ``save_id``: the manager run's, the part's checkpoint's own. ``buffer``: a uint8 buffer
    to copy into, used when it holds the part (a previous local save's, written already:
    its pages are in, so the copy faults none, 5-9x faster here); else a fresh one.
    """
    leaves, skeleton = flatten(tree)
    meshes, entries, boxes = MeshTable(), list[LeafEntry](), []
    for i, leaf in enumerate(leaves):  # what a save writes, in the scope of this process's part
        entry, held = classify(i, leaf, is_primary=True, split_above=0, meshes=meshes, held=True)
        entries.append(entry)
        for piece in held:
            data = host_alias(piece.source[0])  # the host copy lives on the alias, never on the user's array
            start_host_copy(data)
            boxes.append((i, piece.start, data))
    # An accelerator's host copies are objckpt's own already: kept as they are (no second copy, no
    # second hold). The rest (a CPU device's memory, numpy arrays) are copied into one buffer.
    hosts = [host_copy(data) for *_, data in boxes]
    offsets: list[int | None] = []
    size = 0
    for host, owned in hosts:
        offset = None if owned else -(-size // ALIGN) * ALIGN
        offsets.append(offset)
        size = size if offset is None else offset + host.nbytes
    if buffer is None or buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.size < size:
        buffer = host_buffer(size)
    pieces = []
    for (i, start, _), (host, _), offset in zip(boxes, hosts, offsets):
        if offset is not None:
            placed = buffer[offset : offset + host.nbytes].view(host.dtype).reshape(host.shape)
            np.copyto(placed, host)
            host = placed
        stop = tuple(a + int(n) for a, n in zip(start, host.shape))
        pieces.append(OwnedPiece(i, start, stop, host.dtype.itemsize, source=(host.view(HeldBytes), start)))
    return Snapshot(
        root=root,
        step=step,
        save_id=save_id,
        process_index=process_index,
        process_count=process_count,
        skeleton=skeleton,
        entries=entries,
        pieces=pieces,
        metadata=to_json_value(dict(metadata), "metadata"),
        buffer=buffer,
    )


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
