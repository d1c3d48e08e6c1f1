"""A training loop whose CheckpointManager keeps replicas; killed mid-replication by the test.

Run by tests/test_regions.py: ``python tests/replica_child.py ROOT_URL FIRST LAST`` with the
root's storage options as JSON in OBJCKPT_TEST_STORAGE_OPTIONS and the replicas as JSON
``[[url, storage_options], ...]`` in OBJCKPT_TEST_REPLICAS. Saves steps FIRST..LAST, then
prints "replicating N" once a replica is copying step N and waits to be killed.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np  # noqa: E402

import objckpt  # noqa: E402


def state_for(step: int) -> dict:
    """The deterministic state at ``step`` (the test recomputes it)."""
    return {"w": np.arange(1 << 20, dtype=np.float32) + step, "step": step}


def main() -> None:
    root, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    options = json.loads(os.environ["OBJCKPT_TEST_STORAGE_OPTIONS"])
    replicas = [objckpt.Location(url, opts) for url, opts in json.loads(os.environ["OBJCKPT_TEST_REPLICAS"])]
    mgr = objckpt.CheckpointManager(
        root, storage_options=options, replicas=replicas, options=objckpt.Options(blob_size=256 * 1024)
    )
    for step in range(first, last + 1):
        mgr.save(step, state_for(step), wait=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        busy = [s.replicating for s in mgr.replica_status() if s.replicating is not None]
        if busy:
            print(f"replicating {busy[0]}", flush=True)
            time.sleep(600)
        time.sleep(0.01)
    print("never caught replicating", flush=True)


if __name__ == "__main__":
    main()
