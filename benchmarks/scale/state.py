"""The 405B- or 1T-shaped state as ShapeDtypeStructs (no data), and the meshes it is saved from and restored onto.

The state is saved from ``fsdp × tensor=8`` over N forced CPU devices, host h owning devices
4h..4h+3. Each restore target names its mesh (shape, axes, which axis is the minor device axis),
the devices per restoring host, and whether it restores the params only or swaps the axes of
every layer matrix (issue #54's target meshes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEVICES_PER_HOST = 4

# (d_model, gated ffn, vocab, layers, heads, kv heads, head dim) of each model bench_scale can save.
MODELS = {
    "405b": (16384, 53248, 128256, 126, 128, 8, 128),  # Llama-3-405B
    "1t": (24576, 81920, 128256, 128, 192, 192, 128),  # ~1.08T parameters, full multi-head attention
}
D_MODEL, FFN, VOCAB, LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM = MODELS["405b"]
COPIES = (("params", "bfloat16"), ("master", "float32"), ("mu", "float32"), ("nu", "float32"))
LAYOUTS = ("unstacked", "stacked")


@dataclass(frozen=True)
class Target:
    """One restore target: its mesh, how its devices fall to hosts, and what it restores."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...] = ("fsdp", "tensor")
    minor: str = "tensor"  # the mesh axis along which device ids are consecutive
    devices_per_host: int = DEVICES_PER_HOST
    swapped: bool = False  # every layer matrix's two mesh axes swapped: P(fsdp, tensor) <-> P(tensor, fsdp)
    params_only: bool = False
    cpu_limit_s: float = 2.0  # issue #54's parse + plan limit per host

    @property
    def devices(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def hosts(self) -> int:
        return max(1, self.devices // self.devices_per_host)


TARGETS = ("same", "tensor16", "tensor16_fsdp_minor", "swapped", "data3", "half", "params_1x8", "params_8x8")

TARGET_TEXT = {
    "same": "same mesh",
    "tensor16": "tensor=16, tensor minor",
    "tensor16_fsdp_minor": "tensor=16, fsdp minor",
    "swapped": "layer matrices' axes swapped",
    "data3": "data=3 × fsdp × tensor=8 (¾ of the devices)",
    "half": "half the devices (fsdp/2 × 8)",
    "params_1x8": "params only, 1 host × 8 devices",
    "params_8x8": "params only, 8 hosts × 8 devices",
}


def targets_at(n: int) -> dict[str, Target | None]:
    """Each target at ``n`` saving devices; None where it does not fit."""
    return {
        "same": Target("same", (max(1, n // 8), 8)),
        "tensor16": Target("tensor16", (n // 16, 16)) if n >= 16 else None,
        "tensor16_fsdp_minor": Target("tensor16_fsdp_minor", (n // 16, 16), minor="fsdp") if n >= 16 else None,
        "swapped": Target("swapped", (max(1, n // 8), 8), swapped=True),
        "data3": Target("data3", (3, n // 32, 8), axes=("data", "fsdp", "tensor")) if n >= 32 else None,
        "half": Target("half", (n // 16, 8) if n >= 16 else (1, 4)),
        "params_1x8": Target("params_1x8", (1, 8), devices_per_host=8, params_only=True),
        "params_8x8": Target("params_8x8", (8, 8), devices_per_host=8, params_only=True) if n >= 64 else None,
    }


def use_model(name: str) -> None:
    """Make ``name`` (a key of :data:`MODELS`) the state every function here builds (one model a process)."""
    global D_MODEL, FFN, VOCAB, LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM
    D_MODEL, FFN, VOCAB, LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM = MODELS[name]


def layer_matrices(swapped: bool = False) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Per layer: each weight's shape and MaxText-like partition spec (mesh axes 'fsdp', 'tensor');
    ``swapped``: each matrix's two mesh axes swapped."""
    q, kv = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    out: dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]] = {
        "wq": ((D_MODEL, q), ("fsdp", "tensor")),
        "wk": ((D_MODEL, kv), ("fsdp", "tensor")),
        "wv": ((D_MODEL, kv), ("fsdp", "tensor")),
        "wo": ((q, D_MODEL), ("tensor", "fsdp")),
        "w1": ((D_MODEL, FFN), ("fsdp", "tensor")),
        "w3": ((D_MODEL, FFN), ("fsdp", "tensor")),
        "w2": ((FFN, D_MODEL), ("tensor", "fsdp")),
        "attn_norm": ((D_MODEL,), ()),
        "ffn_norm": ((D_MODEL,), ()),
    }
    if swapped:
        out = {name: (shape, spec[::-1]) for name, (shape, spec) in out.items()}
    return out


def model_tree(mesh: Any, dtype: Any, layout: str, layers: int, swapped: bool = False) -> dict[str, Any]:
    """One copy of the model as ShapeDtypeStructs on ``mesh`` (no data)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def leaf(shape: tuple[int, ...], spec: tuple[str | None, ...]) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))

    matrices = layer_matrices(swapped)
    if layout == "unstacked":
        stack: Any = [{name: leaf(shape, spec) for name, (shape, spec) in matrices.items()} for _ in range(layers)]
    else:  # nn.scan: a leading layer axis, never sharded
        stack = {name: leaf((layers, *shape), (None, *spec)) for name, (shape, spec) in matrices.items()}
    return {
        "embed": leaf((VOCAB, D_MODEL), ("tensor", "fsdp")),
        "layers": stack,
        "final_norm": leaf((D_MODEL,), ()),
        "lm_head": leaf((D_MODEL, VOCAB), ("fsdp", "tensor")),
    }


def state_tree(mesh: Any, layout: str, layers: int, swapped: bool = False) -> dict[str, Any]:
    import jax.numpy as jnp

    return {name: model_tree(mesh, getattr(jnp, dtype), layout, layers, swapped) for name, dtype in COPIES}


def make_mesh(shape: tuple[int, ...], axes: tuple[str, ...] = ("fsdp", "tensor"), minor: str = "tensor") -> Any:
    """A mesh over the first prod(shape) devices by id; consecutive ids are consecutive ``minor`` indices
    (then the other axes in order, the last fastest)."""
    import jax
    import numpy as np

    count = int(np.prod(shape))
    devices = np.array(sorted(jax.devices(), key=lambda d: d.id)[:count])
    order = [a for a in axes if a != minor] + [minor]
    grid = devices.reshape([shape[axes.index(a)] for a in order])
    return jax.sharding.Mesh(grid.transpose([order.index(a) for a in axes]), axes)


def target_leaves(target: Target, layout: str, layers: int) -> dict[int, Any]:
    """The restore target of each leaf it restores, by leaf index in the saved state's order."""
    from objckpt.core.tree import flatten

    mesh = make_mesh(target.shape, target.axes, target.minor)
    leaves, _ = flatten(state_tree(mesh, layout, layers, swapped=target.swapped))
    return {
        i: leaf.value for i, leaf in enumerate(leaves) if not target.params_only or leaf.path.startswith("['params']")
    }
