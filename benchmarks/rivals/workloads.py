"""The trees every system saves and restores: built the same way in every process.

A workload is a list of :class:`LeafSpec` (path, shape, dtype, how it is sharded),
pure data, so the driver, the savers and the restorers agree on it without
exchanging arrays. Values come from a seeded generator per leaf, so a restoring
process can check what it read against a fingerprint the saving process wrote.

- ``small``: ~64 MiB in ~300 leaves: a 12-layer transformer (d=160) with its Adam
  state (mu, nu) and a step counter, like a small model's training state.
- ``medium``: ~1 GiB: 4 layers at d=1024 plus a large embedding, Adam state and a step.
- ``large``: ~4 GiB: 6 layers at d=2048 plus embedding, Adam state and a step.
- ``few``: 1 GiB in 16 large leaves of (4096, 4096) float32 and a step: a workload the
  project did not shape (few, large arrays; no small leaves, no packing).

2-D weights are sharded ``P("data", "model")`` over a (4, 2) mesh of 8 CPU
devices; 1-D scales and biases are replicated. The *resharded* target is a
(2, 4) mesh with other axis names, ``P("fsdp", "tensor")``: rows cut 2 ways and
columns 4 ways instead of 4 and 2, so every target box is a different shape from
every saved one and is assembled from parts of two saved shards. (Until
2026-11-29 the target was ``P("tensor", "fsdp")``, which cuts the same boxes and
only moves them to other devices.)
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

MiB = 1 << 20
GiB = 1 << 30

SAVE_MESH = ((4, 2), ("data", "model"))
RESHARD_MESH = ((2, 4), ("fsdp", "tensor"))


@dataclass(frozen=True)
class LeafSpec:
    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def name(self) -> str:
        return "/".join(self.path)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())


@dataclass(frozen=True)
class Workload:
    name: str
    leaves: tuple[LeafSpec, ...]
    step: int = 1000

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    @property
    def n_leaves(self) -> int:
        return len(self.leaves) + 1  # + the step counter


def _transformer(name: str, layers: int, d: int, target_bytes: int) -> Workload:
    """Params + Adam mu/nu of a ``layers``-deep, width-``d`` transformer; the embedding
    fills the rest of ``target_bytes``."""
    per_layer = [
        ("attn_qkv", (d, 3 * d)),
        ("attn_out", (d, d)),
        ("mlp_in", (d, 4 * d)),
        ("mlp_out", (4 * d, d)),
        ("ln1_scale", (d,)),
        ("ln1_bias", (d,)),
        ("ln2_scale", (d,)),
        ("ln2_bias", (d,)),
    ]
    layer_params = layers * sum(int(np.prod(s)) for _, s in per_layer) + 2 * d
    vocab = max(64, (target_bytes // 12 - layer_params) // d // 64 * 64)  # 3 float32 copies
    params: list[tuple[tuple[str, ...], tuple[int, ...]]] = [(("embed",), (vocab, d))]
    for i in range(layers):
        params += [((f"layer{i:02d}", leaf), shape) for leaf, shape in per_layer]
    params += [(("final_ln", "scale"), (d,)), (("final_ln", "bias"), (d,))]
    leaves = [LeafSpec(("params", *p), s) for p, s in params]
    for moment in ("mu", "nu"):
        leaves += [LeafSpec(("opt_state", moment, *p), s) for p, s in params]
    return Workload(name, tuple(leaves))


def get(name: str) -> Workload:
    if name == "small":
        return _transformer("small", layers=12, d=160, target_bytes=64 * MiB)
    if name == "medium":
        return _transformer("medium", layers=4, d=1024, target_bytes=1 * GiB)
    if name == "large":
        return _transformer("large", layers=6, d=2048, target_bytes=4 * GiB)
    if name == "few":
        return Workload("few", tuple(LeafSpec(("params", f"w{i:02d}"), (4096, 4096)) for i in range(16)))
    raise ValueError(f"unknown workload {name!r} (small, medium, large, few)")


NAMES = ("small", "medium", "large", "few")


# ----------------------------------------------------------------------------- values


def leaf_values(leaf: LeafSpec) -> np.ndarray:
    """The leaf's global value: uniform floats from a per-leaf seed (incompressible)."""
    rng = np.random.default_rng(leaf.seed)
    return rng.random(leaf.shape, dtype=np.float32).astype(leaf.dtype, copy=False)


def fingerprint(arrays: list[np.ndarray]) -> list[int]:
    """crc32 of each global array's bytes (C order)."""
    return [zlib.crc32(np.ascontiguousarray(a).data) for a in arrays]


def expected_fingerprint(workload: Workload) -> list[int]:
    return fingerprint([leaf_values(leaf) for leaf in workload.leaves])


# ----------------------------------------------------------------------------- JAX trees


def mesh(kind: str = "save") -> Any:
    import jax

    shape, axes = SAVE_MESH if kind == "save" else RESHARD_MESH
    return jax.make_mesh(shape, axes)


def sharding(leaf: LeafSpec, kind: str = "save", the_mesh: Any = None) -> Any:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m = the_mesh if the_mesh is not None else mesh(kind)
    if len(leaf.shape) != 2:
        return NamedSharding(m, P())
    return NamedSharding(m, P("data", "model") if kind == "save" else P("fsdp", "tensor"))


def nest(workload: Workload, values: list[Any], step: Any) -> dict:
    """Flat leaf values → the nested dict tree (plus ``step``)."""
    tree: dict = {}
    for leaf, value in zip(workload.leaves, values):
        node = tree
        for key in leaf.path[:-1]:
            node = node.setdefault(key, {})
        node[leaf.path[-1]] = value
    tree["step"] = step
    return tree


def flat(workload: Workload, tree: dict) -> list[Any]:
    out = []
    for leaf in workload.leaves:
        node = tree
        for key in leaf.path:
            node = node[key]
        out.append(node)
    return out


def jax_tree(workload: Workload) -> dict:
    """The concrete state, sharded over the save mesh (one leaf at a time, so the
    host copy of a leaf is freed before the next one is made)."""
    import jax

    m = mesh("save")
    values = []
    for leaf in workload.leaves:
        host = leaf_values(leaf)
        values.append(jax.device_put(host, sharding(leaf, "save", m)))
        del host
    jax.block_until_ready(values)
    return nest(workload, values, workload.step)


def abstract_tree(workload: Workload, kind: str = "save") -> dict:
    """Shapes, dtypes and shardings only: the target of a restore."""
    import jax

    m = mesh(kind)
    values = [
        jax.ShapeDtypeStruct(leaf.shape, np.dtype(leaf.dtype), sharding=sharding(leaf, kind, m))
        for leaf in workload.leaves
    ]
    return nest(workload, values, 0)
