"""A training loop under CheckpointManager's save policies, as one process of a job.

Run by ``tests/mp_worker.py`` (job kind ``training_loop``, any number of processes) and,
as a script, by tests/test_manager_policies.py (one process, ``catch_sigterm=True``).
The loop is the one the manager's docstring and docs/MIGRATION.md show: ``save`` every
step (the manager decides), stop after the preemption sync point's save.

The state is one array sharded over every device of the job plus the step; after
step ``s`` every element is ``s + 1``, so a restart can check it resumed the saved step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import objckpt


def _state(mesh: jax.sharding.Mesh, value: float) -> jax.Array:
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    shape = (8 * jax.device_count(), 16)
    return jax.make_array_from_callback(shape, sharding, lambda index: np.full((8, 16), value, np.float32))


def training_loop(job: dict[str, Any], process: int) -> dict[str, Any]:
    """Run ``job["steps"]`` steps (resuming from the latest committed one) and report what it saved.

    ``job`` keys: ``url``, ``storage_options``, ``steps``, the manager's save rules
    (``save_interval_steps``, ``continuous``, ``catch_sigterm``), ``sigterm_at`` and
    ``victim`` (the process that sends itself SIGTERM after that step's update),
    ``step_seconds`` (a pause per step, so the notice arrives while the loop runs),
    ``print_steps`` (print ``STEP n`` per step, for a parent that signals from outside).
    """
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    steps = int(job["steps"])
    mgr = objckpt.CheckpointManager(
        job["url"],
        storage_options=job.get("storage_options") or {},
        save_rules=objckpt.SavePolicy(
            save_interval_steps=job.get("save_interval_steps"),
            final_step=steps - 1,
            continuous=bool(job.get("continuous", False)),
        ),
        catch_sigterm=bool(job.get("catch_sigterm", False)),
    )
    start = mgr.latest_step()
    w = _state(mesh, 0.0)
    restored_ok = None
    if start is not None:
        w = mgr.restore(start, {"w": w, "step": 0})["w"]
        restored_ok = all(bool((np.asarray(s.data) == start + 1).all()) for s in w.addressable_shards)
    update = jax.jit(lambda x: x + 1)
    saved: list[int] = []
    preempted = None
    step = -1
    for step in range(0 if start is None else start + 1, steps):
        w = update(w)
        if step == job.get("sigterm_at") and process == job.get("victim", 0):
            os.kill(os.getpid(), signal.SIGTERM)
        if mgr.save(step, {"w": w, "step": step}):
            saved.append(step)
        if mgr.reached_preemption(step):
            preempted = step
            break
        if job.get("print_steps"):
            print(f"STEP {step}", flush=True)
        time.sleep(float(job.get("step_seconds", 0.0)))
    catching = mgr._preemption.catching_sigterm
    mgr.close()
    return {
        "start": start,
        "restored_ok": restored_ok,
        "saved": saved,
        "preempted": preempted,
        "last": step,
        "catching_sigterm": catching,
        "committed": mgr.steps(),
        "value": float(jnp.max(w.addressable_shards[0].data)),
    }


def main() -> None:
    """One process: the job from argv[1] (JSON); checks the manager puts the SIGTERM handler back."""
    job = json.loads(sys.argv[1])

    def previous(signum: int, frame: object) -> None:  # the handler the user had before
        print("previous handler ran", flush=True)

    signal.signal(signal.SIGTERM, previous)
    result = training_loop(job, 0)
    result["handler_restored"] = signal.getsignal(signal.SIGTERM) is previous
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
