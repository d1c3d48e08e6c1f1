"""objckpt against an overloaded store: the adaptive window of requests in flight against a fixed one.

The latency proxy (``backends/proxy.py``) is put in front of the local S3 server
with ``set_capacity(N)``: it serves N requests at a time and answers the rest
503 SlowDown, as S3 does when clients outrun a prefix. The benchmark's medium
workload (1 GiB, 106 leaves over a (4, 2) mesh) is saved and restored onto the
same sharding three ways, interleaved, at each capacity and latency:

- ``adaptive``: ``Options(adaptive_concurrency=True)`` (the default), as the
  first operation on the bucket (the process's window memory cleared first; the
  restore then starts from what the save learned, as it would in a job);
- ``remembered``: the same, right after an ``adaptive`` run, starting from what
  that run learned (a manager's next save);
- ``fixed``: ``False``, ``max_concurrency`` requests in flight whatever the
  store answers (every refusal is still retried). Reported per cell: medians (and min–max) of save and restore seconds,
the refusals the proxy sent, failed runs.

    python -m benchmarks.bench_throttle [--capacities 4,8] [--latencies 0,10] [--repeats 3]

Writes ``benchmarks/results/throttle.json`` and ``throttle.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

import backends  # noqa: E402
import objckpt  # noqa: E402
from backends.proxy import FaultProxy  # noqa: E402
from benchmarks.rivals import workloads  # noqa: E402
from objckpt.transfer import throttle  # noqa: E402

MODES = {"adaptive": True, "remembered": True, "fixed": False}


def one_run(
    proxy: FaultProxy, storage_options: dict, url: str, workload: workloads.Workload, tree: dict, adaptive: bool
) -> dict[str, Any]:
    """Save then restore ``tree`` at ``url``; seconds and the proxy's refusals of each."""
    options = objckpt.Options(adaptive_concurrency=adaptive)
    out: dict[str, Any] = {}
    try:
        before = proxy.stats.throttled
        started = time.perf_counter()
        objckpt.save(url, tree, storage_options=storage_options, options=options)
        out["save_s"] = time.perf_counter() - started
        out["save_refused"] = proxy.stats.throttled - before
        before = proxy.stats.throttled
        stats = objckpt.TransferStats()
        started = time.perf_counter()
        restored = objckpt.restore(url, tree, storage_options=storage_options, options=options, stats=stats)
        out["restore_s"] = time.perf_counter() - started
        out["restore_refused"] = proxy.stats.throttled - before
        out["restore_requests"] = stats.requests
        pairs = zip(workloads.flat(workload, restored), workloads.flat(workload, tree))
        if not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs):
            out["error"] = "restored bytes differ"
    except Exception as exc:  # a run that fails is a result (the fixed window can exhaust its retries)
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    row: dict[str, Any] = {"runs": len(runs), "failed": len(runs) - len(ok)}
    for key in ("save_s", "save_refused", "restore_s", "restore_refused"):
        values = [r[key] for r in ok]
        if values:
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return row


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "# objckpt against an overloaded store (`python -m benchmarks.bench_throttle`)",
        "",
        "S3 (SeaweedFS) behind the proxy with `set_capacity(N)`: N requests served at a time, the rest",
        "answered 503 SlowDown. Medium workload (1 GiB), same sharding. Medians (min–max) of interleaved runs.",
        "",
        "| capacity | RTT | window | save s | refusals | restore s | refusals | failed |",
        "|---:|---:|---|---|---:|---|---:|---:|",
    ]

    def cell(row: dict[str, Any], key: str, digits: int) -> str:
        if key not in row:
            return "—"
        v = row[key]
        return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}–{v['max']:.{digits}f})"

    for r in results:
        for mode in MODES:
            row = r[mode]
            lines.append(
                f"| {r['capacity']} | {r['latency_ms']:g} ms | {mode} | {cell(row, 'save_s', 2)} |"
                f" {cell(row, 'save_refused', 0)} | {cell(row, 'restore_s', 2)} | {cell(row, 'restore_refused', 0)} |"
                f" {row['failed']}/{row['runs']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacities", default="4,8")
    parser.add_argument("--latencies", default="0,10")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "throttle"))
    args = parser.parse_args(argv)
    workload = workloads.get("medium")
    tree = workloads.jax_tree(workload)
    service = backends.start_s3()
    results = []
    try:
        host, port = service.endpoint_url.rsplit("//", 1)[1].split(":")
        with FaultProxy(host, int(port)) as proxy:
            storage_options = copy.deepcopy(service.storage_options())
            storage_options["client_kwargs"]["endpoint_url"] = proxy.endpoint_url
            for latency in (float(x) for x in args.latencies.split(",")):
                for capacity in (int(x) for x in args.capacities.split(",")):
                    proxy.latency_ms = latency
                    proxy.set_capacity(capacity)
                    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
                    for i in range(args.repeats):
                        order = list(MODES) if i % 2 == 0 else ["fixed", "adaptive", "remembered"]
                        for mode in order:
                            if mode == "adaptive":
                                throttle.MEMORY.clear()
                            url = service.url(f"bench-throttle/{uuid.uuid4().hex[:8]}")
                            out = one_run(proxy, storage_options, url, workload, tree, MODES[mode])
                            runs[mode].append(out)
                            print(f"capacity {capacity} rtt {latency:g} ms {mode}: {out}", flush=True)
                    results.append(
                        {
                            "capacity": capacity,
                            "latency_ms": latency,
                            **{m: summarize(runs[m]) for m in MODES},
                            "raw": runs,
                        }
                    )
    finally:
        service.stop()
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
