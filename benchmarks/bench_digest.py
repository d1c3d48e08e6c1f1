"""The cost of ``Options(digest="sha256")``: save and restore with and without per-piece SHA-256.

256 MiB in 8 float32 leaves of 32 MiB on a (4, 2) mesh of CPU devices, saved to and restored
from ``file://`` and the local S3 server (SeaweedFS), digest off and on interleaved. Restores
go onto the saved sharding (whole pieces, adopted where they land aligned) and onto another
one (every piece copied; streamed on S3). Reported per cell: medians (min–max) of wall
seconds and of this process's CPU seconds (every thread), and the raw hashing speed of
crc32c and SHA-256 on this CPU.

    python -m benchmarks.bench_digest [--repeats 3] [--mib 256]

Writes ``benchmarks/results/digest.json`` and ``digest.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import backends  # noqa: E402
import objckpt  # noqa: E402
from objckpt.core.checksum import crc32c, sha256_hex  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODES = {"crc32c": None, "sha256": "sha256"}


def _tree(mib: int) -> dict[str, jax.Array]:
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    rows = mib * (1 << 20) // 8 // 4 // 1024  # 8 leaves of (rows, 1024) float32
    rng = np.random.default_rng(0)
    return {
        f"l{i}": jax.device_put(
            jnp.asarray(rng.standard_normal((rows, 1024), dtype=np.float32)), NamedSharding(mesh, P("x", "y"))
        )
        for i in range(8)
    }


def _other(tree: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P("y", "x"))) for k, v in tree.items()
    }


def _timed(fn: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def one_run(
    url: str, storage_options: dict[str, Any], tree: dict[str, jax.Array], digest: str | None
) -> dict[str, Any]:
    """Save, restore onto the same sharding, restore onto another; wall and CPU seconds of each."""
    options = objckpt.Options(digest=digest)
    out: dict[str, Any] = {}
    _, out["save_s"], out["save_cpu"] = _timed(
        lambda: objckpt.save(url, tree, storage_options=storage_options, options=options)
    )
    same, out["restore_s"], out["restore_cpu"] = _timed(
        lambda: objckpt.restore(url, tree, storage_options=storage_options, options=options)
    )
    other, out["reshard_s"], out["reshard_cpu"] = _timed(
        lambda: objckpt.restore(url, _other(tree), storage_options=storage_options, options=options)
    )
    for restored in (same, other):
        if not all(np.array_equal(np.asarray(restored[k]), np.asarray(v)) for k, v in tree.items()):
            out["error"] = "restored bytes differ"
    return out


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def markdown(results: dict[str, Any], mib: int) -> str:
    speed = results["hash_gib_s"]
    lines = [
        f"{mib} MiB in 8 leaves on a (4, 2) CPU mesh; medians (min–max) of {results['repeats']} runs, interleaved;"
        f" CPU = this process's CPU seconds. Hashing on this CPU: crc32c {speed['crc32c']:.1f},"
        f" SHA-256 {speed['sha256']:.2f} GiB per CPU-second.",
        "",
        "| store | digest | save s | save CPU-s | restore s | restore CPU-s | reshard restore s | reshard CPU-s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for store, modes in results["stores"].items():
        for mode, runs in modes.items():
            cells = [_cell([r[k] for r in runs]) for k in ("save_s", "save_cpu", "restore_s", "restore_cpu")]
            cells += [_cell([r[k] for r in runs]) for k in ("reshard_s", "reshard_cpu")]
            lines.append(f"| {store} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _hash_speed(mib: int) -> dict[str, float]:
    """GiB hashed per CPU second (one thread; wall time depends on what else the cores run)."""
    data = np.random.default_rng(1).integers(0, 255, mib << 20, dtype=np.uint8)
    out = {}
    for name, fn in (("crc32c", crc32c), ("sha256", sha256_hex)):
        fn(data[: 1 << 20])
        started = time.process_time()
        fn(data)
        out[name] = mib / 1024 / (time.process_time() - started)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "digest"))
    args = parser.parse_args(argv)
    tree = _tree(args.mib)
    results: dict[str, Any] = {"repeats": args.repeats, "hash_gib_s": _hash_speed(args.mib), "stores": {}}
    service = backends.start_s3()
    local = Path(tempfile.mkdtemp(prefix="bench-digest-"))
    try:
        places = {
            "file://": (lambda: f"file://{local / uuid.uuid4().hex[:8]}", {}),
            "S3 (SeaweedFS)": (lambda: service.url(f"bench-digest/{uuid.uuid4().hex[:8]}"), service.storage_options()),
        }
        for store, (make_url, storage_options) in places.items():
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for i in range(args.repeats):
                for mode in list(MODES) if i % 2 == 0 else list(reversed(MODES)):
                    out = one_run(make_url(), storage_options, tree, MODES[mode])
                    runs[mode].append(out)
                    print(f"{store} {mode}: {out}", flush=True)
            results["stores"][store] = runs
    finally:
        service.stop()
        shutil.rmtree(local, ignore_errors=True)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results, args.mib)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
