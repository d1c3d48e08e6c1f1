"""A local save's blocking phase: every box this process's devices hold, copied into one owned buffer.

:func:`snapshot` runs in the caller's thread, like :func:`objckpt.save_async`'s blocking
phase: each box this process's devices hold is taken once (a replica on several local
devices too), its device-to-host copy started at once, and copied into one buffer objckpt
owns, so the caller may donate its arrays as soon as it returns. The result is the step's
manifest (without checksums; :func:`objckpt.locations.local_dirs.write_step` adds them) and the
bytes, laid out as :mod:`objckpt.core.format.local` says. No file I/O here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from objckpt.core.boxes import index_to_box
from objckpt.core.dtypes import dtype_name
from objckpt.core.format.local import LocalBox, LocalLeaf, LocalManifest, aligned
from objckpt.core.items import Json, PerProcess, encode_value, is_item, json_document, state_of
from objckpt.core.metadata import to_json_value
from objckpt.core.tree import flatten
from objckpt.errors import DeletedArrayError
from objckpt.transfer.buffers import host_buffer


@dataclass
class Snapshot:
    """A local save's blocking phase done: the manifest without checksums, and the bytes."""

    manifest: LocalManifest
    buffer: np.ndarray
    seconds: float = 0.0


class _Layout:
    """Places boxes in the data file and remembers what to copy into each."""

    def __init__(self) -> None:
        self.size = 0
        self.copies: list[tuple[int, int, Any]] = []  # (offset, length, source array)

    def box(self, start: tuple[int, ...], source: Any, dtype: np.dtype) -> LocalBox:
        shape = tuple(int(n) for n in source.shape)
        length = math.prod(shape) * dtype.itemsize
        offset = aligned(self.size)
        self.size = offset + length
        self.copies.append((offset, length, source))
        return LocalBox(start, shape, offset, length)


def _host_leaf(path: str, kind: str, data: np.ndarray, layout: _Layout, value: Any = None) -> LocalLeaf:
    box = layout.box((0,) * data.ndim, data, data.dtype) if data.size else None
    return LocalLeaf(path, kind, dtype_name(data.dtype), tuple(data.shape), value, (box,) if box else ())


def _array_leaf(path: str, array: jax.Array, layout: _Layout) -> LocalLeaf:
    """Every box this process's devices hold, each once (replicas on several local devices too)."""
    prng = None
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        prng = str(jax.random.key_impl(array))
        array = jax.random.key_data(array)
    dtype = np.dtype(array.dtype)
    seen: set[tuple[int, ...]] = set()
    boxes = []
    for shard in array.addressable_shards:
        start = tuple(int(n) for n in index_to_box(shard.index, tuple(array.shape))[0])
        if start in seen:
            continue
        seen.add(start)
        shard.data.copy_to_host_async()
        boxes.append(layout.box(start, shard.data, dtype))
    sharding = None if prng else sharding_record(array.sharding)
    return LocalLeaf(path, "array", dtype_name(dtype), tuple(array.shape), None, tuple(boxes), prng, sharding)


def sharding_record(sharding: Any) -> dict[str, Any] | None:
    """A ``NamedSharding`` as the local manifest records it (None: another kind of sharding, or a
    spec this record cannot hold); :func:`objckpt.layouts.process_copy.saved_sharding` reads it."""
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


def _leaf(path: str, value: Any, layout: _Layout) -> LocalLeaf:
    if value is None:
        return LocalLeaf(path, "none")
    if is_item(value):
        if type(value) is PerProcess:
            data, encoding = encode_value(value.value, path)
            return _host_leaf(path, "per_process", np.frombuffer(data, np.uint8), layout, {"encoding": encoding})
        if type(value) is Json:
            return LocalLeaf(path, "json", value=json_document(state_of(value.value, path), path)[0])
        state = state_of(value, path)
        if isinstance(state, (bytes, bytearray, memoryview)):
            return _host_leaf(path, "bytes", np.frombuffer(bytes(state), np.uint8), layout)
        return LocalLeaf(path, "json", value=json_document(state, path)[0])
    if isinstance(value, bool):
        return LocalLeaf(path, "bool", value=value)
    if isinstance(value, int):
        return LocalLeaf(path, "int", value=value)
    if isinstance(value, float):
        return LocalLeaf(path, "float", value=to_json_value(value, path))
    if isinstance(value, jax.Array):
        if value.is_deleted():
            raise DeletedArrayError(f"leaf {path}: the jax.Array was donated or deleted, so it cannot be saved")
        return _array_leaf(path, value, layout)
    if isinstance(value, str):
        return _host_leaf(path, "str", np.frombuffer(value.encode(), np.uint8), layout)
    if isinstance(value, bytes):
        return _host_leaf(path, "bytes", np.frombuffer(value, np.uint8), layout)
    if isinstance(value, (np.ndarray, np.generic)):
        return _host_leaf(path, "ndarray", np.asarray(value), layout)
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
) -> Snapshot:
    """The blocking phase of a local save: this process's boxes copied into one owned buffer.

    ``root``: the manager root the step belongs to (recorded, and checked on every read).
    """
    leaves, skeleton = flatten(tree)
    layout = _Layout()
    records = tuple(_leaf(leaf.path, leaf.value, layout) for leaf in leaves)
    buffer = host_buffer(layout.size)
    for offset, length, source in layout.copies:
        if length:
            host = np.asarray(source)
            np.copyto(buffer[offset : offset + length].view(host.dtype).reshape(host.shape), host)
    manifest = LocalManifest(
        root=root,
        step=step,
        save_id=save_id,
        process_index=process_index,
        process_count=process_count,
        data=f"{save_id}.data",
        data_size=layout.size,
        tree=skeleton,
        leaves=records,
        metadata=metadata,
    )
    return Snapshot(manifest, buffer)
