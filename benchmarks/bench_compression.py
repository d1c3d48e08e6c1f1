"""``Options(compression="zstd")``: stored size, codec speed per core, and S3 save/restore at 10 ms RTT.

1. The codec on one thread (:mod:`objckpt.core.codecs`, 1 MiB pieces): bf16 weights drawn as
   trained ones (normal, σ = 0.02), f32 Adam first moments (normal, σ = 1e-4) and second
   moments (squared gradient noise with per-row scales); the ratio, and GB per CPU-second
   (``time.thread_time``: what one core does, whatever else shares the machine) of encoding
   and decoding; next to zstd level 3 over the bytes as they lie (Orbax's zarr3 chain has no
   shuffle).
2. A 1 GiB bf16 state (16 leaves of 64 MiB on a (4, 2) mesh of CPU devices, the weights of
   step 1) saved to the local S3 server (SeaweedFS), plain and compressed, then restored onto
   the saved sharding in fresh processes (as a restarted job does) at each RTT of ``--rtts``
   (0 ms: straight to the server; else through ``backends.proxy.FaultProxy``), plain and
   compressed interleaved, each restore checked bit-exact against crc32s of the saved leaves:
   wall and CPU seconds, and the bytes the transfer engine moved. A fresh server each round.

    python -m benchmarks.bench_compression [--repeats 3] [--mib 1024] [--rtts 0,10]

Writes ``benchmarks/results/compression.json`` and ``compression.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import zstandard  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import objckpt  # noqa: E402
from backends import start_s3  # noqa: E402
from backends.proxy import FaultProxy  # noqa: E402
from benchmarks.workers import run_workers  # noqa: E402
from objckpt.core import codecs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODES = {"plain": None, "zstd": "zstd"}


def weights(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """bf16 weights as training leaves them: normal, σ = 0.02."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)


def first_moments(shape: tuple[int, ...], seed: int = 2) -> np.ndarray:
    """f32 Adam first moments: normal, σ = 1e-4."""
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(1e-4)


