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

# name: (shape, dtype, spec as a list per dimension: axis name, list of names, or None).
# A job may bring its own as ``leaves`` (the same, as JSON); ``extras: false`` leaves
# out the non-array leaves (and the host numpy array, which process 0 writes).
LEAVES = {
    "w": ((256, 512), "float32", [None, "model"]),
    "emb": ((512, 128), "bfloat16", ["model", None]),
    "ffn": ((128, 1024), "float32", ["data", "model"]),
    "bias": ((1024,), "float32", [None]),
    "scale": ((64, 64), "int8", [None, None]),
}
if "leaves" in JOB:
    LEAVES = {name: (tuple(shape), dtype, spec) for name, (shape, dtype, spec) in JOB["leaves"].items()}
EXTRAS = bool(JOB.get("extras", True))


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
    if "devices" in job:  # these devices, in mesh order: [process, k] is that process's k-th device by id
        local = {
            p: sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(COUNT)
        }
        devices = np.array([local[p][k] for p, k in job["devices"]]).reshape(job["mesh"])
        return jax.sharding.Mesh(devices, tuple(job["axes"]))
    if job.get("minor_first"):  # the other device order: the first mesh axis minor in the device list
        shape = tuple(job["mesh"])
        devices = np.array(jax.devices()).reshape(shape[::-1]).T
        return jax.sharding.Mesh(devices, tuple(job["axes"]))
    return jax.make_mesh(tuple(job["mesh"]), tuple(job["axes"]))


def make_tree(job: dict[str, Any]) -> dict[str, Any]:
    mesh = mesh_of(job)
    remap = job.get("remap", {})
    params = {}
    for name in LEAVES:
        host = global_value(name)
        sharding = NamedSharding(mesh, spec_for(name, mesh, remap))
        params[name] = jax.make_array_from_callback(host.shape, sharding, lambda idx, host=host: host[idx])
    if not EXTRAS:
        return {"params": params}
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
    if not EXTRAS:
        return {"params": params}
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
    if not EXTRAS:
        return bad
    if restored["step"] != 42 or restored["note"] != "multi-host" or not (restored["host"] == np.arange(10)).all():
        bad.append("non-array leaves")
    return bad


def options(job: dict[str, Any]) -> objckpt.Options:
    given = dict(job.get("options", {}))
    if "retry" in given:  # RetryConfig's fields, as JSON
        given["retry"] = objckpt.RetryConfig(**given["retry"])
    return objckpt.Options(**given)


class CountingClient:
    """Wraps JAX's coordination client and counts the bytes objckpt sends it and gets back."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.sent = 0
        self.received = 0
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.sent += sum(_size(a) for a in (*args, *kwargs.values()))
            out = attr(*args, **kwargs)
            self.received += _size(out)
            return out

        return call

    def snapshot(self) -> dict[str, Any]:
        return {"sent": self.sent, "received": self.received, "calls": dict(self.calls)}


def _size(value: Any) -> int:
    """Bytes of a key, a value, or a directory listing ((key, value) pairs); 0 for numbers."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 0


def count_coordination() -> CountingClient:
    """Route every coordinator objckpt makes through one counting client (call after initialize)."""
    from jax._src import distributed

    from objckpt import multihost

    counting = CountingClient(distributed.global_state.client)
    original = multihost._JaxCoordinator.__init__

    def init(self: Any, client: Any, process_index: int, process_count: int) -> None:
        original(self, counting, process_index, process_count)

    multihost._JaxCoordinator.__init__ = init  # type: ignore[method-assign]
    return counting


def count_index_reads() -> list[int]:
    """The processes whose index objects this process fetches and parses, in order."""
    from objckpt.layouts import manifest_io

    read: list[int] = []
    original = manifest_io.parse_index
    original3 = manifest_io.read_index3

    def parse(data: bytes, manifest: Any, process: int, **kwargs: Any) -> Any:
        read.append(process)
        return original(data, manifest, process, **kwargs)

    async def read3(store: Any, manifest: Any, process: int, *args: Any, **kwargs: Any) -> Any:  # format v3
        read.append(process)
        return await original3(store, manifest, process, *args, **kwargs)

    manifest_io.parse_index = parse  # type: ignore[assignment]
    manifest_io.read_index3 = read3  # type: ignore[assignment]
    return read


