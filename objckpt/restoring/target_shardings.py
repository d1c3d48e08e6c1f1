"""Where a target leaf with no concrete sharding goes: onto its saved sharding, when it can.

``jax.eval_shape`` makes the targets a training job has at hand: under an
``Auto`` mesh its leaves have no sharding, under an ``Explicit`` one a sharding
on an abstract mesh (no devices). Placing the first kind on one device, as a
bare ``ShapeDtypeStruct`` means, fills that device with a model sharded over
many; the second cannot be placed at all. Where this job's devices are the ones
the checkpoint was saved on, both get the saved mesh back, as Orbax does. The
rule is the same for objckpt checkpoints (the root's meshes: device ids and
processes) and Orbax ones (``_sharding``: device ids).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import jax

from objckpt.core.boxes import axis_type_names, saved_jax_mesh, saved_partition_spec
from objckpt.core.format import Manifest
from objckpt.errors import TargetMismatchError

log = logging.getLogger("objckpt")


@dataclass(frozen=True)
class SavedSharding:
    """A leaf's saved ``NamedSharding``: mesh axes (names, sizes), device ids in the mesh's
    C order, axes per dimension, the axis types when recorded, and what names its mesh
    among the save's (leaves on one mesh share it: an id list is hashed once, not per leaf)."""

    axes: tuple[tuple[str, int], ...]
    ids: tuple[int, ...]
    spec: tuple[tuple[str, ...], ...]
    axis_types: tuple[str, ...] | None
    mesh_key: Any


def on_saved_shardings(manifest: Manifest, selection: dict[int, Any]) -> dict[int, Any]:
    """``selection`` (saved leaf → target leaf) with targets lacking a concrete sharding placed.

    A ``jax.ShapeDtypeStruct`` without a sharding gets the leaf's saved
    ``NamedSharding`` where this job's devices are the ones the checkpoint's meshes
    name (the same count, ids and processes). The rule holds for the whole restore,
    so a restored tree never spans two device sets: where the devices differ (another
    count, other ids or processes, or a save on part of them) such a leaf goes to the
    first local device, as it does when it was not saved as a grid on a mesh (numpy,
    one device, other shardings), is a typed PRNG key, or comes from a format
    version 1 checkpoint. The mesh's axis types are the saved ones where the leaf's
    sharding description records them, else JAX's ``Mesh`` default.

    A sharding on an abstract mesh takes the concrete mesh set with ``jax.set_mesh``
    when that is its concrete form, else the saved mesh when its axes (names and
    sizes) are the abstract mesh's and the devices are the saved ones; its spec and
    axis types are kept.

    Raises:
        TargetMismatchError: a sharding on an abstract mesh that neither gives devices.
    """
    if not any(_bare(t) or _abstract(t) for t in selection.values()):
        return selection
    saved: dict[int, SavedSharding] = {}
    for i in selection:
        entry = manifest.leaves[i]
        writers = entry.writers or {}
        if entry.kind != "array" or entry.prng_impl is not None or "mesh" not in writers:
            continue
        mesh = manifest.meshes[writers["mesh"]]
        described = entry.sharding or {}
        named = described.get("mesh")
        fits = isinstance(named, dict) and list(named) == [name for name, _ in mesh.axes]
        types = axis_type_names(described.get("axis_types"), len(mesh.axes)) if fits else None
        spec = tuple(map(tuple, writers["spec"]))
        saved[i] = SavedSharding(mesh.axes, mesh.devices, spec, types, mesh_key=writers["mesh"])
    ids = {(i, p) for mesh in manifest.meshes for i, p in zip(mesh.devices, mesh.processes)}
    here = {(int(d.id), int(d.process_index)) for d in jax.devices()}
    shapes = {i: manifest.leaves[i].shape for i in saved}
    path_of = {i: manifest.leaves[i].path for i in selection}
    return place(selection, saved, shapes, path_of, same=ids == here, saved_devices=len(ids))


def on_saved_orbax_shardings(
    leaves: list[Any], shapes: dict[int, tuple[int, ...]], selection: dict[int, Any]
) -> dict[int, Any]:
    """:func:`on_saved_shardings` for an Orbax checkpoint: ``leaves`` are its
    :class:`~objckpt.orbax.layout.OrbaxLeaf` list, ``shapes`` the saved shapes of the
    selected array leaves. Orbax records each ``NamedSharding``'s device ids
    (``device_mesh``) but not their processes: the devices here are the saved ones when
    the ids of every saved mesh are exactly this job's."""
    if not any(_bare(t) or _abstract(t) for t in selection.values()):
        return selection
    every = {i: found for i, leaf in enumerate(leaves) if (found := _orbax_sharding(leaf.sharding)) is not None}
    ids = {device for found in every.values() for device in found.ids}
    here = {int(d.id) for d in jax.devices()}
    saved = {i: every[i] for i in selection if i in every and i in shapes}
    path_of = {i: leaves[i].path for i in selection}
    return place(selection, saved, shapes, path_of, same=bool(ids) and ids == here, saved_devices=len(ids))


