"""Regions: replicating a checkpoint to another bucket, and restoring from the nearest copy.

Two "regions" on the local S3 server (SeaweedFS), each a bucket behind its own
latency proxy (``backends/proxy.py``): ``near`` at ``--near-ms`` RTT (10 by
default, same region) and ``far`` at ``--far-ms`` (40, another region). The
benchmark's medium workload (1 GiB, 106 leaves over a (4, 2) mesh) is saved
near once per repeat, then, interleaved:

- **replicate**: ``objckpt.copy`` of the step to a fresh prefix of another
  bucket through the far endpoint, server-side (S3 ``CopyObject``: the bytes
  stay in the store) and streamed (``server_side=False``: every byte through the
  client, within the memory budget). Client bytes are what crossed the proxy.
- **restore** onto the saved sharding (the three in turn first, repeat by repeat): from ``near`` with the far copy as a
  replica (it must pick near), from ``far`` alone (the price of no nearby copy),
  and from ``near`` failing at 50% of the bytes (the proxy then resets every
  connection open and every request after: the rest comes from far). Bytes per location are counted at
  the proxies.

    python -m benchmarks.bench_regions [--workload medium] [--near-ms 10] [--far-ms 40] [--repeats 3]

Writes ``benchmarks/results/regions.json`` and ``regions.md``.
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

import jax  # noqa: E402
import numpy as np  # noqa: E402

import backends  # noqa: E402
import objckpt  # noqa: E402
from backends.proxy import FaultProxy  # noqa: E402
from benchmarks.rivals import workloads  # noqa: E402

FAR_BUCKET = "objckpt-bench-far"
PHASES = ("replicate server-side", "replicate streamed", "restore near", "restore far", "restore near failing at 50%")


def _through(proxy: FaultProxy, options: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(options)
    out["client_kwargs"]["endpoint_url"] = proxy.endpoint_url
    return out


def _moved(proxies: dict[str, FaultProxy]) -> dict[str, int]:
    return {name: p.stats.bytes_up + p.stats.bytes_down for name, p in proxies.items()}


def _same(workload: workloads.Workload, restored: Any, tree: Any) -> bool:
    pairs = zip(workloads.flat(workload, restored), workloads.flat(workload, tree), strict=True)
    return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)


def one_repeat(
    service: Any, proxies: dict[str, FaultProxy], workload: workloads.Workload, tree: Any, size: int, turn: int
) -> dict[str, dict[str, Any]]:
    """Every phase once, on a fresh save; seconds and bytes per location of each."""
    s3 = service.storage_options()
    near_opts, far_opts = _through(proxies["near"], s3), _through(proxies["far"], s3)
    name = uuid.uuid4().hex[:8]
    near_url = service.url(f"bench-regions/{name}")
    objckpt.save(near_url, tree, storage_options=near_opts)
    out: dict[str, dict[str, Any]] = {}
    target = workloads.abstract_tree(workload, "save")

    def measure(phase: str, run: Any) -> None:
        before = _moved(proxies)
        started = time.perf_counter()
        try:
            extra = run() or {}
            row = {"seconds": time.perf_counter() - started, **extra}
        except Exception as exc:  # a failed phase is a result
            row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        after = _moved(proxies)
        row["bytes_by_proxy"] = {k: after[k] - before[k] for k in after}
        out[phase] = row
        print(f"{phase}: {row}", flush=True)

    far_url = f"s3://{FAR_BUCKET}/bench-regions/{name}"
    streamed_url = f"s3://{FAR_BUCKET}/bench-regions/{name}-streamed"

    def replicate(dst: str, server_side: bool) -> dict[str, Any]:
        # Both sides through the far endpoint: one provider and account, so server-side can apply.
        stats = objckpt.copy(
            near_url, dst, src_storage_options=far_opts, dst_storage_options=far_opts, server_side=server_side
        )
        return {
            "method": stats.method,
            "bytes_copied": stats.bytes_copied,
            "client_bytes": stats.bytes_read + stats.bytes_written,
        }

    measure("replicate server-side", lambda: replicate(far_url, True))
    measure("replicate streamed", lambda: replicate(streamed_url, False))

    def restore(url: str, opts: dict[str, Any], replicas: list[Any]) -> dict[str, Any]:
        stats = objckpt.TransferStats()
        restored = objckpt.restore(url, target, storage_options=opts, replicas=replicas, stats=stats)
        jax.block_until_ready(restored)
        if not _same(workload, restored, tree):
            raise RuntimeError("restored bytes differ")
        return {"bytes_by_location": dict(stats.bytes_by_location)}

    far_loc = objckpt.Location(far_url, far_opts)

    def failing() -> dict[str, Any]:
        proxies["near"].fail_after(proxies["near"].stats.bytes_down + size // 2, "reset", cut_open=True)
        try:
            return restore(near_url, near_opts, [far_loc])
        finally:
            proxies["near"].fail_after(None)

    restores = [
        ("restore near", lambda: restore(near_url, near_opts, [far_loc])),
        ("restore far", lambda: restore(far_url, far_opts, [])),
        ("restore near failing at 50%", failing),
    ]
    for phase, run in restores[turn % 3 :] + restores[: turn % 3]:  # each first once in three repeats
        measure(phase, run)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    row: dict[str, Any] = {"runs": len(runs), "failed": len(runs) - len(ok)}
    if ok:
        seconds = [r["seconds"] for r in ok]
        row["seconds"] = {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds)}
        for key in ("near", "far"):
            row[f"bytes_{key}"] = statistics.median(r["bytes_by_proxy"][key] for r in ok)
        row["methods"] = sorted({r["method"] for r in ok if "method" in r})
    if len(ok) != len(runs):
        row["errors"] = [r["error"] for r in runs if "error" in r]
    return row


def markdown(result: dict[str, Any]) -> str:
    size = result["bytes"]
    lines = [
        "# Regions (`python -m benchmarks.bench_regions`)",
        "",
        f"{result['workload']} workload ({size / 2**30:.2f} GiB) on S3 (SeaweedFS): near bucket at"
        f" {result['near_ms']:g} ms RTT, far bucket at {result['far_ms']:g} ms, each behind its own proxy."
        f" Medians (min–max) of {result['repeats']} interleaved repeats; bytes are what crossed each proxy"
        " (requests and responses, heads included).",
        "",
        "| phase | seconds | GiB/s | bytes via near | bytes via far | failed |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for phase in PHASES:
        row = result["phases"][phase]
        if "seconds" not in row:
            lines.append(f"| {phase} | — | — | — | — | {row['failed']}/{row['runs']} |")
            continue
        s = row["seconds"]
        rate = size / s["median"] / 2**30
        lines.append(
            f"| {phase} | {s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f}) | {rate:.3f} |"
            f" {row['bytes_near'] / 2**20:,.1f} MiB | {row['bytes_far'] / 2**20:,.1f} MiB | {row['failed']}/{row['runs']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="medium")
    parser.add_argument("--near-ms", type=float, default=10.0)
    parser.add_argument("--far-ms", type=float, default=40.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "regions"))
    args = parser.parse_args(argv)
    workload = workloads.get(args.workload)
    tree = workloads.jax_tree(workload)
    service = backends.start_s3()
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PHASES}
    try:
        service.make_bucket(FAR_BUCKET)
        host, port = service.endpoint_url.rsplit("//", 1)[1].split(":")
        with (
            FaultProxy(host, int(port), latency_ms=args.near_ms) as near,
            FaultProxy(host, int(port), latency_ms=args.far_ms) as far,
        ):
            proxies = {"near": near, "far": far}
            for i in range(args.repeats):
                print(f"repeat {i}", flush=True)
                for phase, row in one_repeat(service, proxies, workload, tree, workload.nbytes, i).items():
                    runs[phase].append(row)
    finally:
        service.stop()
    result = {
        "workload": workload.name,
        "bytes": workload.nbytes,
        "near_ms": args.near_ms,
        "far_ms": args.far_ms,
        "repeats": args.repeats,
        "phases": {p: summarize(runs[p]) for p in PHASES},
        "raw": runs,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
