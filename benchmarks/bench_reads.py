"""Exact sub-piece reads or one wider read, and resharding on the devices (issue 54).

    python -m benchmarks.bench_reads [--rtts 0,10,40] [--repeats 3] [--sample 2000]

4 JAX processes × 2 CPU devices (JAX's CPU collectives on: the benchmark's choice, never
objckpt's) save the 1 GiB ``medium`` state of ``benchmarks/rivals/workloads.py`` once to the
local S3 (SeaweedFS, ``backends.launcher``) on a (4, 2) ("data", "model") mesh, 2-D leaves
``P("data", "model")``, 1-D ones replicated. Each process then, per RTT (0 ms direct; 10 and
40 ms through ``backends.proxy.FaultProxy``) and per target, all processes at once:

- (a) ``objckpt.restore`` as it is: leaves whose boxes cut the saved pieces are read on a
  sharding lined up with them and resharded on the devices (``device_bytes_moved``);
- (b) ``objckpt.restore`` with that path off (``plan_read_shardings`` patched to choose no
  leaf, here only): whole saved pieces read directly;
- (c) raw ranged GETs of exactly the byte runs this process's target boxes need (the rows
  of each 2-D sub-box, runs closer than ``--gap`` merged), no checksum, at restore's
  concurrency (``Options.max_concurrency``); a sample of them is timed (``--sample``), the
  rest extrapolated from it, and beside them the same GETs as (b)'s whole-piece reads, raw.

Targets: ``swapped`` (the same mesh, 2-D leaves ``P("model", "data")``), ``order`` (the same
(4, 2) mesh shape with ``data`` as the minor device axis: devices ``arange(8).reshape(2, 4).T``).
The cost model ``t = a · GETs + b · bytes`` (per process, all four reading at once) is fitted
per RTT from the raw whole-piece and exact GETs; an exact read of a row run beats reading it
with the bytes between runs when the bytes skipped exceed ``a / b`` (the break-even gap).
Writes ``benchmarks/results/reads.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"
PROCESSES, DEVICES = 4, 2
TARGETS = ("swapped", "order")


# ----------------------------------------------------------------------------- worker


def _values(shape: tuple[int, ...], index: tuple[slice, ...], seed: int) -> np.ndarray:
    """Float32 values of the box ``index``, a hash of each element's global position (no NaN or inf)."""
    grids = np.ix_(*(np.arange(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape)))
    flat = np.zeros((), np.uint64)
    for g, n in zip(grids, shape):
        flat = flat * np.uint64(n) + g.astype(np.uint64)
    bits = ((flat + np.uint64(seed)) * np.uint64(2654435761)) & np.uint64(0x3FFFFFFF)
    return np.ascontiguousarray(bits.astype(np.uint32).view(np.float32))


def _runs(plans: dict[int, Any]) -> dict[str, np.ndarray]:
    """Per blob, the (start, end) byte runs this process's boxes need, C order, unmerged."""
    out: dict[str, list[np.ndarray]] = {}
    for plan in plans.values():
        size = plan.dtype.itemsize
        for start, stop in plan.devices_by_box:
            for p in plan.pieces:
                lo = [max(a, b) for a, b in zip(start, p.start)]
                hi = [min(a, b) for a, b in zip(stop, p.stop)]
                if any(a >= b for a, b in zip(lo, hi)):
                    continue
                if len(lo) < 2 or (lo[1:] == list(p.start[1:]) and hi[1:] == list(p.stop[1:])) or len(lo) > 2:
                    row = int(np.prod(p.shape[1:], dtype=np.int64)) * size  # whole rows: one run
                    first = p.offset + (lo[0] - p.start[0] if lo else 0) * row
                    run = np.array([[first, first + ((hi[0] - lo[0]) * row if lo else p.length)]])
                else:
                    width = p.stop[1] - p.start[1]
                    rows = np.arange(lo[0] - p.start[0], hi[0] - p.start[0], dtype=np.int64)
                    s = p.offset + (rows * width + (lo[1] - p.start[1])) * size
                    run = np.stack([s, s + (hi[1] - lo[1]) * size], axis=1)
                out.setdefault(p.blob, []).append(run)
    return {blob: np.concatenate(parts) for blob, parts in out.items()}


