"""Restore a target from one local step, or say why this process's local tier cannot serve it.

Each process reads only its own directory: for every device of the target sharding that is
addressable here, the box it needs must lie inside a box this process saved; it is read
from the data file, its crc32c checked, and put on its device. The global array is built
from those per-device arrays (``jax.make_array_from_single_device_arrays``: no collective,
so a process that cannot serve its part never leaves the others waiting).

A target sharding other than the saved one (an array saved with a ``NamedSharding``, the same
devices, the same process count) is served too: each process places the boxes it saved in
their saved layout, every process agrees that all did (:func:`restore_local`'s ``agree``),
then JAX reshards on the devices, so a process never needs another's local bytes.

Anything this tier cannot answer exactly as the object store would is :class:`NotCovered`
(the caller falls back to a slower tier): a target box no saved box holds, a dtype or
shape that differs (the object store's restore casts and names mismatches), a leaf the
step lacks, a ``PerProcess(all=True)`` target or a per-process value saved by another
number of processes, a box whose checksum does not match.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from objckpt.core.boxes import index_to_box
from objckpt.core.checksum import crc32c
from objckpt.core.dtypes import dtype_from_name
from objckpt.core.items import PerProcess, decode_value, is_item, load_into
from objckpt.core.tree import build, flatten_target, unflatten_target
from objckpt.manager.local_format import LocalBox, LocalLeaf, LocalManifest


class NotCovered(Exception):
    """This process's local step cannot serve the target; the message says why."""


Agree = Callable[[str | None], dict[int, str]]


def restore_local(
    directory: Path,
    manifest: LocalManifest,
    target: Any,
    *,
    partial: bool = False,
    data: np.ndarray | None = None,
    agree: Agree | None = None,
) -> Any:
    """``target`` (a pytree like :func:`objckpt.restore`'s, or None for host values) from the step in ``directory``.

    ``data``: the step's data file already in memory (a copy just brought back from a peer),
    read instead of the file; every box is still checked by its crc32c.

    An array leaf saved with a ``NamedSharding`` and restored onto another sharding of the same
    devices (by a job of the same process count) is read in its saved layout, each process
    its own boxes, then resharded on the devices: a collective. So the read is phase one, and
    ``agree`` (every process calls it, with its error or None; it returns the failures by
    process) runs between the phases: the reshards start only once every process has read
    its part. With one process, ``agree`` may be None.

    Raises:
        NotCovered: the step cannot serve this target here, or another process's part failed
            (see the module docstring).
    """
    reshards: list[tuple[int, jax.Array, Any]] = []
    error: Exception | None = None
    try:
        with _Reader(directory / manifest.data, manifest, data) as reader:
            values, rebuild = _read(reader, manifest, target, partial, reshards)
    except Exception as e:  # reported at the agreement below, then raised
        error = e
    if agree is not None:
        failed = agree(None if error is None else f"{type(error).__name__}: {error}")
        if error is None and failed:
            raise NotCovered("; ".join(f"process {p}: {e}" for p, e in sorted(failed.items())))
    if error is not None:
        raise error
    for i, array, sharding in reshards:  # the same leaves, in the same order, on every process
        values[i] = jax.device_put(array, sharding)
    return rebuild(values)


def _read(
    reader: _Reader, manifest: LocalManifest, target: Any, partial: bool, reshards: list[tuple[int, jax.Array, Any]]
) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """Phase one: every value read here, and how to build the tree from them; the arrays to reshard
    go to ``reshards`` (position, saved-layout array, target sharding)."""
    if target is None:
        return [reader.value(leaf, None) for leaf in manifest.leaves], lambda v: build(manifest.tree, lambda i: v[i])
    flat, treedef = flatten_target(target)
    by_path = {leaf.path: leaf for leaf in manifest.leaves}
    missing = [path for path, _ in flat if path not in by_path]
    if missing:
        raise NotCovered(f"step {manifest.step} has no leaf {missing[0]}")
    if not partial and len(flat) != len(by_path):
        raise NotCovered(f"the target names {len(flat)} leaves, step {manifest.step} holds {len(by_path)}")
    values = []
    for i, (path, value) in enumerate(flat):
        out = reader.value(by_path[path], value)
        if isinstance(out, _Reshard):
            reshards.append((i, out.array, out.sharding))
        values.append(out)
    return values, lambda v: unflatten_target(treedef, v)


