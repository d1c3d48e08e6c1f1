"""One process of a multi-process test (see tests/multiprocess.py).

Reads its job from OBJCKPT_MP_JOB, runs it, prints ``RESULT <json>`` and leaves
with ``os._exit`` so a failed peer can never hold it in JAX's shutdown barrier.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt

PROCESS = int(os.environ.get("OBJCKPT_MP_PROCESS", "0"))
COUNT = int(os.environ.get("OBJCKPT_MP_COUNT", "1"))
JOB: dict[str, Any] = json.loads(os.environ.get("OBJCKPT_MP_JOB", "{}"))

# name: (shape, dtype, spec as a list per dimension: axis name, list of names, or None)
LEAVES = {
    "w": ((256, 512), "float32", [None, "model"]),
    "emb": ((512, 128), "bfloat16", ["model", None]),
    "ffn": ((128, 1024), "float32", ["data", "model"]),
    "bias": ((1024,), "float32", [None]),
    "scale": ((64, 64), "int8", [None, None]),
}


def shape_of(name: str) -> tuple[int, ...]:
    """The leaf's shape, its first dimension scaled by the job's ``scale`` (benchmarks use big ones)."""
    shape = LEAVES[name][0]
    return (shape[0] * int(JOB.get("scale", 1)), *shape[1:])


def global_value(name: str) -> np.ndarray:
    _, dtype, _ = LEAVES[name]
    shape = shape_of(name)
    seed = sum(map(ord, name))
    values = (np.arange(int(np.prod(shape)), dtype=np.float64) * 0.37 + seed) % 251 - 125
    return values.reshape(shape).astype(jnp.dtype(dtype))


def spec_for(name: str, mesh: jax.sharding.Mesh, remap: dict[str, Any]) -> P:
    parts = []
    for entry in LEAVES[name][2]:
        entry = remap.get(entry, entry) if isinstance(entry, str) else entry
        if isinstance(entry, str) and entry not in mesh.shape:
            entry = None
        parts.append(tuple(entry) if isinstance(entry, list) else entry)
    return P(*parts)


def mesh_of(job: dict[str, Any]) -> jax.sharding.Mesh:
    return jax.make_mesh(tuple(job["mesh"]), tuple(job["axes"]))


def make_tree(job: dict[str, Any]) -> dict[str, Any]:
    mesh = mesh_of(job)
    remap = job.get("remap", {})
    params = {}
    for name in LEAVES:
        host = global_value(name)
        sharding = NamedSharding(mesh, spec_for(name, mesh, remap))
        params[name] = jax.make_array_from_callback(host.shape, sharding, lambda idx, host=host: host[idx])
    return {"params": params, "step": 42, "host": np.arange(10, dtype=np.int32), "note": "multi-host"}


def target_tree(job: dict[str, Any]) -> dict[str, Any]:
    mesh = mesh_of(job)
    remap = job.get("remap", {})
    params = {
        name: jax.ShapeDtypeStruct(
            shape_of(name), jnp.dtype(dtype), sharding=NamedSharding(mesh, spec_for(name, mesh, remap))
        )
        for name, (_, dtype, _) in LEAVES.items()
    }
    return {"params": params, "step": 0, "host": None, "note": ""}


def check(restored: dict[str, Any], target: dict[str, Any]) -> list[str]:
    """Leaves whose local shards differ from the expected global value (or land on the wrong sharding)."""
    bad = []
    for name in LEAVES:
        array = restored["params"][name]
        expected = global_value(name)
        if array.sharding != target["params"][name].sharding:
            bad.append(f"{name}: sharding")
        for shard in array.addressable_shards:
            if np.asarray(shard.data).tobytes() != expected[shard.index].tobytes():
                bad.append(f"{name}: shard {shard.index} on {shard.device}")
    if restored["step"] != 42 or restored["note"] != "multi-host" or not (restored["host"] == np.arange(10)).all():
        bad.append("non-array leaves")
    return bad


def options(job: dict[str, Any]) -> objckpt.Options:
    return objckpt.Options(**job.get("options", {}))


def run() -> dict[str, Any]:
    kind = JOB["kind"]
    so = JOB.get("storage_options") or {}
    if kind == "save":
        tree = jax.block_until_ready(make_tree(JOB))
        started = time.perf_counter()
        handle = objckpt.save_async(JOB["url"], tree, storage_options=so, options=options(JOB))
        handle.result()
        seconds = time.perf_counter() - started
        return {
            "bytes_written": handle.stats.bytes_written,
            "objects": handle.stats.objects_written,
            "seconds": seconds,
        }
    if kind == "restore":
        stats = objckpt.TransferStats()
        target = target_tree(JOB)
        started = time.perf_counter()
        restored = objckpt.restore(
            JOB["url"],
            target,
            storage_options=so,
            read_once=JOB.get("read_once", False),
            options=options(JOB),
            stats=stats,
        )
        seconds = time.perf_counter() - started
        return {"bytes_read": stats.bytes_read, "mismatches": check(restored, target), "seconds": seconds}
    if kind == "save_with_victim":
        mgr = objckpt.CheckpointManager(JOB["url"], storage_options=so, options=options(JOB))
        mgr.save(1, make_tree(JOB), wait=True)
        if PROCESS == JOB["victim"]:
            mgr.save(2, make_tree(JOB))  # blocking phase done, upload under way ...
            os.kill(os.getpid(), signal.SIGKILL)  # ... and this process dies
        started = time.monotonic()
        try:
            mgr.save(2, make_tree(JOB), wait=True)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}
        return {"error": None, "seconds": time.monotonic() - started}
    raise ValueError(f"unknown job kind {kind!r}")


def main() -> None:
    if COUNT > 1:  # before any other JAX call
        jax.distributed.initialize(
            f"127.0.0.1:{os.environ['OBJCKPT_MP_PORT']}",
            num_processes=COUNT,
            process_id=PROCESS,
            initialization_timeout=60,
            heartbeat_timeout_seconds=JOB.get("heartbeat_timeout", 60),
            shutdown_timeout_seconds=10,
        )
    try:
        result = run()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    if COUNT > 1 and JOB["kind"] != "save_with_victim":
        # Process 0 hosts the coordination service: leaving before the others are done kills them.
        from objckpt.multihost import get_coordinator

        get_coordinator().barrier("mp_worker/exit", timeout=60)
    os._exit(0)


if __name__ == "__main__":
    main()