def second_moments(shape: tuple[int, ...], seed: int = 1) -> np.ndarray:
    """f32 Adam second moments: squared gradient noise with log-normal per-row scales (as
    tests/test_compression.py draws them)."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(-9.0, 1.5, size=(shape[0], 1))).astype(np.float32)
    g = rng.standard_normal(shape, dtype=np.float32) * scale
    return (0.001 * g * g + 0.999 * (g * g) * rng.uniform(0.5, 1.5, size=shape).astype(np.float32)).astype(np.float32)


def codec(mib: int = 64, repeats: int = 3) -> dict[str, Any]:
    """Ratio and GB per CPU-second of encoding and decoding, one thread, 1 MiB pieces."""
    rows = (mib << 20) // 4096
    out = {}
    for name, value in (
        ("bf16 weights (σ 0.02)", weights((rows * 2, 1024))),
        ("f32 Adam first moments", first_moments((rows, 1024))),
        ("f32 Adam second moments", second_moments((rows, 1024))),
    ):
        raw = value.view(np.uint8).reshape(-1)
        z = value.dtype.itemsize
        chunks = [raw[i : i + codecs.CHUNK_BYTES] for i in range(0, len(raw), codecs.CHUNK_BYTES)]
        enc_s = dec_s = float("inf")
        for _ in range(repeats):
            started = time.thread_time()
            encoded = [codecs.encode(c, z) for c in chunks]
            enc_s = min(enc_s, time.thread_time() - started)
            started = time.thread_time()
            decoded = [codecs.decode(e, z, len(c), "bench") for e, c in zip(encoded, chunks)]
            dec_s = min(dec_s, time.thread_time() - started)
        assert all(d.tobytes() == c.tobytes() for d, c in zip(decoded, chunks))
        level3 = zstandard.ZstdCompressor(level=3)
        unshuffled = sum(len(level3.compress(c)) for c in chunks)
        out[name] = {
            "bytes": len(raw),
            "ratio": len(raw) / sum(map(len, encoded)),
            "encode_gb_per_cpu_s": len(raw) / enc_s / 1e9,
            "decode_gb_per_cpu_s": len(raw) / dec_s / 1e9,
            "zstd3_unshuffled_ratio": len(raw) / unshuffled,
        }
        print(name, out[name], flush=True)
    return out


def state(mib: int) -> dict[str, jax.Array]:
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    rows = (mib << 20) // 16 // 2 // 8192  # 16 leaves of (rows, 8192) bf16
    sharding = NamedSharding(mesh, P("x", "y"))
    return {f"w{i:02d}": jax.device_put(jnp.asarray(weights((rows, 8192), seed=i)), sharding) for i in range(16)}


def save_run(url: str, storage_options: dict[str, Any], tree: dict[str, jax.Array], mode: str | None) -> dict[str, Any]:
    """Save: wall and CPU seconds, bytes written (each PUT given 10 minutes: a fresh SeaweedFS on a
    busy VM can take a minute to grow its volumes on the first burst of writes)."""
    options = objckpt.Options(compression=mode, retry=objckpt.RetryConfig(deadline=600.0))
    wall, cpu = time.perf_counter(), time.process_time()
    saved = objckpt.save(url, tree, storage_options=storage_options, options=options)
    return {
        "save_s": time.perf_counter() - wall,
        "save_cpu_s": time.process_time() - cpu,
        "bytes_written": saved.bytes_written,
    }


def _restore_worker() -> None:
    """A fresh process's restore onto the saved sharding (the job in ``COMPRESSION_JOB``): prints RESULT."""
    job = json.loads(os.environ["COMPRESSION_JOB"])
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    target = {
        k: jax.ShapeDtypeStruct(tuple(shape), ml_dtypes.bfloat16, sharding=NamedSharding(mesh, P("x", "y")))
        for k, shape in job["shapes"].items()
    }
    restore, stats = objckpt.restore, objckpt.TransferStats()
    wall, cpu = time.perf_counter(), time.process_time()
    restored = restore(job["url"], target, storage_options=job["storage_options"], stats=stats)
    jax.block_until_ready(restored)
    out = {"restore_s": time.perf_counter() - wall, "restore_cpu_s": time.process_time() - cpu}
    out["bytes_read"] = stats.bytes_read
    out["bit_exact"] = {k: zlib.crc32(np.asarray(v).tobytes()) for k, v in restored.items()} == job["crc32"]
    print("RESULT " + json.dumps(out), flush=True)


def restore_run(
    url: str, storage_options: dict[str, Any], tree: dict[str, jax.Array], crcs: dict[str, int]
) -> dict[str, Any]:
    job = {
        "url": url,
        "storage_options": storage_options,
        "crc32": crcs,
        "shapes": {k: v.shape for k, v in tree.items()},
    }
    (out,) = run_workers(
        "benchmarks.bench_compression", job, processes=1, devices=8, env_prefix="COMPRESSION", timeout=600
    )
    return out


