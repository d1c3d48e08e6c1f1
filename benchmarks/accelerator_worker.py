"""One measurement of ``bench_accelerator`` in a fresh process: the floors, objckpt (three ways) or Orbax.

    python -m benchmarks.accelerator_worker < job.json      # prints ``RESULT <json>``

The driver (``benchmarks/bench_accelerator.py``) starts one process per measurement because one
process holds an accelerator at a time and each JAX process caches host copies on its arrays.
Everything here is platform-neutral: the state lives on ``jax.devices()[0]`` (a TPU chip, a GPU
or, in ``--quick``, the CPU), and every store is a local path (``file://`` on disk or tmpfs).

The state is a transformer's training state: bf16 params, then f32 master weights and Adam's two
moments of the same shapes (14 bytes per parameter), ``LAYERS`` layers of attention and MLP
matrices with their norms plus an embedding and a final norm: 4 × (8 × LAYERS + 2) leaves. Values
come from ``jax.random`` on the device, so building the state is cheap and untimed. A save is
checked after its restore by per-leaf fingerprints computed on the device (wrapping sums of the
bits), so a restore that brought back other bytes fails the run.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

GiB = 1 << 30
LAYERS = 14
BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 param, f32 master, Adam mu and nu


# ----------------------------------------------------------------------------- state


def shapes(state_gib: float) -> dict[str, tuple[int, ...]]:
    """One group's leaf shapes (params; master, mu and nu repeat them) for ``state_gib`` in all.

    d is solved from 12 d² per layer (4 d² attention, 8 d² MLP) plus an 8 d × d embedding, and
    rounded to a multiple of 128 (of 8 below d = 512)."""
    params = state_gib * GiB / BYTES_PER_PARAM
    d = math.sqrt(params / (12 * LAYERS + 8))
    step = 128 if d >= 512 else 8
    d = max(step, int(round(d / step)) * step)
    out: dict[str, tuple[int, ...]] = {"embed": (8 * d, d), "final_norm": (d,)}
    for i in range(LAYERS):
        for name in ("q", "k", "v", "o"):
            out[f"layer{i:02d}/attn_{name}"] = (d, d)
        out[f"layer{i:02d}/mlp_up"] = (d, 4 * d)
        out[f"layer{i:02d}/mlp_down"] = (4 * d, d)
        out[f"layer{i:02d}/norm_attn"] = (d,)
        out[f"layer{i:02d}/norm_mlp"] = (d,)
    return out


def build_state(state_gib: float, seed: int = 0) -> dict[str, dict[str, Any]]:
    """``{"params": bf16, "master": f32, "mu": f32, "nu": f32}``, each ``{leaf name: array}`` on device 0."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    key = jax.random.key(seed)
    groups = (("params", jnp.bfloat16), ("master", jnp.float32), ("mu", jnp.float32), ("nu", jnp.float32))
    state: dict[str, dict[str, Any]] = {}
    with jax.default_device(device):
        for g, (group, dtype) in enumerate(groups):
            state[group] = {}
            for i, (name, shape) in enumerate(shapes(state_gib).items()):
                k = jax.random.fold_in(key, g * 10_000 + i)
                state[group][name] = jax.random.normal(k, shape, jnp.float32).astype(dtype)
    return jax.block_until_ready(state)


def leaves(state: Any) -> list[Any]:
    import jax

    return list(jax.tree.leaves(state))


