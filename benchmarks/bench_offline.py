"""Offline jobs on Dask (issue 80 item 3): an Orbax checkpoint converted, exported and verified
with 1 and 4 local workers (and in one process, for the reference), through the latency proxy.

The local S3 (``backends/``) behind :class:`backends.proxy.FaultProxy` at ``--rtt-ms``; an Orbax
checkpoint of ``--gib`` GiB (16 float32 leaves) on local disk. For each way of running (one
process; a fresh ``LocalCluster`` of N one-thread worker processes per job): ``convert_orbax``
to S3, ``export_safetensors`` of it (``--shard`` files), ``verify`` of it. Recorded per job:
seconds, the workers' peak RSS (each worker's ``ru_maxrss``; the driver's too), and whether
the result equals the one-process run's (every object's bytes; a manifest's ``created`` aside).
On a 2-core machine the point is correctness and bounded memory per worker, not speed-up.

    python -m benchmarks.bench_offline [--gib 4] [--workers 1 4] [--rtt-ms 10] [--memory-per-worker 512MiB]

Writes ``benchmarks/results/offline.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"
MiB, GiB = 1 << 20, 1 << 30


def _peak_rss() -> int:
    """This process's peak RSS: ``VmHWM`` (``ru_maxrss`` keeps the parent's peak across exec on Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _digest(url: str, options: dict[str, Any]) -> str:
    """One hash of every object under ``url`` (keys and bytes), a manifest's ``created`` left out."""
    from objckpt.transfer import runtime
    from objckpt.transfer.retries import opened_store

    h = hashlib.sha256()
    import objckpt

    with opened_store(url, options, objckpt.Options()) as store:
        for info in sorted(runtime.run_sync(store.list()), key=lambda o: o.key):
            data = bytes(runtime.run_sync(store.get(info.key)))
            if info.key == "manifest.json":
                data = re.sub(rb'"created":"[^"]*"', b"", data)
            h.update(info.key.encode() + b"\0" + data)
    return h.hexdigest()


def _orbax(path: Path, total: int) -> None:
    import orbax.checkpoint as ocp

    rng = np.random.default_rng(0)
    n = total // 16 // 4
    ocp.PyTreeCheckpointer().save(path, {f"w{i:02d}": rng.random(n, dtype=np.float32) for i in range(16)})


def _jobs(src: str, s3: Any, options: dict[str, Any], objckpt_options: Any, shard: int) -> list[tuple[str, Any]]:
    """(name, run(client, tag) -> url written or read) for convert, export and verify, in order."""
    import objckpt

    def convert(client: Any, tag: str) -> str:
        url = s3.url(f"offline-{tag}/native")
        kw = {"dst_storage_options": options, "options": objckpt_options}
        objckpt.convert_orbax(src, url, client=client, **kw)
        return url

    def export(client: Any, tag: str) -> str:
        url = s3.url(f"offline-{tag}/hf")
        kw = {"src_storage_options": options, "dst_storage_options": options, "options": objckpt_options}
        objckpt.export_safetensors(s3.url(f"offline-{tag}/native"), url, max_shard_bytes=shard, client=client, **kw)
        return url

    def verify(client: Any, tag: str) -> str:
        url = s3.url(f"offline-{tag}/native")
        report = objckpt.verify(url, storage_options=options, options=objckpt_options, client=client)
        assert report.ok, report
        return ""

    return [("convert", convert), ("export", export), ("verify", verify)]


def main() -> None:
    from objckpt.cli._stores import parse_size

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rtt-ms", type=float, default=10.0)
    parser.add_argument("--memory-per-worker", type=parse_size, default=512 * MiB)
    parser.add_argument("--shard", type=parse_size, default=256 * MiB, help="export's largest file")
    parser.add_argument("--make-orbax", metavar="PATH", help=argparse.SUPPRESS)  # the child that writes the source
    args = parser.parse_args()
    if args.make_orbax:
        _orbax(Path(args.make_orbax), int(args.gib * GiB))
        return

    import distributed

    import backends
    import objckpt
    from backends.proxy import FaultProxy

    total = int(args.gib * GiB)
    tmp = Path(tempfile.mkdtemp(prefix="bench-offline-"))
    s3 = backends.start_s3()
    records: list[dict[str, Any]] = []
    try:
        make = [
            sys.executable,
            "-m",
            "benchmarks.bench_offline",
            "--gib",
            str(args.gib),
            "--make-orbax",
            str(tmp / "orbax"),
        ]
        subprocess.run(make, check=True)  # in a child: its arrays stay out of this process's peak RSS
        with FaultProxy("127.0.0.1", int(s3.endpoint_url.rsplit(":", 1)[1]), latency_ms=args.rtt_ms) as proxy:
            base = s3.storage_options()
            options = {**base, "client_kwargs": {**base["client_kwargs"], "endpoint_url": proxy.endpoint_url}}
            objckpt.save(
                s3.url(f"warm-{uuid.uuid4().hex[:8]}"),
                {"w": np.ones(64 * MiB // 4, np.float32)},
                storage_options=options,
            )
            tuned = objckpt.Options(memory_budget=args.memory_per_worker)
            jobs = _jobs(str(tmp / "orbax"), s3, options, tuned, args.shard)
            want: dict[str, str] = {}
            for workers in [0, *args.workers]:
                tag = f"{workers}w-{uuid.uuid4().hex[:6]}"
                for name, run in jobs:
                    record: dict[str, Any] = {"job": name, "workers": workers, "checkpoint_bytes": total}
                    record |= {"rtt_ms": args.rtt_ms, "memory_per_worker": args.memory_per_worker}
                    started = time.perf_counter()
                    if workers == 0:
                        url = run(None, tag)
                    else:
                        limit = args.memory_per_worker + (1 << 30)
                        with (
                            distributed.LocalCluster(
                                n_workers=workers, threads_per_worker=1, memory_limit=limit, dashboard_address=None
                            ) as lc,
                            distributed.Client(lc) as client,
                        ):
                            started = time.perf_counter()  # the cluster's start left out
                            url = run(client, tag)
                            record["seconds"] = time.perf_counter() - started
                            peaks = client.run(_peak_rss)
                            record["worker_peak_rss_mib"] = sorted(round(v / MiB) for v in peaks.values())
                    record.setdefault("seconds", time.perf_counter() - started)
                    record["driver_peak_rss_mib_so_far"] = round(_peak_rss() / MiB)
                    if url:
                        digest = _digest(url, base)
                        record["identical_to_one_process"] = want.setdefault(name, digest) == digest
                    records.append(record)
                    print(json.dumps(record), flush=True)
    finally:
        s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "offline.json").write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