def leftover_keys(label: str) -> list[str]:
    """objckpt's keys in the coordination service once every process has reached ``label``."""
    if COUNT == 1:
        return []
    from jax._src import distributed

    from objckpt.multihost import get_coordinator

    coordinator = get_coordinator()
    coordinator.barrier(f"mp_probe/{label}", timeout=60)  # outside objckpt/: its keys are not counted
    keys = sorted(k for k, _ in distributed.global_state.client.key_value_dir_get("objckpt/"))
    coordinator.barrier(f"mp_probe/{label}/read", timeout=60)  # nobody starts the next operation before
    return keys


def save(counting: CountingClient | None) -> dict[str, Any]:
    tree = jax.block_until_ready(make_tree(JOB))
    before = counting.snapshot() if counting else None
    started = time.perf_counter()
    so = JOB.get("storage_options_of", {}).get(str(PROCESS)) or JOB.get("storage_options") or {}  # per process
    handle = objckpt.save_async(JOB["url"], tree, storage_options=so, options=options(JOB))
    handle.result()
    seconds = time.perf_counter() - started
    result: dict[str, Any] = {
        "bytes_written": handle.stats.bytes_written,
        "objects": handle.stats.objects_written,
        "seconds": seconds,
    }
    if counting and before:
        after = counting.snapshot()
        result["coordination"] = {
            "sent": after["sent"] - before["sent"],
            "received": after["received"] - before["received"],
            "calls": {k: n - before["calls"].get(k, 0) for k, n in after["calls"].items()},
        }
    if JOB.get("probe_keys"):
        result["leftover_keys"] = leftover_keys("saved")
    return result


def restore() -> dict[str, Any]:
    indexes = count_index_reads() if JOB.get("count_indexes") else None
    from objckpt.restoring import api, read_sharding

    if JOB.get("fail_fetch") == PROCESS:  # this process's reads fail: the others must not wait in a collective

        async def broken(*args: Any, **kwargs: Any) -> None:
            raise OSError("injected fetch failure")

        api.fetch = broken  # type: ignore[assignment]
    if "reshard_min_saved" in JOB:  # the floor under which a leaf is read directly (tests' leaves are small)
        read_sharding.RESHARD_MIN_SAVED = JOB["reshard_min_saved"]
    read_axes: list[list[str]] = []  # per resharded leaf, its read mesh's axis names
    plan_reads = api.plan_read_shardings

    def planned(*args: Any, **kwargs: Any) -> Any:
        out = plan_reads(*args, **kwargs)
        for _, read in sorted(out.items()):
            assert read.choice.read_mesh is not None
            read_axes.append([a for a, _ in read.choice.read_mesh.axes])
        return out

    if JOB.get("count_needed"):
        api.plan_read_shardings = planned  # type: ignore[assignment]
    stats = objckpt.TransferStats()
    target = target_tree(JOB)
    started = time.perf_counter()
    restored = objckpt.restore(
        JOB["url"],
        target,
        storage_options=JOB.get("storage_options_of", {}).get(str(PROCESS)) or JOB.get("storage_options") or {},
        read_once=JOB.get("read_once", False),
        replicas=[objckpt.Location(url, opts) for url, opts in JOB.get("replicas", [])],
        options=options(JOB),
        stats=stats,
    )
    seconds = time.perf_counter() - started
    result: dict[str, Any] = {"bytes_read": stats.bytes_read, "mismatches": check(restored, target), "seconds": seconds}
    if JOB.get("count_needed"):  # bytes this process's target boxes hold (each box once), and the reshard's
        result["needed_bytes"] = needed_bytes(restored["params"])
        result["boxes"] = needed_boxes(restored["params"])
        result["device_bytes_moved"] = stats.device_bytes_moved
        result["read_axes"] = read_axes
    if JOB.get("replicas"):
        result["bytes_by_location"] = stats.bytes_by_location
    if indexes is not None:
        result["indexes_read"] = indexes
    if JOB.get("probe_keys"):
        result["leftover_keys"] = leftover_keys("restored")
    return result


def needed_bytes(params: dict[str, Any]) -> int:
    """Bytes of the distinct boxes the addressable shards of ``params`` hold (boxes do not overlap
    unless equal: a NamedSharding's)."""
    total = 0
    for array in params.values():
        boxes = {tuple((s.start, s.stop) for s in shard.index): shard.data.nbytes for shard in array.addressable_shards}
        total += sum(boxes.values())
    return total


