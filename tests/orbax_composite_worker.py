"""One process of tests/test_orbax_composite.py's multi-process tests: tests/mp_worker.py with these jobs.

Jobs (``kind``):
- ``orbax_composite``: every process draws a few batches from its shard of a grain
  ``DataLoader``, then Orbax's ``CheckpointManager`` saves a Composite step (a
  sharded ``state`` PyTree, a ``config`` JsonSave, grain's ``dataset`` item: one
  file per process, written by grain's own handler); then objckpt restores the
  step on the same processes, and the iterator resumed from this process's
  ``PerProcess`` value draws the batches the uninterrupted one draws.
- ``native_items``: restore ``{"dataset": PerProcess(), "config": Json(), "state": ...}``
  from the objckpt checkpoint that step was converted into.
"""

from __future__ import annotations

from typing import Any

import jax
import mp_worker
import numpy as np
from items_worker import loader  # the grain DataLoader over Source(64) that test_items draws from
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt

PROCESS, COUNT, JOB = mp_worker.PROCESS, mp_worker.COUNT, mp_worker.JOB
SHAPE = (64, 32)


def global_value() -> np.ndarray:
    return np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) * 0.5


def state_target() -> dict[str, Any]:
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    return {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=NamedSharding(mesh, P(None, "x"))), "step": None}


def orbax_composite() -> dict[str, Any]:
    import grain.python as gp
    import orbax.checkpoint as ocp

    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    value = global_value()
    w = jax.make_array_from_callback(SHAPE, NamedSharding(mesh, P("x")), lambda index: value[index])
    it = iter(loader(PROCESS, COUNT, JOB["seed"]))
    drawn = [next(it)["x"].tolist() for _ in range(3)]
    with ocp.CheckpointManager(JOB["root"], item_names=("state", "config", "dataset")) as manager:
        manager.save(
            3,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"w": w, "step": 3}),
                config=ocp.args.JsonSave(JOB["config"]),
                dataset=gp.PyGrainCheckpointSave(it),
            ),
        )
        manager.wait_until_finished()
    uninterrupted = [next(it)["x"].tolist() for _ in range(4)]
    out = objckpt.restore(
        f"{JOB['root']}/3",
        {"state": state_target(), "config": objckpt.Json(), "dataset": objckpt.PerProcess()},
    )
    resumed = iter(loader(PROCESS, COUNT, JOB["seed"]))  # a fresh iterator, as after a restart
    resumed.set_state(out["dataset"])
    return {
        "drawn": drawn,
        "uninterrupted": uninterrupted,
        "resumed": [next(resumed)["x"].tolist() for _ in range(4)],
        "config": out["config"],
        "dataset": out["dataset"].decode(),
        "w_exact": _exact(out["state"]["w"]),
        "step": out["state"]["step"],
    }


def native_items() -> dict[str, Any]:
    so = JOB.get("storage_options") or {}
    out = objckpt.restore(
        JOB["url"],
        {"state": state_target(), "config": objckpt.Json(), "dataset": objckpt.PerProcess()},
        storage_options=so,
    )
    return {"config": out["config"], "dataset": out["dataset"].decode(), "w_exact": _exact(out["state"]["w"])}


def _exact(array: jax.Array) -> bool:
    """Whether every addressable shard holds the saved bits of its box."""
    value = global_value()
    return all(np.asarray(s.data).tobytes() == value[s.index].tobytes() for s in array.addressable_shards)


def run() -> dict[str, Any]:
    kind = JOB["kind"]
    if kind == "orbax_composite":
        return orbax_composite()
    if kind == "native_items":
        return native_items()
    raise ValueError(f"unknown job kind {kind!r}")


if __name__ == "__main__":
    mp_worker.run = run  # main() calls run() by its module-level name
    mp_worker.main()
