"""A training loop that saves every step with a CheckpointManager until it is killed.

Run by tests/test_crash_safety.py: ``python tests/crash_child.py ROOT_URL START_STEP``
with storage options as JSON in OBJCKPT_TEST_STORAGE_OPTIONS. Prints "ready" once
saving starts and "committed N" after each step commits.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import objckpt  # noqa: E402


def state_for(step: int) -> dict:
    """The deterministic training state at ``step`` (the checker recomputes it)."""
    mesh = jax.make_mesh((2, 2), ("d", "m"))
    sharding = NamedSharding(mesh, P("d", "m"))
    base = jnp.arange(512 * 512, dtype=jnp.float32).reshape(512, 512)
    return {
        "params": {f"w{i}": jax.device_put(base * (i + 1) + step, sharding) for i in range(3)},
        "opt": {"mu": jax.device_put(jnp.full((256, 512), step, jnp.bfloat16), NamedSharding(mesh, P()))},
        "step": step,
        "iterator": {"position": step * 32},
    }


def main() -> None:
    root, start = sys.argv[1], int(sys.argv[2])
    storage_options = json.loads(os.environ.get("OBJCKPT_TEST_STORAGE_OPTIONS", "{}"))
    options = objckpt.Options(blob_size=1 << 20, request_timeout=30)
    mgr = objckpt.CheckpointManager(
        root, retention=objckpt.Retention(keep_last=2), storage_options=storage_options, options=options
    )
    print("ready", flush=True)
    step = start
    while True:
        mgr.save(step, state_for(step))
        mgr.wait()
        print(f"committed {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
