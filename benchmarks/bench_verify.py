"""verify(read_data=False) against the full read: bytes, requests and time (issue 63, part 2).

Two parts, each writing its records into ``benchmarks/results/verify.json`` (and a table,
``verify.md``):

``--part store`` (the local S3 and GCS servers of ``backends/``, every request through a
byte-counting proxy): a 1 GiB checkpoint (16 leaves of f32, 32 MiB blobs) saved (with each
blob's CRC-32C sent: on S3 through botocore, checked on arrival; the same save with plain
obstore PUTs beside it), then verified with ``read_data=False`` and with the full read:
bytes down, requests, seconds. Then a checkpoint of many small blobs verified
``--no-read`` on S3, for the client's CPU per HEAD (botocore), which the pod figure adds.

``--part pod`` (no data; a child with forced CPU devices): bench_scale's 405B save on 4,096
devices (1,024 processes, ≈ 45k objects) planned with the library's own functions and
verified ``--no-read`` from its URL through :class:`benchmarks.scale.verify_pod.PodStore`
at a 10 ms round trip, S3-like (a HEAD per blob) and GCS-like (checksums in the listing),
at the engine's default window and at 256 requests in flight.

    python -m benchmarks.bench_verify --part store
    python -m benchmarks.bench_verify --part pod [--devices 4096] [--layout stacked] [--rtt-ms 10]
    python -m benchmarks.bench_verify --part pod --layout unstacked   # one process, times 1,024

The unstacked layout (14k pieces a process) is too large to build every index object here:
its record is one process's parse and expected-CRC CPU times the processes (``extrapolated``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30


# ------------------------------------------------------------------------------- store part


def _port(endpoint_url: str) -> int:
    return int(endpoint_url.rsplit(":", 1)[1])


def _through(kind: str, service: Any, proxy: Any) -> dict[str, Any]:
    options = service.storage_options()
    if kind == "s3":
        return {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}}
    return {**options, "endpoint_url": proxy.endpoint_url}


def _state(total: int, leaves: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = total // leaves // 4
    return {f"w{i:02d}": rng.standard_normal(n, dtype=np.float32) for i in range(leaves)}


def _timed(fn: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def store_part(total: int, small_blobs: int) -> list[dict[str, Any]]:
    import backends
    import objckpt
    from backends.proxy import FaultProxy
    from objckpt.transfer import engine

    state = _state(total)
    records: list[dict[str, Any]] = []
    s3, gcs = backends.start_s3(), backends.start_gcs()
    try:
        for kind, service in (("s3", s3), ("gcs", gcs)):
            with FaultProxy("127.0.0.1", _port(service.endpoint_url)) as proxy:
                options = _through(kind, service, proxy)
                warm = service.url(f"verify-warm-{uuid.uuid4().hex[:8]}")
                objckpt.save(warm, _state(64 << 20), storage_options=options)  # a fresh server grows its volumes
                saves = [("checked", True), ("plain", False)] if kind == "s3" else [("checked", True)]
                for label, checked in saves:
                    url = service.url(f"verify-{uuid.uuid4().hex[:8]}/ckpt")
                    original = engine.checks_at_arrival
                    if not checked:
                        engine.checks_at_arrival = lambda store: None  # type: ignore[assignment]
                    try:
                        _, save_s, save_cpu = _timed(lambda: objckpt.save(url, state, storage_options=options))  # noqa: B023
                    finally:
                        engine.checks_at_arrival = original
                    record: dict[str, Any] = {
                        "part": "store",
                        "store": kind,
                        "save": label,
                        "checkpoint_bytes": total,
                        "save_s": save_s,
                        "save_cpu_s": save_cpu,
                        "save_gib_s": total / GiB / save_s,
                    }
                    if checked:
                        for read_data in (False, True):
                            before = proxy.stats.bytes_down
                            report, wall, cpu = _timed(
                                lambda: objckpt.verify(url, read_data=read_data, storage_options=options)  # noqa: B023
                            )
                            assert report.ok, report
                            name = "full" if read_data else "no_read"
                            record[f"{name}_bytes_down"] = proxy.stats.bytes_down - before
                            record[f"{name}_share"] = (proxy.stats.bytes_down - before) / total
                            record[f"{name}_requests"] = report.requests
                            record[f"{name}_s"] = wall
                            record[f"{name}_cpu_s"] = cpu
                            record["blobs"] = report.blobs
                    records.append(record)
                    print(json.dumps(record), flush=True)
        records.append(_per_head(s3, small_blobs))
    finally:
        s3.stop()
        gcs.stop()
    return records


def _per_head(s3: Any, blobs: int) -> dict[str, Any]:
    """Client CPU per blob of a ``--no-read`` verify on S3 (a HEAD each, botocore), from a
    checkpoint of ``blobs`` small blobs."""
    import objckpt

    url = s3.url(f"verify-many-{uuid.uuid4().hex[:8]}/ckpt")
    options = s3.storage_options()
    tree = {f"x{i:05d}": np.full(1024, i, dtype=np.float32) for i in range(blobs)}
    objckpt.save(url, tree, storage_options=options, options=objckpt.Options(blob_size=4096))
    report, wall, cpu = _timed(lambda: objckpt.verify(url, read_data=False, storage_options=options))
    assert report.ok, report
    record = {
        "part": "store",
        "store": "s3",
        "save": "many small blobs",
        "blobs": report.blobs,
        "no_read_requests": report.requests,
        "no_read_s": wall,
        "no_read_cpu_s": cpu,
        "cpu_s_per_blob": cpu / report.blobs,
        "s_per_blob": wall / report.blobs,
    }
    print(json.dumps(record), flush=True)
    return record


# --------------------------------------------------------------------------------- pod part


def run_pod(n: int, layout: str, layers: int, rtt: float, windows: list[int]) -> list[dict[str, Any]]:
    """In a child with ``n`` forced CPU devices: the save built, then verified ``--no-read`` per store and window."""
    import objckpt
    from benchmarks.scale.state import DEVICES_PER_HOST, make_mesh, state_tree
    from benchmarks.scale.verify_pod import PodStore, build_save
    from objckpt.core.tree import flatten
    from objckpt.storage.registry import register_store

    state = state_tree(make_mesh((max(1, n // 8), 8)), layout, layers)
    leaves, skeleton = flatten(state)
    if layout == "unstacked":  # 14k pieces a process: one process measured, times the processes
        from benchmarks.scale.verify_pod import one_process

        record = {"part": "pod", "devices": n, "layout": layout, "layers": layers}
        record.update(one_process(leaves, skeleton, n // DEVICES_PER_HOST))
        print(json.dumps(record), flush=True)
        return [record]
    objects, blobs, figures = build_save(leaves, skeleton, n // DEVICES_PER_HOST)
    del state
    records = []
    for cloud, lists in (("s3", False), ("gcs", True)):
        for window in windows:
            store = PodStore(f"pod://{cloud}", objects, blobs, rtt=rtt, lists=lists)
            register_store("pod", lambda url, _store=store, **_: _store)
            options = objckpt.Options(max_concurrency=window)
            report, wall, cpu = _timed(lambda: objckpt.verify("pod://ckpt", read_data=False, options=options))  # noqa: B023
            assert report.ok and report.blobs == len(blobs), report
            requests = sum(store.counts.values())
            record = {
                "part": "pod",
                "devices": n,
                "layout": layout,
                "layers": layers,
                **figures,
                "objects": len(objects) + len(blobs),
                "store": cloud,
                "rtt_ms": rtt * 1000,
                "window": window,
                "requests": requests,
                "request_counts": dict(store.counts),
                "no_read_s": wall,
                "no_read_cpu_s": cpu,
            }
            records.append(record)
            print(json.dumps(record), flush=True)
    return records


def spawn_pod(
    n: int, layout: str, layers: int, rtt_ms: float, windows: list[int], timeout: float
) -> list[dict[str, Any]]:
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    argv = [sys.executable, "-m", "benchmarks.bench_verify", "--pod-child", "--devices", str(n), "--layout", layout]
    argv += ["--layers", str(layers), "--rtt-ms", str(rtt_ms), "--windows", ",".join(map(str, windows))]
    proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"bench_verify pod child at {n} devices ran past {timeout:.0f} s") from None
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench_verify pod child failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT ") :])


# ----------------------------------------------------------------------------------- output


def _merge(path: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The file's records, those this run measured again (same part, layout, devices) replaced."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r.get("part"), r.get("layout"), r.get("devices"))

    new = {key(r) for r in records}
    kept = [r for r in json.loads(path.read_text()) if key(r) not in new] if path.exists() else []
    return kept + records


def markdown(records: list[dict[str, Any]]) -> str:
    lines = ["# verify --no-read (benchmarks/bench_verify.py)", ""]
    store = [r for r in records if r["part"] == "store" and "checkpoint_bytes" in r]
    if store:
        lines += [
            "| store | save | save GiB/s | no-read bytes down (share) | requests | s | full read bytes down | s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in store:
            if "no_read_bytes_down" in r:
                lines.append(
                    f"| {r['store']} | {r['save']} | {r['save_gib_s']:.3f} | {r['no_read_bytes_down']:,}"
                    f" ({r['no_read_share']:.4%}) | {r['no_read_requests']} | {r['no_read_s']:.2f}"
                    f" | {r['full_bytes_down']:,} | {r['full_s']:.2f} |"
                )
            else:
                lines.append(f"| {r['store']} | {r['save']} | {r['save_gib_s']:.3f} | | | | | |")
        lines.append("")
    for r in (r for r in records if r["part"] == "store" and "cpu_s_per_blob" in r):
        lines.append(
            f"S3, {r['blobs']} small blobs, --no-read: {r['no_read_s']:.2f} s, {r['no_read_cpu_s']:.2f} CPU-s"
            f" ({r['cpu_s_per_blob'] * 1e3:.2f} ms CPU per blob: a HEAD each, signed by botocore, sent over"
            " kept-alive HTTP)."
        )
        lines.append("")
    for r in (r for r in records if r["part"] == "pod" and r.get("extrapolated")):
        lines.append(
            f"{r['devices']} devices, {r['layout']}: {r['pieces_per_process']:,} pieces and {r['blobs_per_process']}"
            f" blobs a process; one index object parsed in {r['parse_cpu_s_per_process']:.3f} CPU-s, its blobs'"
            f" expected crc32c in {r['combine_cpu_s_per_process']:.3f}; times {r['processes']} processes:"
            f" {r['parse_cpu_s']:.0f} + {r['combine_cpu_s']:.0f} CPU-s (extrapolated)."
        )
        lines.append("")
    pod = [r for r in records if r["part"] == "pod" and not r.get("extrapolated")]
    if pod:
        lines += [
            "| devices | layout | objects | pieces | index bytes | store | RTT ms | window | requests | s | CPU-s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in pod:
            lines.append(
                f"| {r['devices']} | {r['layout']} | {r['objects']:,} | {r['pieces']:,} | {r['index_bytes']:,}"
                f" | {r['store']} | {r['rtt_ms']:g} | {r['window']} | {r['requests']:,} | {r['no_read_s']:.1f}"
                f" | {r['no_read_cpu_s']:.1f} |"
            )
        lines.append("")
        per_head = [r["cpu_s_per_blob"] for r in records if r["part"] == "store" and "cpu_s_per_blob" in r]
        s3_pod = [r for r in pod if r["store"] == "s3"]
        if per_head and s3_pod:
            best = min(s3_pod, key=lambda r: r["no_read_s"])
            heads = best["request_counts"].get("head", best["requests"])
            bound = best["no_read_s"] + per_head[-1] * heads
            lines.append(
                f"On S3 from one host, at most {bound:.0f} s: the pod run's {best['no_read_s']:.1f} s (window"
                f" {best['window']}, its store answering in-process) plus the small-blob run's whole client CPU"
                f" per blob ({per_head[-1] * 1e3:.2f} ms) for each of its {heads:,} HEADs, as if none of it"
                " overlapped (goal: 60 s)."
            )
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["store", "pod"], default="store")
    parser.add_argument("--bytes", type=int, default=GiB, help="the store part's checkpoint size")
    parser.add_argument("--small-blobs", type=int, default=2000, help="blobs of the per-HEAD measurement")
    parser.add_argument("--devices", type=int, default=4096)
    parser.add_argument("--layout", default="stacked")
    parser.add_argument("--layers", type=int, default=126)
    parser.add_argument("--rtt-ms", type=float, default=10.0)
    parser.add_argument("--windows", default="32,256")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=RESULTS / "verify.json")
    parser.add_argument("--pod-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    windows = [int(w) for w in args.windows.split(",")]
    if args.pod_child:
        records = run_pod(args.devices, args.layout, args.layers, args.rtt_ms / 1000, windows)
        print("RESULT " + json.dumps(records), flush=True)
        return
    if args.part == "store":
        records = store_part(args.bytes, args.small_blobs)
    else:
        records = spawn_pod(args.devices, args.layout, args.layers, args.rtt_ms, windows, args.timeout)
    merged = _merge(args.out, records)
    args.out.write_text(json.dumps(merged, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(merged))
    print(markdown(merged))


if __name__ == "__main__":
    main()