@dataclass(frozen=True)
class _Reshard:
    """An array read in its saved layout, to be put on the target's sharding once every process has read."""

    array: jax.Array
    sharding: Any


def saved_sharding(leaf: LocalLeaf) -> jax.sharding.NamedSharding | None:
    """The ``NamedSharding`` ``leaf`` was saved with, on this job's devices (None: none recorded, or a
    device it names is not in this job)."""
    record = leaf.sharding
    if record is None:
        return None
    by_id = {d.id: d for d in jax.devices()}
    if not all(i in by_id for i in record["devices"]):
        return None
    devices = np.array([by_id[i] for i in record["devices"]], dtype=object).reshape(record["mesh"])
    types = tuple(getattr(jax.sharding.AxisType, t) for t in record["types"])
    mesh = jax.sharding.Mesh(devices, tuple(record["axes"]), axis_types=types)
    spec = [tuple(e) if isinstance(e, list) else e for e in record["spec"]]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _map(path: Path, size: int) -> np.ndarray:
    """The data file as bytes: a private mapping of its pages (no copy: a box becomes its host
    array, which the CPU backend may adopt as the device array; copy-on-write, so neither side
    ever changes the other). Data files are never written again once their manifest is in place:
    a step saved again gets a new file."""
    if size == 0:
        return np.zeros(0, np.uint8)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # a data file linked out of the tier is never read
    try:  # writable (a donated buffer may be written in place), never populated:
        # populating a writable private mapping would copy every page; reading faults them in shared
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return np.frombuffer(mapped, np.uint8)


