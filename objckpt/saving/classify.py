"""What each kind of leaf becomes in a checkpoint, and back.

jax.Arrays keep their sharding and are written by their owners; numpy arrays,
``str`` and ``bytes`` are written once, by the primary process, as uint8 or
typed data; ``int``/``float``/``bool``/``None`` live inline in the manifest.
Items (:mod:`objckpt.core.items`): a ``Json`` document lives inline in the
manifest; each process writes its own ``PerProcess`` value as one host piece,
which the commit moves out of the index into the root's leaf entry; a
``Stateful`` object is saved as its ``state_dict()`` (bytes by the primary, else JSON).

Two scopes share these rules: a save's (each process writes the boxes it owns by the grid
rule, host data by the primary) and a local save's part (``held``: every box this process's
devices hold, each once, and host data on every process; :mod:`objckpt.saving.local_snapshot`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import numpy as np

from objckpt.core.boxes import (
    MeshTable,
    describe_sharding,
    grid_of,
    grid_pieces,
    index_to_box,
    local_shards,
    owned_pieces,
)
from objckpt.core.dtypes import dtype_name
from objckpt.core.format import LeafEntry
from objckpt.core.items import UNSET, Json, PerProcess, encode_value, is_item, json_document, state_of
from objckpt.core.plan import OwnedPiece
from objckpt.core.tree import Leaf
from objckpt.errors import DeletedArrayError


def classify(
    index: int, leaf: Leaf, *, is_primary: bool, split_above: int, meshes: MeshTable, held: bool = False
) -> tuple[LeafEntry, list[OwnedPiece]]:
    """The manifest entry (without pieces, with its writers) for one leaf, and the pieces this process writes.

    ``meshes`` numbers the meshes of the leaves met so far (every process alike);
    ``split_above`` is the smallest slab a replicated box is cut into. ``held``: the scope of a
    local save's part (the module docstring); an array with a ``NamedSharding`` then also
    records its mesh by device ids (:func:`sharding_record`, as ``sharding["local"]``).
    """
    is_primary = is_primary or held
    value = leaf.value
    if value is None:
        return LeafEntry(leaf.path, "none"), []
    if is_item(value):
        return _item(index, leaf.path, value, is_primary)
    if isinstance(value, bool):
        return LeafEntry(leaf.path, "bool", value=value), []
    if isinstance(value, int):
        return LeafEntry(leaf.path, "int", value=value), []
    if isinstance(value, float):
        return LeafEntry(leaf.path, "float", value=value), []
    if isinstance(value, jax.Array) and value.is_deleted():
        raise DeletedArrayError(
            f"leaf {leaf.path}: the jax.Array was donated or deleted (its buffer is gone), so it cannot be"
            " saved; save the arrays a step returns, not the ones it donated (donate_argnums)"
        )
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        # Typed PRNG keys: store the raw key data and the implementation's name.
        impl = str(jax.random.key_impl(value))
        key_data = jax.random.key_data(value)
        entry = LeafEntry(
            leaf.path, "array", dtype_name(key_data.dtype), tuple(key_data.shape), sharding={"prng_impl": impl}
        )
        return _array_pieces(index, key_data, entry, meshes, split_above, held)
    if isinstance(value, jax.Array):
        try:
            name = dtype_name(value.dtype)
        except TypeError as e:
            raise TypeError(f"leaf {leaf.path}: {e}") from None
        sharding = describe_sharding(value.sharding)
        record = sharding_record(value.sharding) if held else None
        if record is not None:
            sharding["local"] = record
        entry = LeafEntry(leaf.path, "array", name, tuple(value.shape), sharding=sharding)
        return _array_pieces(index, value, entry, meshes, split_above, held)
    if isinstance(value, (str, bytes)):
        kind = "str" if isinstance(value, str) else "bytes"
        data = np.frombuffer(value.encode() if isinstance(value, str) else value, dtype=np.uint8)
        return LeafEntry(leaf.path, kind, "uint8", data.shape, writers=_P0), _host_pieces(index, data, is_primary)
    if isinstance(value, (np.ndarray, np.generic)):
        data = np.asarray(value)
        try:
            name = dtype_name(data.dtype)
        except TypeError as e:
            raise TypeError(f"leaf {leaf.path}: {e}") from None
        return LeafEntry(leaf.path, "ndarray", name, data.shape, writers=_P0), _host_pieces(index, data, is_primary)
    raise TypeError(
        f"leaf {leaf.path}: cannot checkpoint a {type(value).__module__}.{type(value).__qualname__}"
        " (leaves may be jax.Array, numpy arrays, int, float, bool, str, bytes or None;"
        " register custom containers as pytree nodes)"
    )


_P0 = {"processes": [0]}  # host data is written by the primary, process 0


def _item(index: int, path: str, item: object, is_primary: bool) -> tuple[LeafEntry, list[OwnedPiece]]:
    """The entry and pieces of a ``Json``, ``PerProcess`` or ``Stateful`` leaf."""
    if type(item) is PerProcess:
        if item.value is UNSET:
            raise ValueError(f"leaf {path}: PerProcess() without a value stands for a saved one; it cannot be saved")
        data, encoding = encode_value(item.value, path)
        entry = LeafEntry(path, "per_process", value={"encoding": encoding, "length": len(data)})
        return entry, _host_pieces(index, np.frombuffer(data, dtype=np.uint8), True)  # every process: its own
    if type(item) is Json:
        if item.value is UNSET:
            raise ValueError(f"leaf {path}: Json() without a value stands for a saved one; it cannot be saved")
        state = state_of(item.value, path)
    else:
        state = state_of(item, path)
        if isinstance(state, (bytes, bytearray, memoryview)):
            raw = np.frombuffer(bytes(state), dtype=np.uint8)
            return LeafEntry(path, "bytes", "uint8", raw.shape, writers=_P0), _host_pieces(index, raw, is_primary)
    return LeafEntry(path, "json", value=json_document(state, path)[0]), []


def _array_pieces(
    index: int, array: jax.Array, entry: LeafEntry, meshes: MeshTable, split_above: int, held: bool
) -> tuple[LeafEntry, list[OwnedPiece]]:
    """``entry`` with its writers, and this process's pieces of ``array``: every box its devices
    hold, each once (``held``); by the grid rule when its sharding is a grid; else by scanning
    every device (and naming the writers)."""
    if held:
        itemsize, seen, pieces = np.dtype(array.dtype).itemsize, set(), []
        for device, where, data in local_shards(array):
            start, stop = index_to_box(where, tuple(array.shape))
            if start not in seen:
                seen.add(start)
                pieces.append(OwnedPiece(index, start, stop, itemsize, source=(data, start), device=device))
        return replace(entry, writers=_P0), pieces
    found = grid_of(index, array, meshes, slab_bytes=split_above)
    if found is not None:
        grid, described = found
        return replace(entry, writers=described), grid_pieces(index, grid, local_shards(array))
    pieces, writers = owned_pieces(index, array, split_above=split_above)
    return replace(entry, writers={"processes": writers}), pieces


def _host_pieces(index: int, data: np.ndarray, is_primary: bool) -> list[OwnedPiece]:
    if not is_primary or data.size == 0:
        return []
    shape = tuple(data.shape)
    return [OwnedPiece(index, (0,) * len(shape), shape, data.dtype.itemsize, source=(data, (0,) * len(shape)))]


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
