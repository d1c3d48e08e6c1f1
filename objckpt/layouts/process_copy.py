"""A local-tier step (format ``objckpt-local``) read as an objckpt checkpoint by the one restore.

A local step or a peer copy holds one process's part of a step: every box that process's
devices held, in one data file, and a sealed manifest (:mod:`objckpt.core.format.local`).
:func:`open_process_copy` converts that manifest on read into the restore's own shapes, a
:class:`~objckpt.core.format.Manifest` whose pieces are the saved boxes (as ``[start, stop)``,
each with its crc32c) in one blob, the data file, served from memory by a
:class:`~objckpt.storage.in_memory.BufferStore`. So a restore from the local tier is the
restore from a bucket: the same planner, crc32c checks, casts, partial restores, target
shardings and reshards, the same landing on the devices.

What differs is only what the copy holds. Its pieces cover what one process saved, so the
checkpoint says so (:attr:`NativeCheckpoint.holds_process`): a box the copy does not cover is
not a malformed checkpoint but a :class:`~objckpt.errors.PartialCopyError`, and the caller
reads the next location. An array saved with a ``NamedSharding`` keeps it as a grid on its
saved mesh (when this job has those devices), so a target sharded otherwise is read onto the
saved layout, where this process's own boxes cover it, and resharded on the devices.
Another process's ``PerProcess`` value is not in the copy (its entry is None).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from objckpt.core.boxes import MeshTable, describe_sharding, grid_of
from objckpt.core.dtypes import dtype_from_name
from objckpt.core.format import BlobEntry, LeafEntry, Manifest
from objckpt.core.format.local import LocalLeaf, LocalManifest
from objckpt.core.pieces import Piece
from objckpt.layouts.native import NativeCheckpoint
from objckpt.storage.in_memory import BufferStore


def open_process_copy(url: str, manifest: LocalManifest, data: np.ndarray, *, size_limit: int) -> NativeCheckpoint:
    """The step ``manifest`` describes, its data file's bytes ``data``, as a checkpoint of one
    process's part. ``url`` names it in messages and must be the same on every process (a
    restore that reshards agrees on it)."""
    meshes = MeshTable()
    devices = {int(d.id): d for d in jax.devices()}
    leaves = tuple(_entry(i, leaf, manifest, meshes, devices) for i, leaf in enumerate(manifest.leaves))
    converted = Manifest(
        save_id=manifest.save_id,
        created="",
        tree=manifest.tree,
        leaves=leaves,
        blobs=(BlobEntry(manifest.data, manifest.data_size),),
        num_processes=manifest.process_count,
        metadata=manifest.metadata,
        version=3,
        meshes=tuple(meshes.meshes),
    )
    store = BufferStore(url, {manifest.data: data})
    return NativeCheckpoint(store, converted, size_limit=size_limit, holds_process=manifest.process_index)


def _entry(
    index: int, leaf: LocalLeaf, manifest: LocalManifest, meshes: MeshTable, devices: dict[int, Any]
) -> LeafEntry:
    pieces = tuple(
        Piece(
            box.start,
            tuple(s + n for s, n in zip(box.start, box.shape)),
            manifest.data,
            box.offset,
            box.length,
            box.crc32c,
        )
        for box in leaf.boxes
    )
    own = {"processes": [manifest.process_index]}
    if leaf.kind in ("none", "int", "bool", "float", "json"):
        return LeafEntry(leaf.path, leaf.kind, value=float(leaf.value) if leaf.kind == "float" else leaf.value)
    if leaf.kind == "per_process":
        box = leaf.boxes[0] if leaf.boxes else None
        mine = {
            "encoding": leaf.value["encoding"],
            "length": box.length if box else 0,
            "crc32c": box.crc32c if box else 0,
            "blob": manifest.data,
            "offset": box.offset if box else 0,
        }
        values = [mine if p == manifest.process_index else None for p in range(manifest.process_count)]
        return LeafEntry(leaf.path, "per_process", value=values)
    if leaf.kind != "array":  # host data: ndarray, str, bytes
        return LeafEntry(leaf.path, leaf.kind, leaf.dtype, leaf.shape, pieces, layout=own)
    if leaf.prng_impl is not None:
        return LeafEntry(leaf.path, "array", leaf.dtype, leaf.shape, pieces, sharding={"prng_impl": leaf.prng_impl})
    layout: dict[str, Any] = own
    saved = saved_sharding(leaf.sharding, devices)
    if saved is not None:
        dtype = dtype_from_name(leaf.dtype or "")
        found = grid_of(index, jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=saved), meshes, slab_bytes=0)
        if found is not None:
            layout = found[1]
    description = None if saved is None else describe_sharding(saved)
    return LeafEntry(leaf.path, "array", leaf.dtype, leaf.shape, pieces, sharding=description, layout=layout)


def saved_sharding(record: dict[str, Any] | None, devices: dict[int, Any]) -> jax.sharding.NamedSharding | None:
    """The ``NamedSharding`` a local manifest recorded, on this job's ``devices`` (by id); None when
    none was recorded or a device it names is not in this job."""
    if record is None or not all(i in devices for i in record["devices"]):
        return None
    placed = np.array([devices[i] for i in record["devices"]], dtype=object).reshape(record["mesh"])
    types = tuple(getattr(jax.sharding.AxisType, t) for t in record["types"])
    mesh = jax.sharding.Mesh(placed, tuple(record["axes"]), axis_types=types)
    spec = [tuple(e) if isinstance(e, list) else e for e in record["spec"]]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
