"""A local-tier step or a peer copy, opened as a checkpoint of one process's part for the one restore.

A local step is an objckpt checkpoint (format version 3) of one process's part, its
``manifest.json`` pinned by the step's sealed record (:mod:`objckpt.core.format.local`), read
through a store like any checkpoint by :func:`objckpt.restoring.api.restore_copy` (docs/TIERS.md,
"Restoring"). :func:`open_part` checks the manifest against the record, reads its one index object
whole, and says in the manifest it returns what the copy holds: one process's pieces
(:attr:`NativeCheckpoint.holds_process`: a box they miss is a :class:`~objckpt.errors.PartialCopyError`),
this process's ``PerProcess`` values only (another's entry is None), and each array saved with a
``NamedSharding`` as a grid on its saved mesh where this job has those devices (a target sharded
otherwise is read onto that grid, then resharded on the devices).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from objckpt.core.boxes import MeshTable, grid_of
from objckpt.core.dtypes import dtype_from_name
from objckpt.core.format import LeafEntry, Manifest
from objckpt.core.format.local import PartRecord
from objckpt.core.format.manifest import parse_manifest
from objckpt.errors import FormatError
from objckpt.layouts.manifest_io import read_indexes, read_manifest_bytes
from objckpt.layouts.native import NativeCheckpoint
from objckpt.storage.base import Store


async def open_part(store: Store, record: PartRecord, *, size_limit: int) -> NativeCheckpoint:
    """The checkpoint at ``store`` as ``record``'s process's part of its step.

    Raises:
        CheckpointNotFoundError: no manifest.
        FormatError: a manifest other than the one the record pins, not a one-process version 3
            checkpoint of the record's save, or an index object that fails its checks.
    """
    raw = await read_manifest_bytes(store, size_limit=size_limit)
    if not record.pins(raw):
        raise FormatError(f"{store.url}: manifest.json is not the one its record pins (an edited or replaced step)")
    manifest = parse_manifest(raw, size_limit=size_limit)
    if manifest.save_id != record.save_id or manifest.num_processes != 1 or manifest.version < 3:
        raise FormatError(f"{store.url}: not a one-process version 3 checkpoint of save {record.save_id}")
    manifest = await read_indexes(store, manifest, [0], size_limit=size_limit, columnar=True)
    converted = as_process_part(manifest, record.process_index, record.process_count)
    return NativeCheckpoint(store, converted, size_limit=size_limit, holds_process=record.process_index)


def as_process_part(manifest: Manifest, process: int, count: int) -> Manifest:
    """``manifest`` (a one-process checkpoint with its pieces read) as process ``process``'s part of a
    job of ``count`` processes (see the module docstring)."""
    meshes = MeshTable()
    devices = {int(d.id): d for d in jax.devices()}
    leaves = tuple(_entry(i, leaf, process, count, meshes, devices) for i, leaf in enumerate(manifest.leaves))
    return dataclasses.replace(
        manifest, leaves=leaves, num_processes=count, meshes=tuple(meshes.meshes), indexes=(), loaded=frozenset()
    )


def _entry(
    index: int, leaf: LeafEntry, process: int, count: int, meshes: MeshTable, devices: dict[int, Any]
) -> LeafEntry:
    if leaf.kind == "per_process":
        values = [leaf.value[0] if p == process else None for p in range(count)]
        return dataclasses.replace(leaf, value=values)
    record = (leaf.sharding or {}).get("local")
    saved = saved_sharding(record, devices)
    if leaf.kind != "array" or saved is None:
        return leaf
    dtype = dtype_from_name(leaf.dtype or "")
    found = grid_of(index, jax.ShapeDtypeStruct(tuple(leaf.shape or ()), dtype, sharding=saved), meshes, slab_bytes=0)
    return leaf if found is None else dataclasses.replace(leaf, writers=found[1])


def saved_sharding(record: Any, devices: dict[int, Any]) -> jax.sharding.NamedSharding | None:
    """The ``NamedSharding`` a part recorded by device ids (:func:`objckpt.saving.classify.sharding_record`),
    on this job's ``devices`` (by id); None when none was recorded, it is not one, or a device it
    names is not in this job."""
    try:
        ids = [int(i) for i in record["devices"]]
        if not all(i in devices for i in ids):
            return None
        placed = np.array([devices[i] for i in ids], dtype=object).reshape(record["mesh"])
        types = tuple(getattr(jax.sharding.AxisType, t) for t in record["types"])
        mesh = jax.sharding.Mesh(placed, tuple(record["axes"]), axis_types=types)
        spec = [tuple(e) if isinstance(e, list) else e for e in record["spec"]]
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    except (KeyError, TypeError, ValueError, AttributeError):  # informational: what does not fit is ignored
        return None
