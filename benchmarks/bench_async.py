"""Async save and memory: seconds blocked vs a plain numpy copy, and peak RSS with a
model 4x larger than the memory budget, against the local S3 server.

    python -m benchmarks.bench_async [--gib 1.0] [--repeats 3]

Writes benchmarks/results/async.json and prints a table.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import objckpt  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MiB = 1 << 20


def make_tree(gib: float) -> dict:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    n = 16
    rows = int(gib * (1 << 30)) // n // 4 // 2048 // 8 * 8
    return jax.block_until_ready(
        {
            f"w{i:02d}": jax.device_put(jnp.full((rows, 2048), i, jnp.float32), NamedSharding(mesh, P("data", "model")))
            for i in range(n)
        }
    )


def numpy_copy_seconds(tree: dict) -> float:
    t0 = time.perf_counter()
    copies = [np.array(s.data, copy=True) for x in tree.values() for s in x.addressable_shards]
    seconds = time.perf_counter() - t0
    del copies
    return seconds


def rss_mib() -> tuple[float, float]:
    """(current, peak since the last reset) resident set size in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def memory_child(url: str, storage_options: dict, gib: float, budget_mib: int) -> dict:
    """Run in a fresh process: peak RSS above baseline during save and restore."""
    options = objckpt.Options(memory_budget=budget_mib * MiB)
    tree = make_tree(gib)
    model_mib = sum(x.nbytes for x in tree.values()) / MiB
    gc.collect()
    base, _ = rss_mib()
    reset_peak()
    objckpt.save(url, tree, storage_options=storage_options, options=options)
    _, peak_save = rss_mib()
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()}
    del tree
    gc.collect()
    base_restore, _ = rss_mib()
    reset_peak()
    restored = objckpt.restore(url, target, storage_options=storage_options, options=options)
    _, peak_restore = rss_mib()
    assert all(
        float(np.asarray(restored[k].addressable_shards[0].data)[0, 0]) == i for i, k in enumerate(sorted(restored))
    )
    return {
        "model_mib": model_mib,
        "budget_mib": budget_mib,
        "save_peak_extra_mib": peak_save - base,
        "restore_peak_above_before_mib": peak_restore - base_restore,
        "restore_extra_over_restored_mib": peak_restore - base_restore - model_mib,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--budget-mib", type=int, default=0)
    args = parser.parse_args()
    if args.child:
        options = json.loads(os.environ["OBJCKPT_BENCH_STORAGE_OPTIONS"])  # not argv: it holds credentials
        print(json.dumps(memory_child(args.child, options, args.gib, args.budget_mib)))
        return

    from backends.launcher import start_s3

    with start_s3() as s3:
        so = s3.storage_options()
        tree = make_tree(args.gib)
        total = sum(x.nbytes for x in tree.values())
        blocked, copies = [], []
        for _ in range(args.repeats):
            copies.append(numpy_copy_seconds(tree))
            handle = objckpt.save_async(s3.url(f"async/{uuid.uuid4().hex[:8]}"), tree, storage_options=so)
            blocked.append(handle.seconds_blocked)
            handle.result()
        del tree
        budget = max(64, int(args.gib * 1024 / 4))
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.bench_async",
                "--gib",
                str(args.gib),
                "--budget-mib",
                str(budget),
                "--child",
                s3.url(f"mem/{uuid.uuid4().hex[:8]}"),
            ],
            capture_output=True,
            text=True,
            env=dict(os.environ, OBJCKPT_BENCH_STORAGE_OPTIONS=json.dumps(so)),
        )
        if out.returncode != 0:
            raise SystemExit(f"memory measurement failed:\n{out.stderr[-3000:]}")
        memory = json.loads(out.stdout.strip().splitlines()[-1])
    result = {
        "bytes": total,
        "numpy_copy_s": statistics.median(copies),
        "seconds_blocked": statistics.median(blocked),
        "blocked_vs_numpy_copy": statistics.median(blocked) / statistics.median(copies),
        "runs": {"numpy_copy_s": copies, "seconds_blocked": blocked},
        "memory": memory,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "async.json").write_text(json.dumps(result, indent=2))
    print(f"| {total / 2**30:.2f} GiB over 8 devices | median of {args.repeats} |")
    print("|---|---|")
    print(f"| plain numpy copy of the shards | {result['numpy_copy_s']:.3f} s |")
    print(
        f"| save_async seconds blocked | {result['seconds_blocked']:.3f} s ({result['blocked_vs_numpy_copy']:.2f}x) |"
    )
    print(
        f"| save, budget {memory['budget_mib']} MiB, model {memory['model_mib']:.0f} MiB: peak extra RSS | {memory['save_peak_extra_mib']:.0f} MiB |"
    )
    print(f"| restore: peak RSS above restored bytes | {memory['restore_extra_over_restored_mib']:.0f} MiB |")


if __name__ == "__main__":
    main()