class _Reader:
    """Reads saved boxes from the data file, each once, checking its crc32c."""

    def __init__(self, path: Path, manifest: LocalManifest, data: np.ndarray | None = None) -> None:
        self.path = path
        self.manifest = manifest
        self.data = _map(path, manifest.data_size) if data is None else data
        self.boxes: dict[tuple[str, int], np.ndarray] = {}

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.data = np.zeros(0, np.uint8)  # the arrays made from it keep the mapping alive

    def raw(self, leaf: LocalLeaf, box: LocalBox) -> np.ndarray:
        """A saved box's bytes as its dtype and shape (checked once per restore)."""
        key = (leaf.path, box.offset)
        if key not in self.boxes:
            buffer = self.data[box.offset : box.offset + box.length]
            if buffer.size != box.length:
                raise NotCovered(f"{self.path} is shorter than its manifest says (leaf {leaf.path})")
            if crc32c(buffer) != box.crc32c:
                raise NotCovered(f"{self.path}: leaf {leaf.path}'s box at {box.start} fails its crc32c")
            dtype = dtype_from_name(leaf.dtype or "uint8")
            assert dtype is not None
            self.boxes[key] = buffer.view(dtype).reshape(box.shape)
        return self.boxes[key]

    def box(self, leaf: LocalLeaf, start: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        """The global box ``start``/``shape`` of ``leaf``, from the saved boxes that hold it (disjoint:
        :func:`~objckpt.manager.local_format.parse_local_manifest` refuses overlapping ones, so
        the volume they cover is whole exactly when it adds up)."""
        for saved in leaf.boxes:
            if saved.start == start and saved.shape == shape:
                return self.raw(leaf, saved)
        for saved in leaf.boxes:
            if saved.contains(start, shape):
                region = tuple(slice(s - s0, s - s0 + n) for s, s0, n in zip(start, saved.start, shape))
                return np.ascontiguousarray(self.raw(leaf, saved)[region])
        dtype = dtype_from_name(leaf.dtype or "uint8")
        assert dtype is not None
        out = np.empty(shape, dtype)
        covered = 0
        for saved in leaf.boxes:  # a leaf's saved boxes are disjoint: the pieces of one sharding
            lo = [max(s, s0) for s, s0 in zip(start, saved.start)]
            hi = [min(s + n, s0 + n0) for s, n, s0, n0 in zip(start, shape, saved.start, saved.shape)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            source = tuple(slice(a - s0, b - s0) for a, b, s0 in zip(lo, hi, saved.start))
            out[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))] = self.raw(leaf, saved)[source]
            covered += math.prod(b - a for a, b in zip(lo, hi))
        if covered == math.prod(shape):
            return out
        raise NotCovered(f"leaf {leaf.path}: no box saved here holds the box at {list(start)} of shape {list(shape)}")

    def whole(self, leaf: LocalLeaf) -> np.ndarray:
        return self.box(leaf, (0,) * len(leaf.shape), leaf.shape)

    def value(self, leaf: LocalLeaf, target: Any) -> Any:
        kind = leaf.kind
        if kind == "array":
            return self.array(leaf, target)
        if kind in ("none", "int", "bool"):
            out: Any = leaf.value
        elif kind == "float":
            out = float(leaf.value)
        elif kind == "json":
            out = leaf.value
        elif kind == "per_process":
            if type(target) is PerProcess and target.all:
                raise NotCovered(f"leaf {leaf.path}: PerProcess(all=True) needs every process's value")
            if self.manifest.process_count != jax.process_count():
                raise NotCovered(
                    f"leaf {leaf.path}: a per-process value saved by {self.manifest.process_count} processes"
                )
            data = self.whole(leaf).tobytes() if leaf.boxes else b""
            out = decode_value(data, leaf.value["encoding"])
        elif kind == "str":
            out = self.whole(leaf).tobytes().decode() if leaf.boxes else ""
        elif kind == "bytes":
            out = self.whole(leaf).tobytes() if leaf.boxes else b""
        else:  # ndarray
            out = self.whole(leaf).copy()
        return load_into(target, out) if is_item(target) else out

    def array(self, leaf: LocalLeaf, target: Any) -> Any:
        sharding = getattr(target, "sharding", None)
        if sharding is None or not isinstance(sharding, jax.sharding.Sharding):
            if isinstance(target, jax.ShapeDtypeStruct) or leaf.prng_impl:
                raise NotCovered(f"leaf {leaf.path}: a target without a sharding")
            return self.whole(leaf).copy()
        key_shape = leaf.shape[:-1] if leaf.prng_impl else leaf.shape
        if tuple(target.shape) != key_shape:
            raise NotCovered(f"leaf {leaf.path}: the target's shape {tuple(target.shape)} is not {key_shape}")
        if leaf.prng_impl:
            if not jax.dtypes.issubdtype(target.dtype, jax.dtypes.prng_key):
                raise NotCovered(f"leaf {leaf.path}: a PRNG key restored as {target.dtype}")
            if not isinstance(sharding, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding)):
                raise NotCovered(f"leaf {leaf.path}: a PRNG key onto a {type(sharding).__name__}")
        elif np.dtype(target.dtype) != dtype_from_name(leaf.dtype or ""):
            raise NotCovered(f"leaf {leaf.path}: saved as {leaf.dtype}, the target is {target.dtype}")
        shape = leaf.shape
        saved = None if leaf.prng_impl or self.manifest.process_count != jax.process_count() else saved_sharding(leaf)
        if saved is not None and not sharding.is_equivalent_to(saved, len(shape)):  # the same answer everywhere
            if set(sharding.device_set) != set(saved.device_set):
                raise NotCovered(f"leaf {leaf.path}: the target's devices are not the ones it was saved on")
            return _Reshard(self.placed(leaf, saved), sharding)
        return self.placed(leaf, sharding)

    def placed(self, leaf: LocalLeaf, sharding: Any) -> Any:
        """``leaf`` on ``sharding`` from the boxes saved here (no collective), a PRNG key wrapped."""
        shape = leaf.shape
        arrays = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            start, stop = index_to_box(index, shape)
            box_shape = tuple(b - a for a, b in zip(start, stop))
            arrays.append(jax.device_put(self.box(leaf, tuple(start), box_shape), device))
        out = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
        if leaf.prng_impl:
            return jax.random.wrap_key_data(out, impl=leaf.prng_impl)
        return out
