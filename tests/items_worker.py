"""One process of tests/test_items.py's multi-process tests: tests/mp_worker.py with these jobs.

Jobs (``kind``):
- ``items``: save a tree with a ``Json`` and a ``PerProcess`` item (each process its own
  value), then restore it on the same processes: this process's value and every one's.
- ``grain``: a grain ``DataLoader`` sharded over the processes; its iterator's state
  goes through ``PerProcess``, and the batches drawn after a restore are compared with
  those of the uninterrupted iterator.
"""

from __future__ import annotations

from typing import Any

import mp_worker
import numpy as np

import objckpt

PROCESS, COUNT, JOB = mp_worker.PROCESS, mp_worker.COUNT, mp_worker.JOB


def items() -> dict[str, Any]:
    so = JOB.get("storage_options") or {}
    url = JOB["url"]
    tree = {
        "w": np.arange(1000, dtype=np.float32),
        "config": objckpt.Json({"lr": 0.1, "layers": [1, 2]}),
        "data": objckpt.PerProcess(f"process {PROCESS} of {COUNT}".encode() * (PROCESS + 1)),
        "rng": objckpt.PerProcess({"seed": 100 + PROCESS}),
    }
    objckpt.save(url, tree, storage_options=so)
    mine = objckpt.restore(
        url,
        {"config": objckpt.Json(), "data": objckpt.PerProcess(), "rng": objckpt.PerProcess()},
        partial=True,
        storage_options=so,
    )
    every = objckpt.restore(url, {"data": objckpt.PerProcess(all=True)}, partial=True, storage_options=so)
    return {
        "config": mine["config"],
        "data": mine["data"].decode(),
        "rng": mine["rng"],
        "all": [v.decode() for v in every["data"]],
    }


class Source:
    """A small in-memory data source with a stable ``repr`` (grain keeps it in its state)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"x": i * 7 % 101}

    def __repr__(self) -> str:
        return f"Source({self.n})"


def loader(process: int, count: int, seed: int) -> Any:
    """A grain ``DataLoader`` over ``Source(64)``, shuffled by ``seed``, this ``process``'s shard of ``count``
    (tests/orbax_composite_worker.py draws from the same one)."""
    import grain.python as gp

    sampler = gp.IndexSampler(64, shard_options=gp.ShardOptions(process, count), shuffle=True, num_epochs=1, seed=seed)
    return gp.DataLoader(data_source=Source(64), sampler=sampler, operations=[gp.Batch(2)], worker_count=0)


def grain_job() -> dict[str, Any]:
    so = JOB.get("storage_options") or {}
    url = JOB["url"]
    it = iter(loader(PROCESS, COUNT, JOB.get("seed", 0)))
    drawn = [next(it)["x"].tolist() for _ in range(3)]
    objckpt.save(url, {"step": 3, "data": objckpt.PerProcess(it.get_state())}, storage_options=so)
    uninterrupted = [next(it)["x"].tolist() for _ in range(4)]
    resumed = iter(loader(PROCESS, COUNT, JOB.get("seed", 0)))  # a fresh iterator, as after a restart
    out = objckpt.restore(url, {"step": None, "data": objckpt.PerProcess()}, storage_options=so)
    resumed.set_state(out["data"])
    after = [next(resumed)["x"].tolist() for _ in range(4)]
    return {"drawn": drawn, "uninterrupted": uninterrupted, "resumed": after, "step": out["step"]}


def run() -> dict[str, Any]:
    kind = JOB["kind"]
    if kind == "items":
        return items()
    if kind == "grain":
        return grain_job()
    raise ValueError(f"unknown job kind {kind!r}")


if __name__ == "__main__":
    mp_worker.run = run  # main() calls run() by its module-level name
    mp_worker.main()