def _merge(runs: dict[str, np.ndarray], gap: int) -> list[tuple[str, int, int]]:
    """Runs of each blob merged where they overlap or lie at most ``gap`` bytes apart."""
    out: list[tuple[str, int, int]] = []
    for blob, r in sorted(runs.items()):
        r = r[np.argsort(r[:, 0], kind="stable")]
        reach = np.maximum.accumulate(r[:, 1])
        new = np.ones(len(r), bool)
        new[1:] = r[1:, 0] > reach[:-1] + gap
        starts = r[new, 0]
        ends = np.append(reach[np.flatnonzero(new)[1:] - 1], reach[-1])
        out.extend((blob, int(s), int(e)) for s, e in zip(starts, ends))
    return out


async def _gets(store: Any, ranges: list[tuple[str, int, int]], concurrency: int) -> int:
    gate = asyncio.Semaphore(concurrency)

    async def one(blob: str, start: int, end: int) -> int:
        async with gate:
            return len(await store.get_range(blob, start=start, end=end))

    return sum(await asyncio.gather(*(one(*r) for r in ranges)))


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import objckpt
    import objckpt.restoring.api as api
    from benchmarks.rivals.workloads import get
    from objckpt.multihost import get_coordinator
    from objckpt.storage.registry import from_url

    coordinator = get_coordinator()
    barriers = iter(range(1 << 30))

    def together() -> None:
        coordinator.barrier(f"bench_reads/{next(barriers)}", timeout=600)

    leaves = get(job["workload"]).leaves
    devices = np.array(sorted(jax.devices(), key=lambda d: d.id))
    saved = jax.sharding.Mesh(devices.reshape(4, 2), ("data", "model"))
    order = jax.sharding.Mesh(devices.reshape(2, 4).T, ("data", "model"))

    def shardings(target: str) -> list[NamedSharding]:
        mesh = order if target == "order" else saved
        two = P("model", "data") if target == "swapped" else P("data", "model")
        return [NamedSharding(mesh, two if len(leaf.shape) == 2 else P()) for leaf in leaves]

    def tree(arrays: list[Any]) -> dict[str, Any]:
        return {leaf.name: a for leaf, a in zip(leaves, arrays)}

    state = tree(
        [
            jax.make_array_from_callback(leaf.shape, s, functools.partial(_values, leaf.shape, seed=leaf.seed & 0xFFFF))
            for leaf, s in zip(leaves, shardings("saved"))
        ]
    )
    url = job["url"]
    started = time.perf_counter()
    objckpt.save(url, state, storage_options=job["so"]["0"])
    save_s = time.perf_counter() - started
    del state
    out: dict[str, Any] = {"save_s": save_s, "runs": [], "exact": {}}
    direct_plan = api.plan_read_shardings
    captured: dict[str, Any] = {}
    plan = api.plan

    def capturing(manifest: Any, plans: Any, options: Any, *, streamed: bool) -> Any:
        requests = plan(manifest, plans, options, streamed=streamed)
        captured.update(plans=dict(plans), requests=requests)
        return requests

    concurrency = objckpt.Options().max_concurrency
    for ms in job["rtts"]:
        so = job["so"][str(ms)]
        for target in TARGETS:
            abstract = tree(
                [jax.ShapeDtypeStruct(leaf.shape, np.float32, sharding=s) for leaf, s in zip(leaves, shardings(target))]
            )
            for path in ("a", "b"):
                api.plan_read_shardings = direct_plan if path == "a" else (lambda m, s, **k: {})
                api.plan = capturing if path == "b" else plan
                for rep in range(job["repeats"]):
                    stats = objckpt.TransferStats()
                    together()
                    t0 = time.perf_counter()
                    restored = objckpt.restore(url, abstract, storage_options=so, stats=stats)
                    seconds = time.perf_counter() - t0
                    if rep == 0:  # bit-exact, every shard this process holds
                        for leaf in leaves:
                            for shard in restored[leaf.name].addressable_shards:
                                want = _values(leaf.shape, shard.index, leaf.seed & 0xFFFF)
                                assert np.asarray(shard.data).tobytes() == want.tobytes(), (target, path, leaf.name)
                    del restored
                    out["runs"].append(
                        {
                            "rtt_ms": ms,
                            "target": target,
                            "path": path,
                            "seconds": seconds,
                            "bytes_read": stats.bytes_read,
                            "gets": stats.requests,
                            "device_bytes_moved": stats.device_bytes_moved,
                        }
                    )
            api.plan_read_shardings, api.plan = direct_plan, plan
            # (c): the exact runs of this process's boxes, and (b)'s whole-piece reads, as raw GETs.
            runs = _runs(captured["plans"])
            exact = _merge(runs, 0)
            merged = _merge(runs, job["gap"])
            wider = [(r.blob, r.start, r.end) for r in captured["requests"]]
            step = max(1, len(exact) // job["sample"])
            sample = exact[::step][: job["sample"]]
            out["exact"].setdefault(target, {}).update(
                needed_bytes=int(sum(e - s for _, s, e in exact)),
                exact_gets=len(exact),
                exact_run_bytes=[min(e - s for _, s, e in exact), max(e - s for _, s, e in exact)],
                merged_gets=len(merged),
                merged_bytes=int(sum(e - s for _, s, e in merged)),
                wider_gets=len(wider),
                wider_bytes=int(sum(e - s for _, s, e in wider)),
            )
            store = from_url(url, **so)
            for kind, ranges in (("wider", wider), ("exact_sample", sample)):
                for _ in range(job["repeats"]):
                    together()
                    t0 = time.perf_counter()
                    got = asyncio.run(_gets(store, ranges, concurrency))
                    out["runs"].append(
                        {
                            "rtt_ms": ms,
                            "target": target,
                            "path": f"raw_{kind}",
                            "seconds": time.perf_counter() - t0,
                            "bytes_read": got,
                            "gets": len(ranges),
                        }
                    )
    out["concurrency"] = concurrency
    return out


def _worker_main() -> None:
    from benchmarks.workers import worker_main

    worker_main("BENCH_READS", PROCESSES, lambda job, process: _worker(job))


# ----------------------------------------------------------------------------- driver


def _median(xs: list[float]) -> float:
    return float(np.median(xs))


def _summarise(results: list[dict[str, Any]], rtts: list[int]) -> dict[str, Any]:
    """Medians over repeats of the slowest process; bytes and GETs per process (the worst one)."""
    rows = []
    for ms in rtts:
        for target in TARGETS:
            for path in ("a", "b", "raw_wider", "raw_exact_sample"):
                per = [
                    [r for r in res["runs"] if (r["rtt_ms"], r["target"], r["path"]) == (ms, target, path)]
                    for res in results
                ]
                walls = [max(p[k]["seconds"] for p in per) for k in range(len(per[0]))]
                first = [p[0] for p in per]
                rows.append(
                    {
                        "rtt_ms": ms,
                        "target": target,
                        "path": path,
                        "seconds": _median(walls),
                        "seconds_all": walls,
                        "bytes_read_worst": max(r["bytes_read"] for r in first),
                        "gets_worst": max(r["gets"] for r in first),
                        "device_bytes_moved": sum(r.get("device_bytes_moved", 0) for r in first),
                    }
                )
    exact = {
        t: {k: max(res["exact"][t][k] for res in results) for k in results[0]["exact"][t] if k != "exact_run_bytes"}
        for t in TARGETS
    }
    for t in TARGETS:
        exact[t]["exact_run_bytes"] = results[0]["exact"][t]["exact_run_bytes"]
    models = {}
    for ms in rtts:
        eqs, ts = [], []
        for t in TARGETS:
            for path in ("raw_wider", "raw_exact_sample"):
                row = next(r for r in rows if (r["rtt_ms"], r["target"], r["path"]) == (ms, t, path))
                eqs.append([row["gets_worst"], row["bytes_read_worst"]])
                ts.append(row["seconds"])
        (a, b), *_ = np.linalg.lstsq(np.array(eqs, float), np.array(ts), rcond=None)
        models[str(ms)] = {
            "s_per_get": a,
            "s_per_byte": b,
            "gib_per_s": 1 / b / 2**30 if b > 0 else None,
            "break_even_gap_bytes": a / b if b > 0 else None,
        }
        for t in TARGETS:  # (c) in full, from the sample's seconds per GET
            sample = next(r for r in rows if (r["rtt_ms"], r["target"], r["path"]) == (ms, t, "raw_exact_sample"))
            rows.append(
                {
                    "rtt_ms": ms,
                    "target": t,
                    "path": "c",
                    "seconds": sample["seconds"] / sample["gets_worst"] * exact[t]["exact_gets"],
                    "extrapolated_from_gets": sample["gets_worst"],
                    "bytes_read_worst": exact[t]["needed_bytes"],
                    "gets_worst": exact[t]["exact_gets"],
                    "device_bytes_moved": 0,
                }
            )
    return {"rows": rows, "exact": exact, "models": models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rtts", default="0,10,40")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sample", type=int, default=2000, help="exact GETs timed per process and target")
    parser.add_argument("--gap", type=int, default=4096, help="runs closer than this merge (counted, not timed)")
    parser.add_argument("--workload", default="medium", help="benchmarks/rivals/workloads.py's (small: a smoke test)")
    parser.add_argument("--out", default="reads.json")
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    from backends.launcher import start_s3
    from backends.proxy import FaultProxy
    from benchmarks.workers import run_workers
    from tests.multiprocess import free_port

    rtts = [int(x) for x in args.rtts.split(",")]
    load = os.getloadavg()
    with start_s3() as s3:
        so = s3.storage_options()
        port = int(s3.endpoint_url.rsplit(":", 1)[1])
        proxies = {ms: FaultProxy("127.0.0.1", port, latency_ms=ms).start() for ms in rtts if ms}
        opts = {"0": so}
        for ms, proxy in proxies.items():
            opts[str(ms)] = {**so, "client_kwargs": {**so["client_kwargs"], "endpoint_url": proxy.endpoint_url}}
        job = {
            "url": s3.url(f"reads/{uuid.uuid4().hex[:8]}"),
            "so": opts,
            "workload": args.workload,
            "rtts": rtts,
            "repeats": args.repeats,
            "sample": args.sample,
            "gap": args.gap,
            "port": free_port(),
        }
        started = time.perf_counter()
        try:
            results = run_workers(
                "benchmarks.bench_reads",
                job,
                processes=PROCESSES,
                devices=DEVICES,
                env_prefix="BENCH_READS",
                timeout=args.timeout,
            )
        finally:
            for proxy in proxies.values():
                proxy.stop()
        elapsed = time.perf_counter() - started
    report = _summarise(results, rtts)
    report.update(
        processes=PROCESSES,
        devices_per_process=DEVICES,
        saved="(4, 2) mesh ('data', 'model'), 2-D leaves P('data', 'model'), 1-D replicated",
        targets={"swapped": "same mesh, 2-D leaves P('model', 'data')", "order": "(4, 2), data the minor device axis"},
        concurrency=results[0]["concurrency"],
        save_s=max(r["save_s"] for r in results),
        gap=args.gap,
        load_before=load,
        load_after=os.getloadavg(),
        run_s=elapsed,
        per_process=results,
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(report, indent=1))
    print(table(report))


def table(report: dict[str, Any]) -> str:
    """docs/PERFORMANCE.md's table from a report."""
    names = {
        "a": "(a) restore",
        "b": "(b) restore, direct",
        "c": "(c) exact GETs*",
        "raw_wider": "raw whole-piece GETs",
    }
    lines = [
        "| RTT | target | path | s | MiB read (worst process) | GETs (worst process) | MiB moved on devices |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if r["path"] not in names:
            continue
        lines.append(
            f"| {r['rtt_ms']} ms | {r['target']} | {names[r['path']]} | {r['seconds']:.2f} |"
            f" {r['bytes_read_worst'] / 2**20:.0f} | {r['gets_worst']:,} | {r['device_bytes_moved'] / 2**20:.0f} |"
        )
    lines += ["", "| RTT | s per GET | GiB/s per process | break-even gap |", "|---|---|---|---|"]
    for ms, m in report["models"].items():
        gap = m["break_even_gap_bytes"]
        lines.append(
            f"| {ms} ms | {m['s_per_get'] * 1e3:.3f} ms | {m['gib_per_s'] or float('nan'):.2f} |"
            f" {gap / 1024 if gap is not None else float('nan'):.0f} KiB |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker_main()
    else:
        main()
