"""Read-once restore: each unique byte leaves the store once, replicas get it over the devices.

When a target sharding replicates a box on devices of several processes (data
parallelism), a plain restore makes every process read it. Read-once cuts each
unique box into slabs along its leading axis (one per replica, each at least a
minimum size, as saves do) and *designates* one replica device per slab; only
that device's process reads the slab, every replica starts as zeros but for the
slabs it read, and one jitted ``psum`` over the replica mesh axes (on the bits,
as unsigned integers, so the sum of data and zeros is exact for every value,
-0.0 and NaN payloads included) gives every replica the whole box.

Every process computes the same designation from the shardings and the leaf
table alone (no messaging): slabs of a large box go round its replicas, and a
box too small to cut goes to the replica whose process has been given the
fewest bytes so far in this restore, so the bytes each process reads stay even
across leaves.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from objckpt.core.boxes import Box, index_to_box
from objckpt.core.writer_rule import leading_slabs, slab_count

_UINT_FOR_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def replica_axes(sharding: NamedSharding) -> tuple[str, ...]:
    """Mesh axes (of size > 1) that the spec does not use: the data is replicated along them."""
    used: set[str] = set()
    for entry in sharding.spec:
        if entry is None:
            continue
        used.update(entry if isinstance(entry, tuple) else (entry,))
    return tuple(str(a) for a, n in sharding.mesh.shape.items() if a not in used and n > 1)


def supported(sharding: Any, dtype: np.dtype) -> bool:
    """Read-once needs a NamedSharding replicated across processes and a bit-castable dtype."""
    if not isinstance(sharding, NamedSharding) or not replica_axes(sharding):
        return False
    if dtype == np.bool_:
        return True
    if dtype.kind == "c" or dtype.itemsize not in (1, 2, 4, 8):
        return False
    return not (dtype.itemsize == 1 and dtype.name in ("int4", "uint4", "int2", "uint2", "float4_e2m1fn"))


class Designator:
    """Designates, for one restore, which replica device reads each slab of each replicated box."""

    def __init__(self, min_slab: int) -> None:
        self.min_slab = min_slab
        self.load: dict[int, int] = defaultdict(int)  # bytes designated per process so far

    def designate(
        self, sharding: NamedSharding, shape: tuple[int, ...], itemsize: int
    ) -> dict[Box, list[tuple[Box, Any]]]:
        """For each unique box of ``sharding``: its slabs, each with the device that reads it.

        Call for the leaves of a restore in the same order on every process.
        """
        replicas: dict[Box, list[Any]] = defaultdict(list)
        for device, index in sharding.devices_indices_map(shape).items():
            replicas[index_to_box(index, shape)].append(device)
        chosen: dict[Box, list[tuple[Box, Any]]] = {}
        for box in sorted(replicas, key=lambda box: (-_volume(box), box)):
            devices = sorted(replicas[box], key=lambda d: d.id)
            parts = slab_count(box, itemsize, len(devices), self.min_slab)
            if parts == 1:
                device = min(devices, key=lambda d: (self.load[d.process_index], d.id))
                chosen[box] = [(box, device)]
            else:
                turn = sum(box[0]) + len(chosen)
                chosen[box] = [
                    (slab, devices[(turn + k) % len(devices)]) for k, slab in enumerate(leading_slabs(box, parts))
                ]
            for slab, device in chosen[box]:
                self.load[device.process_index] += _volume(slab) * itemsize
        return chosen


def _volume(box: Box) -> int:
    return math.prod(b - a for a, b in zip(*box))


def share(array: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Sum the replicas bitwise: the designated replica holds data, the others zeros."""
    return _sharer(sharding.mesh, sharding.spec, replica_axes(sharding), np.dtype(array.dtype).name)(array)


@functools.cache
def _sharer(mesh: Any, spec: P, axes: tuple[str, ...], dtype_name: str) -> Any:
    dtype = np.dtype(jnp.dtype(dtype_name))

    def body(x: jax.Array) -> jax.Array:
        if dtype == np.bool_:
            return jax.lax.psum(x.astype(jnp.uint8), axes).astype(jnp.bool_)
        if dtype.itemsize == 8:  # no 64-bit ints without x64: split into two uint32 words
            words = jax.lax.bitcast_convert_type(x, jnp.uint32)
            return jax.lax.bitcast_convert_type(jax.lax.psum(words, axes), x.dtype)
        uint = _UINT_FOR_SIZE[dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, uint)
        return jax.lax.bitcast_convert_type(jax.lax.psum(bits, axes), x.dtype)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