def needed_boxes(params: dict[str, Any]) -> dict[str, list[list[list[int]]]]:
    """Per leaf, the distinct boxes (starts, stops) this process's addressable shards hold."""
    out = {}
    for name, array in params.items():
        boxes = {
            tuple((s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(shard.index, array.shape))
            for shard in array.addressable_shards
        }
        out[name] = [[[a for a, _ in box], [b for _, b in box]] for box in sorted(boxes)]
    return out


def peer_copy_restore(so: dict[str, Any]) -> dict[str, Any]:
    """Steps 1 and 2 saved to the local tier (``JOB["local"]``) by a manager with ``peers=1``; then
    process ``JOB["victim"]``'s own local step 2 deleted, and a new manager restores the newest step
    (tests/test_matrix.py's peer copy): the step, the tier it came from, and the leaves that differ
    on the saved grid and on another (the job's ``other_remap``)."""
    import shutil
    from pathlib import Path

    from objckpt.multihost import get_coordinator

    kwargs = {"storage_options": so, "options": options(JOB), "local": objckpt.LocalCopies(JOB["local"], peers=1)}
    with objckpt.CheckpointManager(
        JOB["url"], save_rules=objckpt.SavePolicy(save_interval_steps=1000), **kwargs
    ) as mgr:
        for step in (1, 2):
            mgr.save(step, make_tree(JOB))
    if PROCESS == JOB["victim"]:
        shutil.rmtree(Path(JOB["local"]) / f"process_{PROCESS}" / "step_0000000002")
    get_coordinator().barrier("mp_worker/peer_copy_restore", timeout=60)
    with objckpt.CheckpointManager(JOB["url"], **kwargs) as mgr:
        step = mgr.latest_step()
        target, other = target_tree(JOB), target_tree({**JOB, "remap": JOB["other_remap"]})
        restored = mgr.restore(step, target)
        tier = mgr.tier_status().last_restore.tier  # type: ignore[union-attr]
        again = mgr.restore(step, other)
    return {"step": step, "tier": tier, "mismatches": check(restored, target), "other_mismatches": check(again, other)}


def run() -> dict[str, Any]:
    kind = JOB["kind"]
    so = JOB.get("storage_options") or {}
    counting = count_coordination() if JOB.get("count_coordination") and COUNT > 1 else None
    if kind == "save" and not JOB.get("report_errors"):
        result = save(counting)
        if JOB.get("restore_after"):  # the same processes read it back (keys: a second operation tag)
            result["restore"] = restore()
        return result
    if kind in ("save", "restore") and JOB.get("report_errors"):  # the error as the result: every process exits
        started = time.monotonic()
        try:
            return save(counting) if kind == "save" else restore()
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}
    if kind == "restore":
        return restore()
    if kind == "peer_copy_restore":
        return peer_copy_restore(so)
    if kind == "orbax_save":  # what Orbax itself writes from several processes (tests/test_orbax_restore.py)
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(JOB["path"], make_tree(JOB))
        checkpointer.wait_until_finished()
        return {"saved": JOB["path"]}
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
    if kind == "training_loop":  # CheckpointManager's save policies and preemption (tests/preempt_worker.py)
        from preempt_worker import training_loop

        return training_loop(JOB, PROCESS)
    raise ValueError(f"unknown job kind {kind!r}")


def wait_for_survivors(timeout: float = 30) -> None:
    """After a peer died: process 0 hosts the coordination service, so it stays until every
    other survivor has printed its result (each says so in the key-value store), or ``timeout``."""
    from jax._src import distributed

    client = distributed.global_state.client
    try:
        if PROCESS != 0:
            client.key_value_set(f"mp_worker/done/{PROCESS}", "1")
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(client.key_value_dir_get("mp_worker/done/")) >= COUNT - 2:  # all but this one and the victim
                return
            time.sleep(0.1)
    except Exception:  # the service is failing: nothing to wait for
        pass


def main() -> None:
    if "cpu_collectives" in JOB:  # JAX's CPU collectives (gloo by default), or none: a test's choice, never objckpt's
        jax.config.update("jax_cpu_collectives_implementation", JOB["cpu_collectives"])
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
    if COUNT > 1 and JOB["kind"] == "save_with_victim":
        wait_for_survivors()
    elif COUNT > 1 and JOB["kind"] == "training_loop":  # as a job ends: JAX's shutdown barrier, then disconnect
        jax.distributed.shutdown()
    elif COUNT > 1:
        # Process 0 hosts the coordination service: leaving before the others are done kills them.
        from objckpt.multihost import get_coordinator

        get_coordinator().barrier("mp_worker/exit", timeout=60)
    os._exit(0)


if __name__ == "__main__":
    main()
