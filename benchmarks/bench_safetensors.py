"""Issue 64's targets: export to safetensors against a raw copy, and restore from safetensors against objckpt's own.

The benchmark's medium workload (1 GiB, 106 leaves over a (4, 2) mesh of 8 CPU devices, plus
an int step, left out of the export) is saved once to the local S3 server (SeaweedFS, warmed
up first) behind ``backends.proxy.FaultProxy`` at ``--rtt-ms`` (10: same region). Then,
interleaved, each in a fresh process (``--child``), each ``--repeats`` times:

- **cp**: ``objckpt.copy(..., server_side=False)``, every byte through the client: the raw
  copy of the same bytes (also ``cp server-side``, CopyObject, for reference);
- **export**: ``objckpt.export_safetensors`` S3 → S3 with the default ``max_shard_bytes``
  (5 GiB: one ``model.safetensors``) and with ``--shard-mib`` (several files and an index);
  the process's peak RSS above its baseline after imports (``ru_maxrss``) against
  ``max_shard_bytes`` + 256 MiB;
- **restore**: the sharded export read by ``objckpt.restore`` onto the (4, 2) mesh and onto
  one device, against ``objckpt.restore`` of the saved checkpoint onto the same targets;
  bytes read against the bytes the target's devices need (one process: every byte once).

Every restore is compared bit for bit with the saved values. Writes
``benchmarks/results/safetensors.json`` and ``safetensors.md``.

    python -m benchmarks.bench_safetensors [--repeats 3] [--rtt-ms 10] [--shard-mib 256]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MiB = 2**20


def _drop_step(name: str) -> str | None:
    return None if name == "step" else name


def _check(workload: Any, restored: Any) -> None:
    import numpy as np

    from benchmarks.rivals import workloads

    for leaf, got in zip(workload.leaves, workloads.flat(workload, restored), strict=True):
        if not np.array_equal(np.asarray(got), workloads.leaf_values(leaf)):
            raise RuntimeError(f"restored bytes differ at {leaf.path}")


class _PeakRss:
    """This process's resident set sampled every 5 ms (``ru_maxrss`` survives ``exec``: a child
    started by a parent holding the state would report the parent's peak)."""

    def __init__(self) -> None:
        import threading

        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.now())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.now())


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement in this fresh process: seconds, bytes, peak RSS growth."""
    import jax
    from jax.sharding import SingleDeviceSharding

    import objckpt
    from benchmarks.rivals import workloads

    opts = spec["storage_options"]
    workload = workloads.get(spec["workload"])
    jax.devices()  # the backend's own memory is part of the baseline
    baseline = _PeakRss.now()
    sampler = _PeakRss()
    phase = spec["phase"]
    started = time.perf_counter()
    row: dict[str, Any] = {}
    if phase.startswith("cp"):
        stats = objckpt.copy(
            spec["src"], spec["dst"], src_storage_options=opts, dst_storage_options=opts,
            server_side=phase == "cp server-side",
        )  # fmt: skip
        row = {"method": stats.method, "bytes": stats.bytes_copied}
    elif phase.startswith("export"):
        kw = {"max_shard_bytes": spec["max_shard_bytes"]} if spec.get("max_shard_bytes") else {}
        stats = objckpt.export_safetensors(spec["src"], spec["dst"], names=_drop_step, src_storage_options=opts, **kw)
        row = {"files": len(stats.files), "bytes": stats.tensor_bytes, "bytes_read": stats.bytes_read}
    else:  # restore <safetensors|objckpt> <mesh|one device>
        target = workloads.abstract_tree(workload, "save")
        del target["step"]
        if phase.endswith("one device"):
            one = SingleDeviceSharding(jax.devices()[0])
            target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), target)
        stats = objckpt.TransferStats()
        restored = objckpt.restore(spec["src"], target, partial=True, storage_options=opts, stats=stats)
        jax.block_until_ready(restored)
        row = {"bytes_read": stats.bytes_read, "needed": workload.nbytes}
        seconds = time.perf_counter() - started
        _check(workload, restored)
        row["seconds"] = seconds
    row.setdefault("seconds", time.perf_counter() - started)
    row["peak_rss_growth"] = sampler.stop() - baseline
    return row


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_safetensors", "--child", json.dumps(spec)],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    if run.returncode != 0:
        return {"error": run.stderr.strip().splitlines()[-1][:300] if run.stderr.strip() else f"rc {run.returncode}"}
    return json.loads(run.stdout.strip().splitlines()[-1])


def _through(proxy: Any, options: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(options)
    out["client_kwargs"]["endpoint_url"] = proxy.endpoint_url
    return out


PHASES = (
    "cp streamed",
    "cp server-side",
    "export one file",
    "export sharded",
    "restore safetensors (4, 2) mesh",
    "restore objckpt (4, 2) mesh",
    "restore safetensors one device",
    "restore objckpt one device",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="medium")
    parser.add_argument("--rtt-ms", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "safetensors"))
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0

    import backends
    import objckpt
    from backends.proxy import FaultProxy
    from benchmarks.rivals import workloads

    workload = workloads.get(args.workload)
    service = backends.start_s3()
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PHASES}
    try:
        host, port = service.endpoint_url.rsplit("//", 1)[1].split(":")
        with FaultProxy(host, int(port), latency_ms=args.rtt_ms) as proxy:
            opts = _through(proxy, service.storage_options())
            tree = workloads.jax_tree(workload)
            objckpt.save(service.url(f"bench-st/warm-{uuid.uuid4().hex[:6]}"), tree, storage_options=opts)  # warm up
            src = service.url(f"bench-st/src-{uuid.uuid4().hex[:6]}")
            objckpt.save(src, tree, storage_options=opts)
            del tree
            base = {"workload": workload.name, "storage_options": opts, "src": src}
            sharded = service.url(f"bench-st/export-{uuid.uuid4().hex[:6]}")
            objckpt.export_safetensors(
                src, sharded, names=_drop_step, max_shard_bytes=args.shard_mib * MiB, src_storage_options=opts
            )
            for i in range(args.repeats):
                order = list(PHASES[i % len(PHASES) :] + PHASES[: i % len(PHASES)])
                for phase in order:
                    spec = {**base, "phase": phase, "dst": service.url(f"bench-st/{uuid.uuid4().hex[:10]}")}
                    if phase == "export sharded":
                        spec["max_shard_bytes"] = args.shard_mib * MiB
                    if phase.startswith("restore safetensors"):
                        spec["src"] = sharded
                    row = _run_child(spec)
                    runs[phase].append(row)
                    print(f"repeat {i} {phase}: {row}", flush=True)
    finally:
        service.stop()
    result = {
        "workload": workload.name,
        "bytes": workload.nbytes,
        "leaves": len(workload.leaves),
        "rtt_ms": args.rtt_ms,
        "repeats": args.repeats,
        "shard_mib": args.shard_mib,
        "phases": {p: _summary(runs[p]) for p in PHASES},
        "raw": runs,
    }
    result["targets"] = _targets(result)
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out + ".md").write_text(report(result))
    print(report(result))
    return 0


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r]
    out: dict[str, Any] = {"runs": len(rows), "failed": len(rows) - len(ok)}
    if ok:
        for key in ("seconds", "peak_rss_growth", "bytes_read"):
            values = [r[key] for r in ok if key in r]
            if values:
                out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        if "needed" in ok[0]:
            out["needed"] = ok[0]["needed"]
    if len(ok) != len(rows):
        out["errors"] = [r["error"] for r in rows if "error" in r]
    return out


def _median(result: dict[str, Any], phase: str, key: str = "seconds") -> float | None:
    row = result["phases"][phase].get(key)
    return None if row is None else row["median"]


def _targets(result: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cp = _median(result, "cp streamed")
    for phase, shard in (("export one file", 5 * 2**30), ("export sharded", result["shard_mib"] * MiB)):
        seconds, rss = _median(result, phase), _median(result, phase, "peak_rss_growth")
        if cp and seconds:
            bound = min(shard, result["bytes"]) + 256 * MiB
            out[phase] = {
                "speed_vs_cp": cp / seconds,
                "speed_ok": cp / seconds >= 0.8,
                "peak_rss_growth_mib": (rss or 0) / MiB,
                "bound_mib": bound / MiB,
                "rss_ok": (rss or 0) <= bound,
            }
    for where in ("(4, 2) mesh", "one device"):
        ours, theirs = _median(result, f"restore safetensors {where}"), _median(result, f"restore objckpt {where}")
        read = _median(result, f"restore safetensors {where}", "bytes_read")
        needed = result["phases"][f"restore safetensors {where}"].get("needed")
        if ours and theirs and read and needed:
            out[f"restore {where}"] = {
                "speed_vs_objckpt": theirs / ours,
                "speed_ok": theirs / ours >= 0.9,
                "read_vs_needed": read / needed,
                "read_ok": read / needed <= 1.1,
            }
    return out


def report(result: dict[str, Any]) -> str:
    gib = result["bytes"] / 2**30
    lines = [
        "# Safetensors export and import (issue 64)",
        "",
        f"{result['workload']} workload: {gib:.2f} GiB in {result['leaves']} leaves, 8 CPU devices, S3 (SeaweedFS)"
        f" at {result['rtt_ms']:g} ms RTT, medians of {result['repeats']} (fresh process each).",
        "",
        "| phase | seconds (min–max) | GiB/s | bytes read | peak RSS growth |",
        "|---|---|---|---|---|",
    ]
    for phase, row in result["phases"].items():
        if "seconds" not in row:
            lines.append(f"| {phase} | failed: {'; '.join(row.get('errors', []))[:120]} | | | |")
            continue
        s = row["seconds"]
        read = row.get("bytes_read", {}).get("median")
        rss = row.get("peak_rss_growth", {}).get("median", 0)
        lines.append(
            f"| {phase} | {s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f}) | {gib / s['median']:.3f} |"
            f" {'' if read is None else f'{read / 2**30:.3f} GiB'} | {rss / MiB:.0f} MiB |"
        )
    lines += ["", "| target | measured | holds |", "|---|---|---|"]
    for name, t in result["targets"].items():
        if "speed_vs_cp" in t:
            lines.append(f"| {name} ≥ 0.8× cp streamed | {t['speed_vs_cp']:.2f}× | {t['speed_ok']} |")
            lines.append(
                f"| {name} peak RSS ≤ {t['bound_mib']:.0f} MiB | {t['peak_rss_growth_mib']:.0f} MiB | {t['rss_ok']} |"
            )
        else:
            lines.append(f"| {name} ≥ 0.9× objckpt restore | {t['speed_vs_objckpt']:.2f}× | {t['speed_ok']} |")
            lines.append(f"| {name} read ≤ 1.1× needed | {t['read_vs_needed']:.3f}× | {t['read_ok']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
