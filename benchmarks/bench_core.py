"""First benchmark: a 1 GiB sharded tree, save and restore against the local S3 server,
next to the raw ceiling (plain concurrent PUT/GET of the same bytes in objects of the same
size) measured in the same run.

    python -m benchmarks.bench_core [--gib 1.0] [--repeats 3]

Writes benchmarks/results/core.json and prints a table.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import objckpt  # noqa: E402
from objckpt.options import MiB  # noqa: E402
from objckpt.storage import from_url  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def make_tree(gib: float) -> dict:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    n_leaves = 16
    per_leaf = int(gib * (1 << 30)) // n_leaves // 4
    cols = 2048
    rows = per_leaf // cols // 8 * 8
    leaves = {}
    for i in range(n_leaves):
        x = jax.random.normal(jax.random.key(i), (rows, cols), jnp.float32)
        leaves[f"w{i:02d}"] = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    return {"params": leaves, "step": 1}


async def raw_ceiling(store, payload_sizes: list[int], concurrency: int) -> tuple[float, float]:
    """Seconds for plain concurrent PUTs then GETs of objects of the given sizes."""
    sem = asyncio.Semaphore(concurrency)
    data = np.random.default_rng(0).integers(0, 255, max(payload_sizes), dtype=np.uint8).tobytes()
    keys = [f"raw/{uuid.uuid4().hex}" for _ in payload_sizes]

    async def put(key, n):
        async with sem:
            await store.put(key, memoryview(data)[:n])

    async def get(key, n):
        async with sem:
            await store.get_range(key, start=0, end=n)

    t0 = time.perf_counter()
    await asyncio.gather(*(put(k, n) for k, n in zip(keys, payload_sizes)))
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    await asyncio.gather(*(get(k, n) for k, n in zip(keys, payload_sizes)))
    t_get = time.perf_counter() - t0
    await asyncio.gather(*(store.delete(k) for k in keys))
    return t_put, t_get


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from backends.launcher import start_s3
    from objckpt.transfer import runtime

    tree = make_tree(args.gib)
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))
    options = objckpt.Options()
    rows = []
    with start_s3() as s3:
        so = s3.storage_options()
        raw_store = from_url(s3.url("bench"), **so)
        sizes = [options.blob_size] * (total // options.blob_size) + (
            [total % options.blob_size] if total % options.blob_size else []
        )
        for rep in range(args.repeats):
            t_put, t_get = runtime.run_sync(raw_ceiling(raw_store, sizes, options.max_concurrency))
            url = s3.url(f"bench/ckpt-{uuid.uuid4().hex[:8]}")
            t0 = time.perf_counter()
            objckpt.save(url, tree, storage_options=so)
            t_save = time.perf_counter() - t0
            target = jax.tree_util.tree_map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
                ),
                tree,
            )
            t0 = time.perf_counter()
            objckpt.restore(url, target, storage_options=so)
            t_restore = time.perf_counter() - t0
            rows.append({"raw_put_s": t_put, "raw_get_s": t_get, "save_s": t_save, "restore_s": t_restore})
            print(
                f"rep {rep}: raw PUT {total / t_put / 2**30:.3f} GiB/s, raw GET {total / t_get / 2**30:.3f} GiB/s, "
                f"objckpt save {total / t_save / 2**30:.3f} GiB/s, restore {total / t_restore / 2**30:.3f} GiB/s",
                flush=True,
            )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    gibs = {k.replace("_s", "_gib_s"): total / v / 2**30 for k, v in med.items()}
    result = {
        "bytes": total,
        "blob_size_mib": options.blob_size // MiB,
        "concurrency": options.max_concurrency,
        "repeats": rows,
        "median_gib_s": gibs,
        "save_vs_raw_put": med["raw_put_s"] / med["save_s"],
        "restore_vs_raw_get": med["raw_get_s"] / med["restore_s"],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "core.json").write_text(json.dumps(result, indent=2))
    print(f"\n| {total / 2**30:.2f} GiB, medians of {args.repeats} | GiB/s | vs raw |")
    print("|---|---|---|")
    print(f"| raw PUT | {gibs['raw_put_gib_s']:.3f} | 1.00 |")
    print(f"| objckpt save | {gibs['save_gib_s']:.3f} | {result['save_vs_raw_put']:.2f} |")
    print(f"| raw GET | {gibs['raw_get_gib_s']:.3f} | 1.00 |")
    print(f"| objckpt restore | {gibs['restore_gib_s']:.3f} | {result['restore_vs_raw_get']:.2f} |")


if __name__ == "__main__":
    main()
