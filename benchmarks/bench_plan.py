"""Planner and manifest at pod scale, with no data: a 405B-parameter model with Adam state
(~2.4 TB) saved by 1,024 hosts. Measures manifest size, encode and strict-parse time, and
one host's restore planning time on one core.

    python -m benchmarks.bench_plan [--boxes 128]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from objckpt.core.format import BlobEntry, LeafEntry, Manifest, Piece, parse_manifest
from objckpt.core.plan import blob_key, pieces_needed, plan_reads

RESULTS = Path(__file__).parent / "results"


def synth_manifest(boxes_per_leaf: int, hosts: int = 1024) -> Manifest:
    """126 layers x 7 matrices (+ embeddings), params + 2 Adam moments, fp32 moments / bf16 params."""
    d, ff, vocab, layers = 16384, 53248, 128256, 126
    shapes = [(vocab, d)] + [
        s for _ in range(layers) for s in ((d, d), (d, 1024), (d, 1024), (d, d), (d, ff), (d, ff), (ff, d))
    ]
    leaves, blobs = [], {}
    grid = int(math.isqrt(boxes_per_leaf))
    blob_size, fill, blob_seq = 32 << 20, 0, 0
    key = blob_key("s" * 32, 0, 0)
    for kind, itemsize in (("params", 2), ("mu", 4), ("nu", 4)):
        for li, shape in enumerate(shapes):
            rows, cols = shape
            pieces = []
            for i in range(grid):
                for j in range(boxes_per_leaf // grid):
                    r0, r1 = rows * i // grid, rows * (i + 1) // grid
                    c0, c1 = cols * j // (boxes_per_leaf // grid), cols * (j + 1) // (boxes_per_leaf // grid)
                    length = (r1 - r0) * (c1 - c0) * itemsize
                    if fill + length > blob_size and fill:
                        blobs[key] = fill
                        blob_seq += 1
                        key, fill = blob_key("s" * 32, blob_seq % hosts, blob_seq), 0
                    pieces.append(Piece((r0, c0), (r1, c1), key, fill, length, 123456789))
                    fill += length
            dtype = "bfloat16" if itemsize == 2 else "float32"
            leaves.append(LeafEntry(f"['{kind}'][{li}]", "array", dtype, shape, tuple(pieces)))
    blobs[key] = fill
    tree = {"t": "list", "c": [{"t": "leaf", "i": i} for i in range(len(leaves))]}
    return Manifest(
        "s" * 32, "2026-01-01T00:00:00Z", tree, tuple(leaves), tuple(BlobEntry(k, s) for k, s in blobs.items()), hosts
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--boxes", type=int, default=64, help="pieces per leaf (a square grid)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    manifest = synth_manifest(args.boxes)
    t_build = time.perf_counter() - t0
    n_pieces = sum(len(leaf.pieces) for leaf in manifest.leaves)
    t0 = time.perf_counter()
    data = manifest.to_json()
    t_encode = time.perf_counter() - t0
    t0 = time.perf_counter()
    parsed = parse_manifest(data, size_limit=1 << 30)
    t_parse = time.perf_counter() - t0
    # One host of 1,024 needs 1/1,024 of every leaf (a row band): plan its reads.
    t0 = time.perf_counter()
    wanted = []
    for i, leaf in enumerate(parsed.leaves):
        rows, cols = leaf.shape or (0, 0)
        box = ((rows * 5 // 1024, 0), (rows * 6 // 1024, cols))
        wanted.extend((i, p) for p in pieces_needed(leaf.pieces, [box]))
    requests = plan_reads(wanted, coalesce_gap=0, max_read_size=64 << 20)
    t_plan = time.perf_counter() - t0
    result = {
        "total_tb": manifest.total_bytes / 1e12,
        "leaves": len(manifest.leaves),
        "pieces": n_pieces,
        "blobs": len(manifest.blobs),
        "manifest_mib": len(data) / 2**20,
        "build_s": t_build,
        "encode_s": t_encode,
        "parse_and_validate_s": t_parse,
        "one_host_restore_plan_s": t_plan,
        "one_host_requests": len(requests),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan.json").write_text(json.dumps(result, indent=2))
    for k, v in result.items():
        print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")


if __name__ == "__main__":
    main()