def fingerprints(state: Any) -> list[int]:
    """Per leaf, the wrapping uint32 sum of its bits, computed on the device."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def one(x: Any) -> Any:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16 if x.dtype == jnp.bfloat16 else jnp.uint32)
        return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)

    return [int(one(x)) for x in leaves(state)]


def abstract(state: Any) -> Any:
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def host_copy_attached(state: Any) -> bool:
    """Whether any array of ``state`` (or one of its shards' arrays) holds a cached host copy."""
    for x in leaves(state):
        if getattr(x, "_npy_value", None) is not None:
            return True
        if any(getattr(s.data, "_npy_value", None) is not None for s in x.addressable_shards):
            return True
    return False


# ----------------------------------------------------------------------------- memory, steps


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds on a thread; ``peak()`` since ``mark()``."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval, self._peak, self._stop = interval, rss_bytes(), threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = rss_bytes()
            with self._lock:
                self._peak = max(self._peak, rss)

    def mark(self) -> int:
        with self._lock:
            self._peak = rss_bytes()
            return self._peak

    def peak(self) -> int:
        with self._lock:
            return max(self._peak, rss_bytes())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Step:
    """A jitted training step of chained matmuls on device 0, sized to about ``target_s`` alone."""

    def __init__(self, target_s: float, dim: int) -> None:
        import jax
        import jax.numpy as jnp

        device = jax.devices()[0]
        self.x = jax.device_put(jnp.ones((dim, dim), jnp.bfloat16) / dim, device)
        self.w = jax.device_put(jnp.eye(dim, dtype=jnp.bfloat16), device)

        def make(n: int) -> Any:
            def body(_: int, x: Any) -> Any:
                return jnp.tanh(x @ self.w)

            return jax.jit(lambda x: jax.lax.fori_loop(0, n, body, x))

        probe = make(4)
        jax.block_until_ready(probe(self.x))
        t = min(self._time(probe) for _ in range(3)) / 4
        self.matmuls = max(1, int(round(target_s / max(t, 1e-6))))
        self.fn = make(self.matmuls)
        jax.block_until_ready(self.fn(self.x))

    def _time(self, fn: Any) -> float:
        t0 = time.perf_counter()
        fn(self.x).block_until_ready()
        return time.perf_counter() - t0

    def __call__(self) -> float:
        return self._time(self.fn)


def steps_alone(step: Step, n: int) -> list[float]:
    return [step() for _ in range(n)]


def steps_while(step: Step, waiter: threading.Thread) -> list[float]:
    """Run steps until ``waiter`` (the thread waiting for the commit) ends; at least one."""
    times = [step()]
    while waiter.is_alive():
        times.append(step())
    return times


# ----------------------------------------------------------------------------- measures


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _batched(state: Any) -> list[np.ndarray]:
    xs = leaves(state)
    for x in xs:
        x.copy_to_host_async()
    return [np.asarray(x) for x in xs]


def _on_fresh_state(gib: float, fn: Any) -> tuple[float, Any]:
    """Seconds of ``fn(state)`` on a state built for it (JAX caches host copies on arrays), and its result."""
    state = build_state(gib)
    try:
        return _timed(fn, state)
    finally:
        del state
        gc.collect()


def _put(tree: Any, device: Any) -> Any:
    import jax

    return jax.block_until_ready(jax.device_put(tree, device))


def _write(root: Path, arrays: list[np.ndarray]) -> None:
    for i, a in enumerate(arrays):
        with open(root / f"{i:04d}", "wb") as f:
            f.write(a.reshape(-1).view(np.uint8).data)


def _read(root: Path, kinds: list[tuple[tuple[int, ...], np.dtype, int]]) -> list[np.ndarray]:
    got = []
    for i, (shape, dtype, nbytes) in enumerate(kinds):
        buf = np.empty(nbytes, np.uint8)
        with open(root / f"{i:04d}", "rb", buffering=0) as f:
            f.readinto(buf.data)
        got.append(buf.view(dtype).reshape(shape))
    return got


def measure_floors(job: dict[str, Any]) -> dict[str, Any]:
    """device→host three ways (each on a freshly built state), host→device, and a raw write and
    read of the same bytes, one file per leaf, at the store path."""
    import jax

    gib = job["state_gib"]
    device = jax.devices()[0]
    out: dict[str, Any] = {}
    out["device_get_s"], host = _on_fresh_state(gib, jax.device_get)
    out["per_leaf_s"], _ = _on_fresh_state(gib, lambda state: [np.asarray(x) for x in leaves(state)])
    out["async_batched_s"], _ = _on_fresh_state(gib, _batched)
    del _
    gc.collect()
    out["device_put_s"], _ = _timed(_put, host, device)
    del _
    gc.collect()
    root = Path(job["path"]) / "raw"
    root.mkdir(parents=True, exist_ok=True)
    arrays = [np.ascontiguousarray(a) for a in jax.tree.leaves(host)]
    kinds = [(a.shape, a.dtype, a.nbytes) for a in arrays]
    out["raw_write_s"], _ = _timed(_write, root, arrays)
    del host, arrays
    gc.collect()
    out["raw_read_s"], got = _timed(_read, root, kinds)
    out["read_put_s"], _ = _timed(_put, got, device)
    out["save_floor_s"] = out["device_get_s"] + out["raw_write_s"]
    out["restore_floor_s"] = out["raw_read_s"] + out["read_put_s"]
    return out


def measure_system(job: dict[str, Any]) -> dict[str, Any]:
    """A ``CheckpointManager`` save (async) with a training step running until it commits, then
    a restore onto the device; ``job["system"]`` is ``objckpt``, ``objckpt_snapshot``,
    ``objckpt_local`` or ``orbax``.

    With ``job["saves"]`` above 1, that many saves follow one another in this process, as in a
    job's run: before each later one the previous checkpoint is deleted (untimed, so that the
    store holds one state at a time) and the state moves on by a step of its own (a jitted
    update that donates it, so the saved arrays are new ones, as after a training step). The
    first save's figures stay the cell's (``save_total_s``...); the later ones' medians come as
    ``later_*``, and the restore reads the last save back."""
    import jax

    system, gib = job["system"], job["state_gib"]
    saves = int(job.get("saves", 1))
    step = Step(job["step_s"], job["step_dim"])
    state = build_state(gib)
    want = fingerprints(state)
    target = abstract(state)
    mgr, save, wait, restore, delete = _system(system, job["path"], job.get("local_path"))
    alone = steps_alone(step, job["steps_alone"])
    med_alone = statistics.median(alone)
    gc.collect()
    device_peak = device_peak_bytes()
    profile = Profile(job.get("profile_dir"), system, job["state_gib"], job.get("store", "?"))
    sampler = RssSampler()
    later: list[dict[str, float]] = []
    try:
        base = sampler.mark()
        first = _save_beside_steps(functools.partial(save, 1, state), wait, step, med_alone, profile("save"))
        peak = sampler.peak()
        device_peak_delta = device_peak_bytes() - device_peak
        attached = host_copy_attached(state)
        gc.collect()
        time.sleep(0.2)
        after = rss_bytes()
        if saves > 1:
            advance = _advance()
        for k in range(2, saves + 1):
            delete(k - 1)
            state = jax.block_until_ready(advance(state))
            gc.collect()
            later.append(_save_beside_steps(functools.partial(save, k, state), wait, step, med_alone))
        if later:
            want = fingerprints(state)
        del state
        gc.collect()
        base_restore = sampler.mark()
        with profile("restore"):
            restore_s, restored = _timed(lambda: jax.block_until_ready(restore(saves, target)))
        peak_restore = sampler.peak()
    finally:
        sampler.close()
    exact = fingerprints(restored) == want
    mgr.close()
    during = first.pop("during")
    out = {
        **first,
        "peak_host_ram_gib": (peak - base) / GiB,
        "after_commit_host_ram_gib": (after - base) / GiB,
        "host_copy_attached": attached,
        "step_alone_s": med_alone,
        "step_during_s": statistics.median(during),
        "step_max_s": max(during),
        "steps_during": len(during),
        "step_matmuls": step.matmuls,
        "device_peak_delta_gib": device_peak_delta / GiB,
        "restore_s": restore_s,
        "restore_peak_host_ram_gib": (peak_restore - base_restore) / GiB,
        "exact": exact,
        "saves": saves,
    }
    if later:
        for key in ("blocked_s", "save_total_s", "lost_s"):
            out[f"later_{key}"] = statistics.median(one[key] for one in later)
        out["later_step_during_s"] = statistics.median(statistics.median(one["during"]) for one in later)
    return out


def _save_beside_steps(save: Any, wait: Any, step: Step, med_alone: float, around: Any = None) -> dict[str, Any]:
    """``save()`` (inside ``around``: the profiler, if any), then training steps until ``wait()``
    returns: seconds blocked, until committed, the steps' times (``during``) and the training
    time lost (blocked plus the steps' excess)."""
    started = time.perf_counter()
    with around or contextlib.nullcontext():
        save()
    blocked = time.perf_counter() - started
    committed: list[float] = []

    def waiting() -> None:
        wait()
        committed.append(time.perf_counter())

    waiter = threading.Thread(target=waiting)
    waiter.start()
    during = steps_while(step, waiter)
    waiter.join()
    if not committed:
        raise RuntimeError("the save did not commit (its wait raised; see the thread's traceback above)")
    return {
        "blocked_s": blocked,
        "save_total_s": committed[0] - started,
        "during": during,
        "lost_s": blocked + sum(max(0.0, t - med_alone) for t in during),
    }


def _advance() -> Any:
    """A training step's stand-in for the state: every leaf moves on (plus one), in place (donated)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda s: jax.tree.map(lambda x: x + jnp.ones((), x.dtype), s), donate_argnums=0)


def device_peak_bytes() -> int:
    """Device 0's peak memory in use so far (``memory_stats``), or 0 where it reports none."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("peak_bytes_in_use", 0))


class Profile:
    """``with profile("save"):`` writes a cProfile of the block (the calling thread) to
    ``DIR/<system>-<gib>-<store>-<what>.prof`` when the job names a ``profile_dir``."""

    def __init__(self, directory: str | None, system: str, gib: float, store: str) -> None:
        self.directory, self.stem = directory, f"{system}-{gib:g}-{store}"

    def __call__(self, what: str) -> Any:
        import contextlib

        if not self.directory:
            return contextlib.nullcontext()
        return self._profiled(what)

    def _profiled(self, what: str) -> Any:
        import contextlib
        import cProfile

        @contextlib.contextmanager
        def run() -> Any:
            prof = cProfile.Profile()
            prof.enable()
            try:
                yield
            finally:
                prof.disable()
                Path(self.directory).mkdir(parents=True, exist_ok=True)
                prof.dump_stats(str(Path(self.directory) / f"{self.stem}-{what}.prof"))

        return run()


def _system(system: str, path: str, local_path: str | None = None) -> tuple[Any, Any, Any, Any, Any]:
    """(manager, save(step, state), wait(), restore(step, target), delete(step)) under ``path``;
    ``objckpt_snapshot`` is objckpt with ``Options(device_snapshot="on")``, ``objckpt_local`` a
    manager with ``local=LocalCopies(local_path)`` (tmpfs), every step due for both the local tier
    and the store (one device→host copy serves both), restoring from the local tier."""
    if system in ("objckpt", "objckpt_snapshot", "objckpt_local"):
        import objckpt

        options = objckpt.Options(device_snapshot="on" if system == "objckpt_snapshot" else "off")
        local = objckpt.LocalCopies(local_path) if system == "objckpt_local" and local_path else None
        url = Path(path).as_uri() if "://" not in path else path
        mgr = objckpt.CheckpointManager(url, options=options, local=local)
        return (
            mgr,
            lambda step, state: mgr.save(step, state, force=True),
            mgr.wait,
            lambda step, target: mgr.restore(step, target),
            mgr.delete,
        )
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(Path(path).absolute())
    return (
        mgr,
        lambda step, state: mgr.save(step, args=ocp.args.StandardSave(state)),
        mgr.wait_until_finished,
        lambda step, target: mgr.restore(step, args=ocp.args.StandardRestore(target)),
        mgr.delete,
    )


def main() -> None:
    job = json.loads(sys.stdin.read())
    import jax

    info = {"platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind}
    if job["system"] == "floors":
        result = measure_floors(job)
    else:
        result = measure_system(job)
    result.update(info, leaves=4 * len(shapes(job["state_gib"])))
    result["state_bytes"] = sum(int(np.prod(s)) for s in shapes(job["state_gib"]).values()) * BYTES_PER_PARAM
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # no teardown of the device client or Orbax's threads is timed or waited for


if __name__ == "__main__":
    main()
