"""Multi-host save/restore on this machine: 2 and 4 JAX processes (4 CPU devices each)
against the local S3 server. Save and restore seconds, bytes moved per process, plain vs
read-once restore, in one run.

    python -m benchmarks.bench_multihost [--scale 64]

Data parallel over processes: most leaves are replicated on every process (so replica-
parallel save and read-once restore matter). Writes benchmarks/results/multihost.json.
"""

from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path

from tests.multiprocess import run_processes

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--scale", type=int, default=64, help="first-dimension multiplier of the test tree (64 ≈ 76 MiB)"
    )
    args = parser.parse_args()
    from backends.launcher import start_s3

    rows = []
    with start_s3() as s3:
        so = s3.storage_options()
        for n in (2, 4):
            url = s3.url(f"mh/{uuid.uuid4().hex[:8]}")
            base = {"url": url, "storage_options": so, "mesh": [n, 4], "axes": ["data", "model"], "scale": args.scale}
            save = run_processes(n, {**base, "kind": "save"}, timeout=600)
            plain = run_processes(n, {**base, "kind": "restore"}, timeout=600)
            once = run_processes(n, {**base, "kind": "restore", "read_once": True}, timeout=600)
            for name, results in (("save", save), ("restore", plain), ("restore read_once", once)):
                if any(r is None for r in results):
                    raise SystemExit(f"{n} processes, {name}: a process failed")
                if name != "save" and any(r["mismatches"] for r in results):
                    raise SystemExit(f"{n} processes, {name}: restored data differs")
                key = "bytes_written" if name == "save" else "bytes_read"
                rows.append(
                    {
                        "processes": n,
                        "op": name,
                        "seconds": max(r["seconds"] for r in results),
                        "bytes_per_process": [r[key] for r in results],
                        "total_bytes": sum(r[key] for r in results),
                    }
                )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "multihost.json").write_text(json.dumps(rows, indent=2))
    print("| processes | operation | seconds | MiB per process | total MiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        per = ", ".join(f"{b / 2**20:.1f}" for b in r["bytes_per_process"])
        print(f"| {r['processes']} | {r['op']} | {r['seconds']:.2f} | {per} | {r['total_bytes'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
