"""The recovery tier (issue 56): restart from the local tier, local + peer, or the object store,
and what local saves cost a training loop.

    python -m benchmarks.bench_tiers [--repeats 3] [--interval 20] [--step-s 1.0] [--quick]

4 JAX processes × 2 CPU devices (JAX's CPU collectives on: the benchmark's choice, never
objckpt's) hold the 1 GiB ``medium`` state of ``benchmarks/rivals/workloads.py`` on a (4, 2)
("data", "model") mesh, 2-D leaves ``P("data", "model")``, 1-D ones replicated. The object
store is the local S3 (SeaweedFS, ``backends.launcher``) at 10 ms RTT through
``backends.proxy.FaultProxy``; the local tier is a directory on this machine's disk.

1. Setup: one ``CheckpointManager(..., local=, peers=1)`` saves step 0 to the object store and
   the local tier (with its peer copies), and closes.
2. Restarts, interleaved (the order rotates each repeat), ``--repeats`` of each: every process
   opens a new manager and runs ``latest_step()`` + ``restore()`` until the state is on its
   devices (``block_until_ready``); the figure is the slowest process's, timed from a barrier.
   ``local``: the tiers as saved; ``peer``: process 0's local directory moved aside first (its
   shards come back from the process that keeps its copy); ``store``: every process's local
   directory moved aside. Each restore is checked bit for bit against the saved state, and
   the tier each process reports (``tier_status().last_restore``) is recorded.
3. Blocking, interleaved: ``objckpt.save_async(...).seconds_blocked`` beside the wall time of a
   ``mgr.save(step)`` that saves locally only, with ``peers=1`` and ``peers=0`` (the write and
   the peer copy run in the background after it returns; their seconds are recorded as
   ``*_write_after_s``).
4. Step time: segments of ``--interval`` training steps (a jitted ``x + 1`` over the state, then
   ``--step-s`` seconds of sleep standing for the accelerator's compute, which leaves the host
   idle as a real accelerator step would), without a local tier and with one
   (``local_interval_steps=--interval``: one local save per segment; ``peers=1`` and ``peers=0``),
   interleaved; the overhead is the median segment's extra seconds over the plain median, and
   ``interval_for_5pct`` the interval at which those extra seconds per local save are 5 % (derived).
   ``steps.where`` splits each mode's segment into its steps' updates, save calls and sleep
   overshoot (the slowest process, median over repeats): where the extra seconds go.

Writes benchmarks/results/tiers.json (``--out``) and prints a table. ``--quick`` (64 MiB
``small`` state, short steps, one repeat) checks the machinery, not the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"
PROCESSES, DEVICES = 4, 2
PATHS = ("local", "peer", "store")
MODES = ("plain", "local", "local_no_peer")
TARGETS = {"local_vs_store": 5.0, "peer_vs_store": 3.0, "step_overhead": 0.01}  # issue 67's targets


# ----------------------------------------------------------------------------- worker


def _values(shape: tuple[int, ...], index: tuple[slice, ...], seed: int) -> np.ndarray:
    """Float32 values of the box ``index``: each element's global position plus ``seed``, exact in float32."""
    grids = np.ix_(*(np.arange(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape)))
    flat = np.zeros((), np.int64)
    for g, n in zip(grids, shape):
        flat = flat * n + g
    return ((flat + seed) % (1 << 24)).astype(np.float32)


def _exact(got: dict[str, Any], want: dict[str, Any]) -> bool:
    for name, array in want.items():
        if got[name].sharding != array.sharding:
            return False
        for a, b in zip(got[name].addressable_shards, array.addressable_shards):
            if not np.array_equal(np.asarray(a.data), np.asarray(b.data)):
                return False
    return True


