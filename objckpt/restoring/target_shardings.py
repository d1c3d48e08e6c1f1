"""Where a target leaf with no concrete sharding goes: onto its saved sharding, when it can.

``jax.eval_shape`` makes the targets a training job has at hand: under an
``Auto`` mesh its leaves have no sharding, under an ``Explicit`` one a sharding
on an abstract mesh (no devices). Placing the first kind on one device, as a
bare ``ShapeDtypeStruct`` means, fills that device with a model sharded over
many; the second cannot be placed at all. Where this job's devices are the ones
the checkpoint was saved on, both get the saved mesh back (Orbax restores onto
the saved sharding too).
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from objckpt.core.boxes import saved_axis_types, saved_jax_mesh, saved_partition_spec
from objckpt.core.format import LeafEntry, Manifest
from objckpt.core.layout import Mesh
from objckpt.errors import TargetMismatchError

log = logging.getLogger("objckpt")


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
    bare = [i for i, t in selection.items() if _bare(t) and _on_mesh(manifest.leaves[i], t)]
    abstract = [i for i, t in selection.items() if _abstract(t)]
    if not bare and not abstract:
        return selection
    devices = {int(d.id): d for d in jax.devices()}
    saved = {(i, p) for mesh in manifest.meshes for i, p in zip(mesh.devices, mesh.processes)}
    same = saved == {(i, int(d.process_index)) for i, d in devices.items()}
    if bare and not same:
        log.info(
            "objckpt: %d target leaves without a sharding go to the first local device: the checkpoint's"
            " meshes use %d devices, not these %d (by id and process)",
            len(bare),
            len(saved),
            len(devices),
        )
    meshes: dict[tuple[int, tuple[str, ...] | None], jax.sharding.Mesh] = {}

    def mesh_of(number: int, types: tuple[str, ...] | None) -> jax.sharding.Mesh:
        if (number, types) not in meshes:
            meshes[number, types] = saved_jax_mesh(manifest.meshes[number], devices, types)
        return meshes[number, types]

    shardings: dict[tuple[Any, ...], jax.sharding.NamedSharding] = {}
    out = dict(selection)
    for i in bare if same else ():
        entry, t = manifest.leaves[i], selection[i]
        layout = entry.layout or {}
        number, spec = layout["mesh"], layout["spec"]
        types = saved_axis_types(entry.sharding, manifest.meshes[number])
        key = (number, types, tuple(map(tuple, spec)))
        if key not in shardings:
            shardings[key] = jax.sharding.NamedSharding(mesh_of(number, types), saved_partition_spec(spec))
        out[i] = jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=shardings[key], weak_type=t.weak_type)
    for i in abstract:
        t = selection[i]
        target_mesh = t.sharding.mesh
        concrete = _context_mesh(target_mesh)
        if concrete is None and same:
            number = _saved_mesh_like(manifest, manifest.leaves[i], target_mesh)
            if number is not None:
                concrete = mesh_of(number, tuple(a.name for a in target_mesh.axis_types))
        if concrete is None:
            raise TargetMismatchError(
                f"leaf {manifest.leaves[i].path}: the target's sharding is on an abstract mesh ({target_mesh}),"
                " which has no devices, and the checkpoint's mesh is not it on these devices: restore under"
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


def _on_mesh(entry: LeafEntry, target: Any) -> bool:
    """Whether ``entry`` is an array saved as a grid on a mesh, of the target's shape."""
    return (
        entry.kind == "array"
        and entry.prng_impl is None
        and "mesh" in (entry.layout or {})
        and tuple(target.shape) == entry.shape
    )


def _context_mesh(abstract: Any) -> jax.sharding.Mesh | None:
    """The concrete mesh set with ``jax.set_mesh`` when ``abstract`` is its abstract form."""
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    mesh = get_mesh() if get_mesh is not None else None
    if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty and mesh.abstract_mesh == abstract:
        return mesh
    return None


def _saved_mesh_like(manifest: Manifest, entry: LeafEntry, abstract: Any) -> int | None:
    """The number of ``entry``'s saved mesh when its axes (names and sizes) are ``abstract``'s."""
    number = (entry.layout or {}).get("mesh")
    if number is None or entry.prng_impl is not None:
        return None
    mesh: Mesh = manifest.meshes[number]
    return number if mesh.axes == tuple(zip(abstract.axis_names, abstract.axis_sizes)) else None
