"""One process of tests/test_keys_multiprocess.py: typed PRNG keys on a mesh that spans the processes.

The job (``url``, ``storage_options``) saves a tree of typed keys (JAX's default
implementation and ``rbg``), replicated and sharded over a mesh of every process's
devices, beside a sharded float array (what a Flax NNX model's state holds: its
``nnx.Rngs`` keep such keys), then restores it onto several targets on the same
processes. The result names, per target, each leaf whose restored keys differ from
the saved ones (bit for bit, through ``jax.random.key_data``), land on another
sharding or lose their implementation, and the error a target's restore raised.
"""

from __future__ import annotations

from typing import Any

import jax
import mp_worker
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt

PROCESS, COUNT, JOB = mp_worker.PROCESS, mp_worker.COUNT, mp_worker.JOB

# name: (seed, implementation (None: JAX's default), keys per split (None: one key), spec)
KEYS: dict[str, tuple[int, str | None, tuple[int, ...] | None, tuple[Any, ...]]] = {
    "rng": (7, None, None, ()),  # what nnx.Rngs holds: one key, replicated over the mesh
    "rng_rbg": (8, "rbg", None, ()),
    "per_device": (9, None, (8,), ("d",)),  # a key per example, sharded across the processes
    "per_device_rbg": (10, "rbg", (4, 3), ("d", None)),
    "replicated_batch": (11, None, (8,), (None,)),  # sharded in the flipped target
}


def global_keys(name: str) -> jax.Array:
    """The leaf's keys, made on this process alone (the values every target must restore)."""
    seed, impl, shape, _ = KEYS[name]
    key = jax.random.key(seed, impl=impl)
    if shape is None:
        return key
    return jax.random.split(key, int(np.prod(shape))).reshape(shape)


def weights() -> np.ndarray:
    return np.arange(64 * 8, dtype=np.float32).reshape(64, 8) * 0.5


def saved_tree(mesh: Mesh) -> dict[str, Any]:
    """The tree as training holds it: keys made by jitted code with ``out_shardings`` over ``mesh``."""
    tree: dict[str, Any] = {}
    for name, (_, _, _, spec) in KEYS.items():
        make = jax.jit(lambda name=name: global_keys(name), out_shardings=NamedSharding(mesh, P(*spec)))
        tree[name] = make()
    w = weights()
    tree["w"] = jax.make_array_from_callback(w.shape, NamedSharding(mesh, P("d", None)), lambda i: w[i])
    return tree


def abstract(mesh: Mesh, flip: bool = False) -> dict[str, Any]:
    """``jax.ShapeDtypeStruct`` targets over ``mesh`` (``flip``: each sharded key axis made replicated and
    each replicated one sharded, where the shape allows it)."""
    out: dict[str, Any] = {}
    for name, (_, _, shape, spec) in KEYS.items():
        keys = jax.eval_shape(lambda name=name: global_keys(name))
        if flip and shape is not None:
            spec = tuple(None if s else ("d" if n % mesh.shape["d"] == 0 else None) for s, n in zip(spec, shape))
        out[name] = jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=NamedSharding(mesh, P(*spec)))
    out["w"] = jax.ShapeDtypeStruct((64, 8), np.float32, sharding=NamedSharding(mesh, P(None, "d")))
    return out


def check(restored: dict[str, Any], target: dict[str, Any]) -> list[str]:
    """Leaves whose restored value differs from the saved one (see the module's docstring)."""
    bad = []
    for name in KEYS:
        value, want = restored[name], global_keys(name)
        if not isinstance(value, jax.Array) or not jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            bad.append(f"{name}: a {type(value).__name__} of {getattr(value, 'dtype', None)}, not typed keys")
            continue
        if str(jax.random.key_impl(value)) != str(jax.random.key_impl(want)):
            bad.append(f"{name}: implementation {jax.random.key_impl(value)}")
        if value.shape != want.shape:
            bad.append(f"{name}: shape {value.shape}")
            continue
        if value.sharding != target[name].sharding:
            bad.append(f"{name}: sharding {value.sharding}")
        data = np.asarray(jax.random.key_data(want))
        for shard in value.addressable_shards:
            got = np.asarray(jax.random.key_data(shard.data))
            if got.tobytes() != data[shard.index].tobytes():
                bad.append(f"{name}: shard {shard.index} on {shard.device}")
    w = restored["w"]
    if w.sharding != target["w"].sharding:
        bad.append("w: sharding")
    for shard in w.addressable_shards:
        if np.asarray(shard.data).tobytes() != weights()[shard.index].tobytes():
            bad.append(f"w: shard {shard.index} on {shard.device}")
    return bad


def run() -> dict[str, Any]:
    url, so = JOB["url"], JOB.get("storage_options") or {}
    mesh = Mesh(np.array(jax.devices()), ("d",))  # every process's devices
    local = Mesh(np.array(jax.local_devices()), ("d",))  # this process's only
    other = Mesh(np.array(jax.devices()[::-1]), ("d",))  # every process's, in the other order
    tree = saved_tree(mesh)
    objckpt.save(url, tree, storage_options=so)
    targets = {
        "the saved arrays": tree,
        "abstract, same sharding": abstract(mesh),
        "abstract, axes flipped": abstract(mesh, flip=True),
        "abstract, devices reversed": abstract(other),
        "abstract, this process's devices": abstract(local),
    }
    result: dict[str, Any] = {}
    for label, target in targets.items():
        try:
            result[label] = check(objckpt.restore(url, target, storage_options=so), target)
        except Exception as e:  # every process reports, so none waits for another at the exit
            result[label] = [f"{type(e).__name__}: {e}"]
    return result


if __name__ == "__main__":
    mp_worker.run = run  # type: ignore[assignment]
    mp_worker.main()
