"""Streamed S3 restores: URLs presigned by obstore (this tree) against another checkout's reader.

Issue 41 replaced the hand-written SigV4 signer of the streamed S3 reader with
URLs presigned by ``obstore.sign``. This measures what that costs: one
checkpoint is saved on the local S3 server (through the latency proxy when
``--rtt-ms`` is given), then each tree restores it onto another mesh (the
streamed path) in a fresh process, alternating, ``--repeats`` times; wall
time and the process's CPU time of the restore are reported per tree.

    python -m benchmarks.bench_signing --old /tmp/objckpt-975b79b [--size-mib 256] [--rtt-ms 0]

``--old`` is a checkout of the earlier commit (``git worktree add /tmp/objckpt-975b79b 975b79b``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, sys, time
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import objckpt
url, options, shape = sys.argv[1], json.loads(sys.argv[2]), tuple(json.loads(sys.argv[3]))
other = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))
target = {"w": jax.ShapeDtypeStruct(shape, np.float32, sharding=other)}
warm = {"w": jax.ShapeDtypeStruct((64, 64), np.float32, sharding=other)}
objckpt.restore(url + "-warm", warm, storage_options=options)  # imports, first connections
wall, cpu = time.perf_counter(), time.process_time()
out = objckpt.restore(url, target, storage_options=options)
jax.block_until_ready(out)
print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, type=Path, help="a checkout of the commit to compare with")
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, str(ROOT))
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import objckpt
    from backends import start_s3
    from backends.proxy import FaultProxy

    with start_s3() as s3:
        host, port = s3.endpoint_url.rsplit("/", 1)[1].rsplit(":", 1)
        with FaultProxy(host, int(port), latency_ms=args.rtt_ms) as proxy:
            options = s3.storage_options()
            options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
            side = int((args.size_mib * (1 << 20) / 4) ** 0.5) // 8 * 8
            values = np.random.default_rng(0).standard_normal((side, side), dtype=np.float32)
            mesh = jax.make_mesh((4, 2), ("x", "y"))
            url = s3.url(f"signing-{uuid.uuid4().hex[:8]}")
            for name in (url, url + "-warm"):
                tree = {
                    "w": jax.device_put(values if name == url else values[:64, :64], NamedSharding(mesh, P("x", "y")))
                }
                objckpt.save(name, tree, storage_options=options)
            results: dict[str, list[dict[str, float]]] = {"new": [], "old": []}
            for repeat in range(args.repeats):
                for tree in ("new", "old") if repeat % 2 == 0 else ("old", "new"):
                    src = ROOT if tree == "new" else args.old.resolve()
                    env = {**os.environ, "PYTHONPATH": str(src), "XLA_FLAGS": os.environ["XLA_FLAGS"]}
                    done = subprocess.run(
                        [sys.executable, "-c", _CHILD, url, json.dumps(options), json.dumps([side, side])],
                        env=env, cwd=src, capture_output=True, text=True, timeout=600, check=False,
                    )  # fmt: skip
                    if done.returncode != 0:
                        raise SystemExit(f"the {tree} tree's restore failed:\n{done.stderr[-3000:]}")
                    results[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
    gib = side * side * 4 / (1 << 30)
    print(f"streamed resharded restore of {gib * 1024:.0f} MiB from S3 at {args.rtt_ms:g} ms, {args.repeats} repeats")
    for tree, runs in results.items():
        wall = statistics.median(r["wall"] for r in runs)
        cpu = statistics.median(r["cpu"] for r in runs)
        print(f"  {tree}: {gib / wall:.2f} GiB/s (median {wall:.3f} s), client CPU {cpu / gib:.2f} CPU-s/GiB")


if __name__ == "__main__":
    main()