def place(
    selection: dict[int, Any],
    saved: dict[int, SavedSharding],
    shapes: dict[int, Any],
    path_of: dict[int, str],
    *,
    same: bool,
    saved_devices: int,
) -> dict[int, Any]:
    """The targets of ``selection`` placed by the rule :func:`on_saved_shardings` states:
    ``saved`` gives the leaves saved on a mesh (``shapes``: their shapes), ``same`` whether
    this job's devices are the saved ones, ``saved_devices`` how many the save used (for
    the log line). A saved sharding that does not cut its leaf's shape (a hostile
    description) is left out: the leaf keeps the first local device."""
    devices = {int(d.id): d for d in jax.devices()}
    bare = [i for i, t in selection.items() if _bare(t) and i in saved and tuple(t.shape) == shapes[i]]
    abstract = [i for i, t in selection.items() if _abstract(t)]
    if bare and not same:
        log.info(
            "objckpt: %d target leaves without a sharding go to the first local device: the checkpoint's"
            " meshes use %d devices, not these %d (by id and process)",
            len(bare),
            saved_devices,
            len(devices),
        )
    meshes: dict[tuple[Any, ...], jax.sharding.Mesh] = {}

    def mesh_of(found: SavedSharding, types: tuple[str, ...] | None) -> jax.sharding.Mesh:
        key = (found.mesh_key, types)
        if key not in meshes:
            meshes[key] = saved_jax_mesh(found.axes, found.ids, devices, types)
        return meshes[key]

    shardings: dict[tuple[Any, ...], jax.sharding.NamedSharding] = {}
    out = dict(selection)
    for i in bare if same else ():
        found, t = saved[i], selection[i]
        key = (found.mesh_key, found.axis_types, found.spec)
        if key not in shardings:
            spec = saved_partition_spec([list(axes) for axes in found.spec])
            shardings[key] = jax.sharding.NamedSharding(mesh_of(found, found.axis_types), spec)
        try:
            shardings[key].shard_shape(tuple(t.shape))
        except ValueError:
            continue
        out[i] = jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=shardings[key], weak_type=t.weak_type)
    for i in abstract:
        t = selection[i]
        target_mesh = t.sharding.mesh
        concrete = _context_mesh(target_mesh)
        mine = saved.get(i)
        if concrete is None and same and mine is not None:
            if mine.axes == tuple(zip(target_mesh.axis_names, target_mesh.axis_sizes)):
                concrete = mesh_of(mine, tuple(a.name for a in target_mesh.axis_types))
        if concrete is None:
            raise TargetMismatchError(
                f"leaf {path_of[i]}: the target's sharding is on an abstract mesh ({target_mesh}), which has"
                " no devices, and the checkpoint's mesh is not it on these devices: restore under"
                " jax.set_mesh(mesh), or give a NamedSharding on a concrete mesh"
            )
        sharding = jax.sharding.NamedSharding(concrete, t.sharding.spec)
        out[i] = jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=sharding, weak_type=t.weak_type)
    return out


def _bare(target: Any) -> bool:
    return isinstance(target, jax.ShapeDtypeStruct) and target.sharding is None


def _abstract(target: Any) -> bool:
    """A ``ShapeDtypeStruct`` on a ``NamedSharding`` whose mesh is abstract (no devices)."""
    sharding = getattr(target, "sharding", None) if isinstance(target, jax.ShapeDtypeStruct) else None
    kind = getattr(jax.sharding, "AbstractMesh", None)
    return isinstance(sharding, jax.sharding.NamedSharding) and kind is not None and isinstance(sharding.mesh, kind)


def _context_mesh(abstract: Any) -> jax.sharding.Mesh | None:
    """The concrete mesh set with ``jax.set_mesh`` when ``abstract`` is its abstract form."""
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    mesh = get_mesh() if get_mesh is not None else None
    if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty and mesh.abstract_mesh == abstract:
        return mesh
    return None


def _orbax_sharding(described: dict[str, Any] | None) -> SavedSharding | None:
    """The ``NamedSharding`` an Orbax ``_sharding`` entry describes, with its device ids
    (``device_mesh``), or None when it describes none completely. ``layout`` checked the
    name, shape and spec fields; ``device_mesh`` is checked here."""
    if not described or described.get("sharding_type") != "NamedSharding":
        return None
    names, sizes = described.get("axis_names", []), described.get("shape", [])
    grid = (described.get("device_mesh") or {}).get("mesh") if isinstance(described.get("device_mesh"), dict) else None
    if len(names) != len(sizes) or len(set(names)) != len(names) or any(n < 1 for n in sizes):
        return None
    ids: list[int] = []

    def walk(node: Any, depth: int) -> bool:
        if depth == len(sizes):
            ok = isinstance(node, dict) and type(node.get("id")) is int and node["id"] >= 0
            if ok:
                ids.append(node["id"])
            return ok
        return isinstance(node, list) and len(node) == sizes[depth] and all(walk(c, depth + 1) for c in node)

    if not walk(grid, 0) or len(set(ids)) != len(ids):
        return None
    spec: list[tuple[str, ...]] = []
    for entry in described.get("partition_spec", []):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if not all(a in names for a in axes):
            return None
        spec.append(axes)
    used = [a for axes in spec for a in axes]
    if len(set(used)) != len(used):
        return None
    types = axis_type_names(described.get("axis_types"), len(names))
    axes = tuple(zip(names, sizes))
    return SavedSharding(axes, tuple(ids), tuple(spec), types, mesh_key=(axes, tuple(ids)))
