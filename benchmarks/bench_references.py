"""Deleters on a long incremental chain (issue 77 item 12): ``gc`` and ``delete`` at 1,000 steps.

Builds (once, or reuses with ``--root``) a ``CheckpointManager(incremental=True)`` root on
``file://`` of ``--steps`` steps, each ``--leaves`` frozen float32 leaves plus one changed leaf,
so every step names step 1 as its base. Then, on a fresh copy each repeat: ``gc`` (nothing to
collect: every object is referenced), ``delete`` of a step in the middle (no step names it),
``delete`` of step 1 (every step names it: its blobs stay), and ``gc`` again. Targets: ``gc`` ≤ 10 s,
a ``delete`` ≤ 2 s at 1,000 steps. Times are medians of ``--repeats`` (the 2 cores are shared).

    python -m benchmarks.bench_references [--steps 1000] [--leaves 128] [--root DIR] [--repeats 3]

Writes ``benchmarks/results/references.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import objckpt

REPO = Path(__file__).resolve().parent.parent


def build(root: str, steps: int, leaves: int) -> None:
    state = {f"l{i:03d}": np.full((64, 16), i, np.float32) for i in range(leaves)}
    state["adapter"] = np.zeros((64, 16), np.float32)
    with objckpt.CheckpointManager(root, incremental=True) as mgr:
        for step in range(1, steps + 1):
            state["adapter"] = state["adapter"] + 1
            mgr.save(step, state, force=True, wait=True)


def one_repeat(src: str, steps: int) -> dict[str, float]:
    work = tempfile.mkdtemp(prefix="objckpt-refs-")
    shutil.rmtree(work)
    shutil.copytree(src, work)
    out: dict[str, float] = {}
    with objckpt.CheckpointManager(work) as mgr:
        for name, act in (
            ("gc", lambda: mgr.gc(grace_seconds=0)),
            ("delete_unnamed", lambda: mgr.delete(steps // 2)),
            ("delete_base", lambda: mgr.delete(1)),
            ("gc_after", lambda: mgr.gc(grace_seconds=0)),
        ):
            started = time.perf_counter()
            act()
            out[name] = time.perf_counter() - started
        restored = mgr.restore(steps)
        assert float(restored["adapter"][0, 0]) == steps
    shutil.rmtree(work)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--leaves", type=int, default=128)
    parser.add_argument("--root", help="a chain built before (built here when absent)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="objckpt-chain-")
    if not Path(root, f"step_{args.steps:010d}", "manifest.json").exists():
        started = time.perf_counter()
        build(root, args.steps, args.leaves)
        print(f"built {args.steps} steps under {root} in {time.perf_counter() - started:.0f} s", flush=True)
    runs = [one_repeat(root, args.steps) for _ in range(args.repeats)]
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    for k, v in medians.items():
        print(f"{k:16s} {v:7.2f} s  ({', '.join(f'{r[k]:.2f}' for r in runs)})")
    result = {"steps": args.steps, "leaves": args.leaves + 1, "runs": runs, "median_s": medians}
    (REPO / "benchmarks" / "results" / "references.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