def _worker(job: dict[str, Any], process: int) -> dict[str, Any]:
    import functools

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import objckpt
    from benchmarks.rivals.workloads import get
    from objckpt.multihost import get_coordinator

    coordinator = get_coordinator()
    barriers = iter(range(1 << 30))

    def together() -> None:
        coordinator.barrier(f"bench_tiers/{next(barriers)}", timeout=900)

    leaves = get(job["workload"]).leaves
    devices = np.array(sorted(jax.devices(), key=lambda d: d.id))
    mesh = jax.sharding.Mesh(devices.reshape(4, 2), ("data", "model"))
    shardings = [NamedSharding(mesh, P("data", "model") if len(leaf.shape) == 2 else P()) for leaf in leaves]
    state = {
        leaf.name: jax.make_array_from_callback(
            leaf.shape, s, functools.partial(_values, leaf.shape, seed=leaf.seed & 0xFFFF)
        )
        for leaf, s in zip(leaves, shardings)
    }
    abstract = {
        leaf.name: jax.ShapeDtypeStruct(leaf.shape, np.float32, sharding=s) for leaf, s in zip(leaves, shardings)
    }
    so = job["so"]
    local = Path(job["local"])
    mine, aside = local / f"process_{process}", local.parent / f"aside_{process}"

    def manager(root: str, local_dir: Path, interval: int, save_interval: int, peers: int = 1) -> Any:
        return objckpt.CheckpointManager(
            root,
            storage_options=so,
            local=objckpt.LocalCopies(str(local_dir), interval_steps=interval, keep_last=2, peers=peers),
            save_rules=objckpt.SavePolicy(save_interval_steps=save_interval),
        )

    out: dict[str, Any] = {"process": process, "bytes": sum(int(np.prod(leaf.shape)) * 4 for leaf in leaves)}
    together()
    started = time.perf_counter()
    mgr = manager(job["url"], local, 1, 1)
    mgr.save(0, state, wait=True)
    mgr.close()
    out["setup_s"] = time.perf_counter() - started

    restores = []
    for rep in range(job["repeats"]):
        order = PATHS[rep % 3 :] + PATHS[: rep % 3]
        for path in order:
            moved = path == "store" or (path == "peer" and process == 0)
            if moved:
                mine.rename(aside)
            together()
            t0 = time.perf_counter()
            mgr = manager(job["url"], local, 1, 1)
            t1 = time.perf_counter()
            step = mgr.latest_step()
            t2 = time.perf_counter()
            restored = mgr.restore(step, abstract)
            t3 = time.perf_counter()
            jax.block_until_ready(restored)
            seconds = time.perf_counter() - t0
            last = mgr.tier_status().last_restore
            mgr.close()
            exact = _exact(restored, state)
            del restored
            if moved:
                shutil.rmtree(mine, ignore_errors=True)
                aside.rename(mine)
            restores.append(
                {
                    "path": path,
                    "rep": rep,
                    "seconds": seconds,
                    "tier": last.tier if last else None,
                    "step": step,
                    "exact": exact,
                    # where the slowest process's time went: the manager made, latest_step(),
                    # restore() (its phases: TierRestore.phases), then the arrays ready
                    "phases": {
                        "manager": t1 - t0,
                        "latest_step": t2 - t1,
                        **({f"restore.{k}": v for k, v in last.phases.items()} if last else {}),
                        "restore": t3 - t2,
                        "ready": seconds - (t3 - t0),
                    },
                }
            )
            together()
    out["restores"] = restores

    # Blocking: save_async vs a local-only manager save, with and without peer copies (interleaved).
    # Each manager's first local save (no peer copy of a previous one to send) is not measured.
    blocking = []
    managers = {peers: manager(job["url2"], local.parent / f"blocking{peers}", 1, 1 << 30, peers) for peers in (1, 0)}
    for mgr in managers.values():
        mgr.save(1, state)
    for rep in range(job["repeats"]):
        row: dict[str, Any] = {"rep": rep}
        for what in ("async", 1, 0) if rep % 2 == 0 else (0, 1, "async"):
            together()
            if what == "async":
                handle = objckpt.save_async(f"{job['url2']}/async_{rep}", state, storage_options=so)
                row["save_async_blocked_s"] = handle.seconds_blocked
                handle.result()
                continue
            name = "local" if what else "local_no_peer"
            t0 = time.perf_counter()
            managers[what].save(rep + 2, state)
            row[f"{name}_blocked_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            managers[what].wait()
            row[f"{name}_write_after_s"] = time.perf_counter() - t0
        blocking.append(row)
    for mgr in managers.values():
        mgr.close()
    out["blocking"] = blocking

    # Step time: segments of `interval` steps, without a local tier, with one saving once per
    # segment (peer copies on), and with one without peer copies.
    interval, step_s = job["interval"], job["step_s"]
    update = jax.jit(lambda tree: jax.tree.map(lambda x: x + 1, tree))
    train = update(state)
    jax.block_until_ready(train)
    managers = {
        peers: manager(job["url2"], local.parent / f"steps{peers}", interval, 1 << 30, peers) for peers in (1, 0)
    }
    for mgr in managers.values():
        mgr.save(interval, train)  # the first local save sends no peer copy: not measured
    step = 2 * interval
    segments = []
    for rep in range(job["repeats"]):
        for mode in MODES[rep % 3 :] + MODES[: rep % 3]:
            together()
            t0 = time.perf_counter()
            saves = []
            parts = []  # per step: (update, save call, sleep past step_s) seconds
            for _ in range(interval):
                a = time.perf_counter()
                train = update(train)
                jax.block_until_ready(train)
                b = time.perf_counter()
                if mode != "plain":
                    if managers[int(mode == "local")].save(step, train):
                        saves.append(time.perf_counter() - b)
                c = time.perf_counter()
                time.sleep(step_s)
                parts.append((b - a, c - b, time.perf_counter() - c - step_s))
                step += 1
            segments.append(
                {
                    "rep": rep,
                    "mode": mode,
                    "seconds": time.perf_counter() - t0,
                    "save_calls_s": saves,
                    "step_parts_s": parts,
                }
            )
    for mgr in managers.values():
        mgr.close()
    out["segments"] = segments
    together()
    return out


def _worker_main() -> None:
    from benchmarks.workers import worker_main

    job = json.loads(os.environ["BENCH_TIERS_JOB"])
    if job.get("grid"):
        worker_main("BENCH_TIERS", job["count"], _grid_worker)
    else:
        worker_main("BENCH_TIERS", PROCESSES, _worker)


# ----------------------------------------------------------------------------- grid (issue 79)

GRID_PROCESSES = (1, 2, 4, 8)
GRID_MIB = (64, 256, 1024)
GRID_TARGETS = {"local": 3.0, "peer": 2.0}  # the store's time ÷ the tier's, in every cell
COORDINATION = ("barrier", "publish", "collect", "broadcast", "await_value", "release", "forget")


def grid_leaves(mib: int) -> list[Any]:
    """The grid's state of ``mib`` MiB: the ``small`` transformer (64 MiB, 12 layers at d=160, ~300
    leaves, like the ≈60 MiB Flax NNX state of issue 79), 4 layers at d=512 for 256 MiB, and the
    ``medium`` one (1 GiB) for 1024; others: 4 layers at d=256 filling ``mib``."""
    from benchmarks.rivals import workloads

    shapes = {64: (12, 160), 256: (4, 512), 1024: (4, 1024)}
    layers, d = shapes.get(mib, (4, 256))
    return list(workloads._transformer(f"grid{mib}", layers=layers, d=d, target_bytes=mib << 20).leaves)


def _count_coordination(coordinator: Any, counts: dict[str, int]) -> None:
    """Count each call of the job's coordinator (one or more round trips to JAX's coordination
    service each) into ``counts``, on its class: every instance a restart makes is counted."""
    cls = type(coordinator)
    for name in COORDINATION:
        original = getattr(cls, name)

        def counted(self: Any, *args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
            counts[__name] = counts.get(__name, 0) + 1
            return __original(self, *args, **kwargs)

        setattr(cls, name, counted)


def _first_read_marks(marks: dict[str, float]) -> None:
    """Record when a restart first reads data: a peer copy's fetch from its keeper, or the
    restore's fetch of pieces once its reads are planned (``objckpt.restoring.api.fetch``)."""
    import objckpt.restoring.api as api
    from objckpt.peers.copies import Keepers

    fetch, bring = api.fetch, Keepers.fetch

    def planned_fetch(*args: Any, **kwargs: Any) -> Any:
        marks.setdefault("first_read", time.perf_counter())
        return fetch(*args, **kwargs)

    def keeper_fetch(self: Any, *args: Any, **kwargs: Any) -> Any:
        marks.setdefault("first_read", time.perf_counter())
        return bring(self, *args, **kwargs)

    api.fetch = planned_fetch  # type: ignore[assignment]
    Keepers.fetch = keeper_fetch  # type: ignore[method-assign]


def _grid_worker(job: dict[str, Any], process: int) -> dict[str, Any]:
    """One job of the grid: ``setup`` saves step 0 to the store and every local tier (peer
    copies on); ``restart`` opens a manager, ``latest_step()``, ``restore()``, state on devices."""
    import functools

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import objckpt
    from objckpt.multihost import get_coordinator

    count = jax.process_count()
    coordinator = get_coordinator()
    leaves = grid_leaves(job["mib"])
    devices = np.array(sorted(jax.devices(), key=lambda d: d.id))
    mesh = jax.sharding.Mesh(devices.reshape(count, -1), ("data", "model"))
    split = P("data", "model")
    shardings = [
        NamedSharding(mesh, split if len(leaf.shape) == 2 and leaf.shape[0] % count == 0 else P()) for leaf in leaves
    ]
    # --nnx: 1-D leaves saved split over "data" (as nnx.jit leaves a bias whose annotation says P()),
    # restored onto P(): the local tier reads them on the saved layout and JAX reshards them
    saved = [
        NamedSharding(mesh, P("data")) if job["nnx"] and len(leaf.shape) == 1 and leaf.shape[0] % count == 0 else s
        for leaf, s in zip(leaves, shardings)
    ]
    values = {leaf.name: functools.partial(_values, leaf.shape, seed=leaf.seed & 0xFFFF) for leaf in leaves}

    def manager() -> Any:
        return objckpt.CheckpointManager(
            job["url"],
            storage_options=job["so"],
            local=objckpt.LocalCopies(job["local"], interval_steps=1),
            save_rules=objckpt.SavePolicy(save_interval_steps=1),
        )

    if job["action"] == "setup":
        state = {
            leaf.name: jax.make_array_from_callback(leaf.shape, s, values[leaf.name]) for leaf, s in zip(leaves, saved)
        }
        mgr = manager()
        mgr.save(0, state, wait=True)
        mgr.close()
        return {"process": process}
    abstract = {
        leaf.name: jax.ShapeDtypeStruct(leaf.shape, np.float32, sharding=s) for leaf, s in zip(leaves, shardings)
    }
    counts: dict[str, int] = {}
    marks: dict[str, float] = {}
    _count_coordination(coordinator, counts)
    _first_read_marks(marks)
    # Imported before the clock starts (an installed package's modules load in milliseconds; a
    # checkout run with PYTHONDONTWRITEBYTECODE compiles them), and the heap collected, so no path
    # pays a full collection of the start-up's garbage.
    import objckpt.locations.tiers  # noqa: F401
    import objckpt.manager.checkpoint_manager  # noqa: F401
    import objckpt.peers.transfer  # noqa: F401
    import objckpt.restoring.api  # noqa: F401

    gc.collect()
    coordinator.barrier("bench_tiers/grid", timeout=300)
    counts.clear()
    cpu, t0 = time.process_time(), time.perf_counter()
    mgr = manager()
    t1 = time.perf_counter()
    step = mgr.latest_step()
    t2 = time.perf_counter()
    restored = mgr.restore(step, abstract)
    t3 = time.perf_counter()
    jax.block_until_ready(restored)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu
    last = mgr.tier_status().last_restore
    rounds = dict(counts)
    mgr.close()
    exact = step == 0 and all(
        np.array_equal(np.asarray(shard.data), values[name](shard.index))
        for name, array in restored.items()
        for shard in array.addressable_shards
    )
    return {
        "process": process,
        "bytes": sum(leaf.nbytes for leaf in leaves),
        "leaves": len(leaves),
        "seconds": seconds,
        "cpu_s": cpu,
        "before_first_read_s": marks.get("first_read", time.perf_counter()) - t0,
        "tier": last.tier if last else None,
        "exact": exact,
        "coordination": rounds,
        "phases": {
            "manager": t1 - t0,
            "latest_step": t2 - t1,
            **({f"restore.{k}": v for k, v in last.phases.items()} if last else {}),
            "restore": t3 - t2,
            "ready": seconds - (t3 - t0),
        },
    }


def _grid_cell(per_path: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """One cell's report: per path, each restart's slowest process (seconds, time before the first
    read, CPU-s, coordinator calls of process 0, the phases of the slowest), medians."""
    cell: dict[str, Any] = {}
    for path, runs in per_path.items():
        rows = []
        for results in runs:
            slowest = max(results, key=lambda r: r["seconds"])
            rows.append(
                {
                    "seconds": slowest["seconds"],
                    "before_first_read_s": max(r["before_first_read_s"] for r in results),
                    "cpu_s": max(r["cpu_s"] for r in results),
                    "tiers": sorted({str(r["tier"]) for r in results}),
                    "exact": all(r["exact"] for r in results),
                    "coordination": results[0]["coordination"],
                    "phases": slowest["phases"],
                    "per_process": [
                        {k: r[k] for k in ("seconds", "before_first_read_s", "cpu_s", "phases")} for r in results
                    ],
                }
            )
        cell[path] = {
            "median_s": statistics.median(r["seconds"] for r in rows),
            "before_first_read_s": statistics.median(r["before_first_read_s"] for r in rows),
            "cpu_s": statistics.median(r["cpu_s"] for r in rows),
            "runs": rows,
        }
    store = cell["store"]["median_s"]
    for path in ("local", "peer"):
        if path in cell:
            cell[path]["vs_store"] = store / cell[path]["median_s"]
            cell[path]["target_met"] = cell[path]["vs_store"] >= GRID_TARGETS[path]
    return cell


def run_grid(args: argparse.Namespace) -> dict[str, Any]:
    """Every cell: a setup job, then ``args.repeats`` rounds of one fresh job per restart path
    (the order rotating each round); local directories moved aside as each path needs."""
    from backends.launcher import start_s3
    from benchmarks.workers import run_workers
    from tests.multiprocess import free_port

    processes = [int(p) for p in args.processes.split(",")]
    sizes = [int(m) for m in args.mib.split(",")]
    cells: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="bench_tiers_grid_"))
    try:
        with start_s3() as s3:
            for count in processes:
                for mib in sizes:
                    run = uuid.uuid4().hex[:8]
                    local = work / f"{count}x{mib}"
                    job = {"grid": True, "url": s3.url(f"grid/{run}"), "so": s3.storage_options()}
                    job.update(local=str(local), mib=mib, nnx=args.nnx)

                    def launch(
                        action: str, path: str = "", count: int = count, job: dict[str, Any] = job
                    ) -> list[dict[str, Any]]:
                        return run_workers(
                            "benchmarks.bench_tiers",
                            {**job, "action": action, "path": path, "count": count, "port": free_port()},
                            processes=count,
                            devices=DEVICES,
                            env_prefix="BENCH_TIERS",
                            timeout=args.timeout,
                        )

                    launch("setup")
                    paths = PATHS if count > 1 else ("local", "store")
                    per_path: dict[str, list[list[dict[str, Any]]]] = {p: [] for p in paths}
                    for rep in range(args.repeats):
                        for path in paths[rep % len(paths) :] + paths[: rep % len(paths)]:
                            moved = [p for p in range(count) if path == "store" or (path == "peer" and p == 0)]
                            for p in moved:
                                (local / f"process_{p}").rename(local / f"aside_{p}")
                            try:
                                per_path[path].append(launch("restart", path))
                            finally:
                                for p in moved:
                                    shutil.rmtree(local / f"process_{p}", ignore_errors=True)
                                    (local / f"aside_{p}").rename(local / f"process_{p}")
                    cell = {"processes": count, "devices_per_process": DEVICES, "mib": mib, **_grid_cell(per_path)}
                    cell["bytes"] = per_path["local"][0][0]["bytes"]
                    cell["leaves"] = per_path["local"][0][0]["leaves"]
                    cells.append(cell)
                    print(grid_row(cell), flush=True)
                    shutil.rmtree(local, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "workload": "grid: the small (64 MiB, 12 layers at d=160), 4 layers at d=512 (256 MiB) and medium (1 GiB)"
        " transformer states with Adam moments, float32; 2-D leaves P('data', 'model') over (processes, 2)"
        " CPU devices, 1-D replicated; S3 (SeaweedFS) on loopback, 0 ms; each restart a fresh job",
        "repeats": args.repeats,
        "targets": GRID_TARGETS,
        "cells": cells,
    }


def grid_row(cell: dict[str, Any]) -> str:
    """One row of docs/TIERS.md's grid table."""

    def time(path: str) -> str:
        if path not in cell:
            return "–"
        c = cell[path]
        ratio = f", {c['vs_store']:.1f}×" if "vs_store" in c else ""
        return f"{c['median_s']:.2f} s ({c['before_first_read_s']:.2f} s{ratio})"

    return f"| {cell['processes']} | {cell['bytes'] / 2**20:.0f} MiB | {time('local')} | {time('peer')} | {time('store')} |"


def grid_table(report: dict[str, Any]) -> str:
    """docs/TIERS.md's grid table: per cell the restart's median (before its first read; × faster than the store)."""
    head = [
        f"Medians of {report['repeats']}: restart to the state on the devices (in brackets: before the first"
        " byte is read; how many times faster than the store).",
        "",
        "| processes | state | local | local + peer | store |",
        "|---|---|---|---|---|",
    ]
    return "\n".join(head + [grid_row(c) for c in report["cells"]])


# ----------------------------------------------------------------------------- driver


def summarise(results: list[dict[str, Any]], job: dict[str, Any]) -> dict[str, Any]:
    """The report: per restore path and save measure, the slowest process per run, medians."""
    restores: dict[str, Any] = {}
    for path in PATHS:
        runs = []
        for rep in range(job["repeats"]):
            per = [next(r for r in res["restores"] if (r["path"], r["rep"]) == (path, rep)) for res in results]
            runs.append(
                {
                    "seconds": max(r["seconds"] for r in per),
                    "tiers": sorted({str(r["tier"]) for r in per}),
                    "step": per[0]["step"],
                    "exact": all(r["exact"] for r in per),
                }
            )
        restores[path] = {"median_s": statistics.median(r["seconds"] for r in runs), "runs": runs}
    store_s = restores["store"]["median_s"]
    keys = [f"{n}_{k}" for n in ("local", "local_no_peer") for k in ("blocked_s", "write_after_s")]
    keys.append("save_async_blocked_s")
    blocking = [{k: max(res["blocking"][rep][k] for res in results) for k in keys} for rep in range(job["repeats"])]
    seg: dict[str, list[float]] = {mode: [] for mode in MODES}
    save_calls: dict[str, list[float]] = {mode: [] for mode in MODES[1:]}
    for rep in range(job["repeats"]):
        for mode in MODES:
            per = [next(s for s in res["segments"] if (s["rep"], s["mode"]) == (rep, mode)) for res in results]
            seg[mode].append(max(s["seconds"] for s in per))
            if mode != "plain":
                save_calls[mode] += [max(calls) for calls in zip(*(s["save_calls_s"] for s in per))]
    # Where a segment's seconds go, per mode: each step's update, save call and sleep overshoot,
    # summed over the segment (per process), the median over repeats of the slowest process.
    where: dict[str, dict[str, float]] = {}
    for mode in MODES:
        sums = []
        for rep in range(job["repeats"]):
            per = [next(s for s in res["segments"] if (s["rep"], s["mode"]) == (rep, mode)) for res in results]
            totals = [[sum(p[k] for p in s.get("step_parts_s", [])) for k in range(3)] for s in per]
            sums.append([max(t[k] for t in totals) for k in range(3)])
        where[mode] = {
            name: statistics.median(x[k] for x in sums) for k, name in enumerate(("update_s", "save_s", "oversleep_s"))
        }
    plain = statistics.median(seg["plain"])
    plain_step = plain / job["interval"]
    steps: dict[str, Any] = {
        "interval": job["interval"],
        "step_sleep_s": job["step_s"],
        "plain_segment_s": plain,
        "plain_step_s": plain_step,
        "runs": seg,
        "where": where,
    }
    for mode in MODES[1:]:
        extra = statistics.median(seg[mode]) - plain  # seconds one local save adds
        steps[mode] = {
            "segment_s": statistics.median(seg[mode]),
            "overhead": extra / plain,
            "extra_s_per_local_save": extra,
            "interval_for_5pct": max(1, math.ceil(extra / (0.05 * plain_step))),
            "save_call_s": statistics.median(save_calls[mode]) if save_calls[mode] else None,
        }
    report = {
        "bytes": results[0]["bytes"],
        "workload": job["workload"],
        "processes": PROCESSES,
        "devices_per_process": DEVICES,
        "rtt_ms": job["rtt_ms"],
        "repeats": job["repeats"],
        "setup_s": max(r["setup_s"] for r in results),
        "restore": restores,
        "local_vs_store": store_s / restores["local"]["median_s"],
        "peer_vs_store": store_s / restores["peer"]["median_s"],
        "blocking": {**{k: statistics.median(b[k] for b in blocking) for k in keys}, "runs": blocking},
        "steps": steps,
    }
    report["targets"] = {
        "local_vs_store": report["local_vs_store"] >= TARGETS["local_vs_store"],
        "peer_vs_store": report["peer_vs_store"] >= TARGETS["peer_vs_store"],
        "local_blocks_no_longer": report["blocking"]["local_blocked_s"] <= report["blocking"]["save_async_blocked_s"],
        "step_overhead": steps["local"]["overhead"] <= TARGETS["step_overhead"],
    }
    return report


def table(report: dict[str, Any]) -> str:
    """docs/PERFORMANCE.md's table from a report."""
    r, b, s = report["restore"], report["blocking"], report["steps"]
    store = r["store"]["median_s"]
    lines = [
        f"| {report['bytes'] / 2**30:.2f} GiB, {report['processes']} processes × {report['devices_per_process']} devices, "
        f"S3 at {report['rtt_ms']} ms | median of {report['repeats']} |",
        "|---|---|",
        f"| restart from the local tier | {r['local']['median_s']:.2f} s ({store / r['local']['median_s']:.1f}× faster) |",
        f"| restart from local + peer (process 0's tier wiped) | {r['peer']['median_s']:.2f} s ({store / r['peer']['median_s']:.1f}× faster) |",
        f"| restart from the object store | {store:.2f} s |",
        f"| `save_async` blocks | {b['save_async_blocked_s']:.2f} s |",
        f"| local save blocks, `peers=1` | {b['local_blocked_s']:.2f} s |",
        f"| local save blocks, `peers=0` | {b['local_no_peer_blocked_s']:.2f} s |",
        f"| step time, no local tier | {s['plain_step_s']:.2f} s |",
        f"| step-time overhead, local_interval_steps={s['interval']} | {100 * s['local']['overhead']:.1f} % "
        f"(≤ 5 % from {s['local']['interval_for_5pct']} steps) |",
        f"| the same, `peers=0` | {100 * s['local_no_peer']['overhead']:.1f} % "
        f"(≤ 5 % from {s['local_no_peer']['interval_for_5pct']} steps) |",
    ]
    return "\n".join(lines)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks, backends, tests
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=None, help="3; --grid: 5")
    parser.add_argument("--interval", type=int, default=20, help="local_interval_steps of the step-time segments")
    parser.add_argument("--step-s", type=float, default=1.0, help="seconds of emulated accelerator compute per step")
    parser.add_argument("--rtt-ms", type=int, default=10)
    parser.add_argument("--workload", default="medium")
    parser.add_argument("--quick", action="store_true", help="small state, short steps, one repeat")
    parser.add_argument("--out", default=str(RESULTS / "tiers.json"))
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--grid", action="store_true", help="issue 79's grid of restarts (processes × sizes × paths)")
    parser.add_argument("--processes", default=",".join(map(str, GRID_PROCESSES)), help="grid: process counts")
    parser.add_argument("--mib", default=",".join(map(str, GRID_MIB)), help="grid: state sizes in MiB")
    parser.add_argument("--nnx", action="store_true", help="grid: 1-D leaves saved split, restored replicated")
    parser.add_argument(
        "--table", action="store_true", help="grid: print docs/TIERS.md's table from --out, run nothing"
    )
    args = parser.parse_args()
    if args.worker:
        _worker_main()
        return
    if args.table:
        print(grid_table(json.loads(Path(args.out).read_text())["grid"]))
        return
    if args.grid:
        if args.quick:
            args.processes, args.mib, args.repeats = "1,2", "64", 1
        args.repeats = args.repeats or 5
        out = Path(args.out)
        report = json.loads(out.read_text()) if out.exists() else {}
        load = os.getloadavg()
        report["grid"] = {**run_grid(args), "load_before": load, "load_after": os.getloadavg(), "quick": args.quick}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(grid_table(report["grid"]))
        return
    args.repeats = args.repeats or 3
    if args.quick:
        args.workload, args.repeats, args.interval, args.step_s = "small", 1, 3, 0.05
    from backends.launcher import start_s3
    from backends.proxy import FaultProxy
    from benchmarks.workers import run_workers
    from tests.multiprocess import free_port

    load = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench_tiers_"))
    try:
        with start_s3() as s3:
            so = s3.storage_options()
            port = int(s3.endpoint_url.rsplit(":", 1)[1])
            proxy = FaultProxy("127.0.0.1", port, latency_ms=args.rtt_ms).start()
            so = {**so, "client_kwargs": {**so["client_kwargs"], "endpoint_url": proxy.endpoint_url}}
            run = uuid.uuid4().hex[:8]
            job = {
                "url": s3.url(f"tiers/{run}"),
                "url2": s3.url(f"tiers/{run}-save"),
                "so": so,
                "local": str(work / "local"),
                "workload": args.workload,
                "repeats": args.repeats,
                "interval": args.interval,
                "step_s": args.step_s,
                "rtt_ms": args.rtt_ms,
                "port": free_port(),
            }
            started = time.perf_counter()
            try:
                results = run_workers(
                    "benchmarks.bench_tiers",
                    job,
                    processes=PROCESSES,
                    devices=DEVICES,
                    env_prefix="BENCH_TIERS",
                    timeout=args.timeout,
                )
            finally:
                proxy.stop()
            elapsed = time.perf_counter() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = summarise(results, job)
    report.update(load_before=load, load_after=os.getloadavg(), run_s=elapsed, quick=args.quick, per_process=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(table(report))


if __name__ == "__main__":
    main()