def _load(results: dict[str, Any]) -> str:
    runs = [r for by_mode in results["restores"].values() for rs in by_mode.values() for r in rs]
    loads = [r["load_avg"][0] for r in runs if (r.get("load_avg") or [None])[0]]
    return f"{min(loads):.1f}–{max(loads):.1f}" if loads else "unknown"


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "Codec on one thread, 1 MiB pieces (GB of logical bytes per CPU-second, `time.thread_time`):",
        "",
        "| data | ratio | encode GB/CPU-s | decode GB/CPU-s | zstd -3 without shuffle |",
        "|---|---|---|---|---|",
    ]
    for name, r in results["codec"].items():
        lines.append(
            f"| {name} | {r['ratio']:.3f}× | {r['encode_gb_per_cpu_s']:.2f} | {r['decode_gb_per_cpu_s']:.2f}"
            f" | {r['zstd3_unshuffled_ratio']:.3f}× |"
        )
    saves = results["saves"]
    lines += [
        "",
        f"{results['mib']} MiB bf16 state (16 leaves, (4, 2) CPU mesh) on S3 (SeaweedFS): saved at 0 ms from the"
        f" driver, restored onto the saved sharding in fresh processes; {results['repeats']} rounds (a fresh server"
        " each), plain and compressed interleaved; medians (min–max); CPU = the process's CPU seconds;"
        f" 1-minute load average after each restore {_load(results)} on {results['cpus']} CPUs (shared: the"
        " server runs on the same cores).",
        "",
        "| mode | save s | save CPU-s | MiB written |",
        "|---|---|---|---|",
    ]
    for mode, runs in saves.items():
        cells = [_cell([r[k] for r in runs]) for k in ("save_s", "save_cpu_s")]
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {_median(runs, 'bytes_written') / 2**20:.0f} |")
    lines += [
        "",
        "| RTT | mode | restore s | restore CPU-s | MiB read | bit-exact | plain ÷ zstd restore time |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = []
    for rtt, by_mode in results["restores"].items():
        speed = _median(by_mode["plain"], "restore_s") / _median(by_mode["zstd"], "restore_s")
        summary.append(f"{speed:.2f}× at {rtt} ms")
        for mode, runs in by_mode.items():
            cells = [_cell([r[k] for r in runs]) for k in ("restore_s", "restore_cpu_s")]
            cells += [f"{_median(runs, 'bytes_read') / 2**20:.0f}", str(all(r["bit_exact"] for r in runs))]
            cells.append(f"{speed:.2f}×" if mode == "zstd" else "")
            lines.append(f"| {rtt} ms | {mode} | " + " | ".join(cells) + " |")
    ratio = _median(saves["plain"], "bytes_written") / _median(saves["zstd"], "bytes_written")
    save_speed = _median(saves["plain"], "save_s") / _median(saves["zstd"], "save_s")
    if results.get("note"):
        lines += ["", results["note"]]
    lines += [
        "",
        f"Stored {ratio:.2f}× smaller; compressed save {save_speed:.2f}× the speed of a plain one; compressed"
        f" restore {', '.join(summary)} (above 1: faster).",
    ]
    return "\n".join(lines) + "\n"


def _storage_options(s3: Any, rtt_ms: int) -> tuple[dict[str, Any], Any]:
    """The server's storage options, through a latency proxy when ``rtt_ms`` (the proxy, to stop)."""
    so = s3.storage_options()
    if not rtt_ms:
        return so, None
    proxy = FaultProxy("127.0.0.1", int(s3.endpoint_url.rsplit(":", 1)[1]), latency_ms=rtt_ms).start()
    return {**so, "client_kwargs": {**so["client_kwargs"], "endpoint_url": proxy.endpoint_url}}, proxy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rtts", default="0,10", help="comma list of RTTs in ms for the restores")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "compression"))
    parser.add_argument("--report", help="write the tables of a finished (or cut-short) run's JSON again")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _restore_worker()
        return 0
    if args.report:
        table = markdown(json.loads(Path(args.report).read_text()))
        Path(args.report).with_suffix(".md").write_text(table)
        print(table)
        return 0
    rtts = [int(x) for x in args.rtts.split(",")]
    results: dict[str, Any] = {"repeats": args.repeats, "mib": args.mib, "codec": codec(), "cpus": os.cpu_count()}
    tree = state(args.mib)
    crcs = {k: zlib.crc32(np.asarray(v).tobytes()) for k, v in tree.items()}
    results["saves"] = saves = {m: [] for m in MODES}
    results["restores"] = restores = {str(rtt): {m: [] for m in MODES} for rtt in rtts}
    out_path = Path(args.out)
    for i in range(args.repeats):
        order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
        # A fresh server per round: SeaweedFS holds what it stores in memory, and this VM's is shared.
        with start_s3() as s3:
            urls = {m: s3.url(f"bench-compression/{m}-{uuid.uuid4().hex[:8]}") for m in MODES}
            for mode in order:
                saves[mode].append(save_run(urls[mode], s3.storage_options(), tree, MODES[mode]))
                print(f"save {mode}: {saves[mode][-1]}", flush=True)
            for rtt in rtts:
                so, proxy = _storage_options(s3, rtt)
                try:
                    for mode in order:
                        out = restore_run(urls[mode], so, tree, crcs)
                        out["load_avg"] = os.getloadavg()
                        restores[str(rtt)][mode].append(out)
                        print(f"restore {mode} at {rtt} ms: {out}", flush=True)
                finally:
                    if proxy is not None:
                        proxy.stop()
        out_path.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results)
    out_path.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
