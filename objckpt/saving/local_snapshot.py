"""A local save's blocking phase: every box this process's devices hold, copied into one owned buffer.

:func:`snapshot` runs in the caller's thread, like :func:`objckpt.save_async`'s blocking
phase: each box this process's devices hold is taken once (a replica on several local
devices too), its device-to-host copy started at once through an alias
(:mod:`objckpt.core.device_reads`: no host copy is left on the caller's arrays), and copied
into one buffer objckpt owns, so the caller may donate its arrays as soon as it returns. The result is what the save
pipeline writes as a one-process checkpoint of this process's part of the step
(:func:`objckpt.locations.local_dirs.write_step`): each leaf's entry, and each box as a piece
whose bytes lie in the buffer. No file I/O here.

A leaf's entry is the one a save of the whole tree would write, with two differences that
make it a part: its pieces are the boxes this process holds (every process writes its
replicas of a replicated leaf, so a process never needs another's bytes), and an array saved
with a ``NamedSharding`` records that sharding's mesh by device ids (``sharding.local``:
``mesh``, ``axes``, ``types``, ``devices``, ``spec``), so a restart onto another sharding
of the same devices reads the saved boxes and reshards on the devices
(:mod:`objckpt.layouts.process_copy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from objckpt.core.boxes import describe_sharding, index_to_box
from objckpt.core.device_reads import host_alias, host_view, start_host_copy
from objckpt.core.dtypes import dtype_name
from objckpt.core.format import LeafEntry
from objckpt.core.items import Json, PerProcess, encode_value, is_item, json_document, state_of
from objckpt.core.metadata import to_json_value
from objckpt.core.plan import OwnedPiece
from objckpt.core.tree import flatten
from objckpt.errors import DeletedArrayError
from objckpt.transfer.buffers import host_buffer

#: The byte alignment of each box in the snapshot's buffer.
ALIGN = 64
#: The layout of every leaf of a part: its one index object holds its pieces.
PART = {"processes": [0]}


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


class _Layout:
    """Places boxes in the buffer and remembers what to copy into each."""

    def __init__(self) -> None:
        self.size = 0
        self.copies: list[tuple[int, int, Any]] = []  # (offset, length, source array)
        self.pieces: list[tuple[int, tuple[int, ...], tuple[int, ...], np.dtype, int]] = []

    def box(self, leaf: int, start: tuple[int, ...], source: Any, dtype: np.dtype) -> None:
        shape = tuple(int(n) for n in source.shape)
        length = math.prod(shape) * dtype.itemsize
        offset = -(-self.size // ALIGN) * ALIGN
        self.size = offset + length
        self.copies.append((offset, length, source))
        self.pieces.append((leaf, start, shape, dtype, offset))


def _host_leaf(index: int, path: str, kind: str, data: np.ndarray, layout: _Layout) -> LeafEntry:
    if data.size:
        layout.box(index, (0,) * data.ndim, data, data.dtype)
    return LeafEntry(path, kind, dtype_name(data.dtype), tuple(data.shape), layout=PART)


def _array_leaf(index: int, path: str, array: jax.Array, layout: _Layout) -> LeafEntry:
    """Every box this process's devices hold, each once (replicas on several local devices too)."""
    prng = None
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        prng = str(jax.random.key_impl(array))
        array = jax.random.key_data(array)
    dtype = np.dtype(array.dtype)
    seen: set[tuple[int, ...]] = set()
    for shard in array.addressable_shards:
        start = tuple(int(n) for n in index_to_box(shard.index, tuple(array.shape))[0])
        if start in seen:
            continue
        seen.add(start)
        alias = host_alias(shard.data)  # the host copy lives on the alias, never on the user's array
        start_host_copy(alias)
        layout.box(index, start, alias, dtype)
    if prng is not None:
        sharding: dict[str, Any] = {"prng_impl": prng}
    else:
        sharding = describe_sharding(array.sharding)
        record = sharding_record(array.sharding)
        if record is not None:
            sharding["local"] = record
    return LeafEntry(path, "array", dtype_name(dtype), tuple(array.shape), sharding=sharding, layout=PART)


def sharding_record(sharding: Any) -> dict[str, Any] | None:
    """A ``NamedSharding`` by its mesh's device ids (None: another kind of sharding, or a spec this
    record cannot hold); :func:`objckpt.layouts.process_copy.saved_sharding` reads it."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or not isinstance(sharding.mesh, jax.sharding.Mesh):
        return None
    spec: list[Any] = []
    for entry in sharding.spec:
        if entry is None or isinstance(entry, str):
            spec.append(entry)
        elif isinstance(entry, tuple) and all(isinstance(n, str) for n in entry):
            spec.append(list(entry))
        else:  # an unconstrained or otherwise special entry
            return None
    mesh = sharding.mesh
    return {
        "mesh": [int(n) for n in mesh.devices.shape],
        "axes": [str(a) for a in mesh.axis_names],
        "types": [t.name for t in mesh.axis_types],
        "devices": [int(d.id) for d in mesh.devices.flat],
        "spec": spec,
    }


def _leaf(index: int, path: str, value: Any, layout: _Layout) -> LeafEntry:
    if value is None:
        return LeafEntry(path, "none")
    if is_item(value):
        if type(value) is PerProcess:
            data, encoding = encode_value(value.value, path)
            if data:
                layout.box(index, (0,), np.frombuffer(data, np.uint8), np.dtype(np.uint8))
            return LeafEntry(path, "per_process", value={"encoding": encoding, "length": len(data)})
        if type(value) is Json:
            return LeafEntry(path, "json", value=json_document(state_of(value.value, path), path)[0])
        state = state_of(value, path)
        if isinstance(state, (bytes, bytearray, memoryview)):
            return _host_leaf(index, path, "bytes", np.frombuffer(bytes(state), np.uint8), layout)
        return LeafEntry(path, "json", value=json_document(state, path)[0])
    if isinstance(value, bool):
        return LeafEntry(path, "bool", value=value)
    if isinstance(value, int):
        return LeafEntry(path, "int", value=value)
    if isinstance(value, float):
        return LeafEntry(path, "float", value=value)
    if isinstance(value, jax.Array):
        if value.is_deleted():
            raise DeletedArrayError(f"leaf {path}: the jax.Array was donated or deleted, so it cannot be saved")
        return _array_leaf(index, path, value, layout)
    if isinstance(value, str):
        return _host_leaf(index, path, "str", np.frombuffer(value.encode(), np.uint8), layout)
    if isinstance(value, bytes):
        return _host_leaf(index, path, "bytes", np.frombuffer(value, np.uint8), layout)
    if isinstance(value, (np.ndarray, np.generic)):
        return _host_leaf(index, path, "ndarray", np.asarray(value), layout)
    raise TypeError(f"leaf {path}: cannot checkpoint a {type(value).__module__}.{type(value).__qualname__}")


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
    layout = _Layout()
    entries = [_leaf(i, leaf.path, leaf.value, layout) for i, leaf in enumerate(leaves)]
    if buffer is None or buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.size < layout.size:
        buffer = host_buffer(layout.size)
    for offset, length, source in layout.copies:
        if length:
            host = host_view(source)
            np.copyto(buffer[offset : offset + length].view(host.dtype).reshape(host.shape), host)
    pieces = []
    for leaf, start, shape, dtype, offset in layout.pieces:
        data = buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
        stop = tuple(a + n for a, n in zip(start, shape))
        pieces.append(OwnedPiece(leaf, start, stop, dtype.itemsize, source=(data, start)))
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
