"""Issue 79 item 1: a restart (``latest_step()`` then ``restore()``) agrees once on its step and
tier, and restores bit for bit from each tier.

One process of 8 CPU devices and a real 2-process job, on the local S3 server. The agreement
(inventory of every process's local directory, the store's listing at the primary, a barrier)
used to run twice per restart: once for ``latest_step()`` and again inside ``restore()``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import textwrap
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
import objckpt.locations.tiers as step_locations
from objckpt.locations import run_keys
from tests.multiprocess import run_processes


def _tree(step: int) -> dict[str, Any]:
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step
    return {"w": jax.make_array_from_callback(w.shape, NamedSharding(mesh, P("a", "b")), lambda i: w[i]), "n": step}


def _target() -> dict[str, Any]:
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    return {"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=NamedSharding(mesh, P("a", "b"))), "n": 0}


def _manager(s3_store: Any, local: Path) -> objckpt.CheckpointManager:
    return objckpt.CheckpointManager(
        s3_store.url,
        storage_options=s3_store.storage_options,
        local=objckpt.LocalCopies(local, interval_steps=1),
        save_rules=objckpt.SavePolicy(save_interval_steps=2),
    )


@pytest.fixture
def agreements(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per agreement on the step and tier (``objckpt.locations.agreement.agree``)."""
    calls: list[int] = []
    agree = step_locations.agree

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return agree(*args, **kwargs)

    monkeypatch.setattr(step_locations, "agree", counted)
    return calls


@pytest.mark.parametrize("tier", ["local", "store"])
def test_a_restart_agrees_once_and_restores_bit_exact(s3_store, tmp_path, agreements, tier):
    """Steps 0-3 saved (local every step, the store at 0 and 2); a new manager's ``latest_step()``
    and ``restore()`` agree once, and restore step 3 from the local tier (step 2 from the store once
    the local tier is gone), bit for bit."""
    mgr = _manager(s3_store, tmp_path / "local")
    for step in range(4):
        mgr.save(step, _tree(step))
    mgr.close()
    if tier == "store":
        shutil.rmtree(tmp_path / "local")
    agreements.clear()
    mgr = _manager(s3_store, tmp_path / "local")
    step = mgr.latest_step()
    out = mgr.restore(step, _target())
    assert len(agreements) == 1
    assert mgr.tier_status().last_restore.tier == tier
    assert step == (3 if tier == "local" else 2) and out["n"] == step
    assert np.asarray(out["w"]).tobytes() == np.asarray(_tree(step)["w"]).tobytes()
    mgr.close()


def test_a_save_or_another_step_between_latest_step_and_restore_agrees_again(s3_store, tmp_path, agreements):
    """``latest_step()``'s decision serves only the restore right after it, of its step: a save in
    between (here of a newer step) or another step asked for agrees anew, and the newer step restores."""
    mgr = _manager(s3_store, tmp_path / "local")
    for step in range(3):
        mgr.save(step, _tree(step))
    agreements.clear()
    assert mgr.latest_step() == 2
    mgr.save(3, _tree(3))
    out = mgr.restore(None, _target())
    assert out["n"] == 3 and len(agreements) == 2
    assert np.asarray(out["w"]).tobytes() == np.asarray(_tree(3)["w"]).tobytes()
    assert mgr.latest_step() == 3
    out = mgr.restore(2, _target())
    assert out["n"] == 2 and len(agreements) == 4
    mgr.close()


def test_a_manager_opens_without_waiting_for_its_run_keys_write(s3_store, tmp_path, monkeypatch):
    """The run key's write to the root (create-if-absent) runs in the background: a manager opens
    (a restart goes on) while it is held back; the first local save waits for it, then the step
    restores from the local tier bit for bit."""
    gate = threading.Event()

    class Held:
        def __init__(self, store: Any) -> None:
            self.store = store

        def __getattr__(self, name: str) -> Any:
            return getattr(self.store, name)

        async def put(self, *args: Any, **kwargs: Any) -> Any:
            while not gate.is_set():
                await asyncio.sleep(0.01)
            return await self.store.put(*args, **kwargs)

    init = run_keys.RunKeys.__init__
    monkeypatch.setattr(run_keys.RunKeys, "__init__", lambda self, store: init(self, Held(store)))
    opened: list[objckpt.CheckpointManager] = []
    try:
        opening = threading.Thread(target=lambda: opened.append(_manager(s3_store, tmp_path / "local")), daemon=True)
        opening.start()
        opening.join(60)
        assert opened, "the manager waited for its run key's write to open"
        mgr = opened[0]
        mgr.save(1, _tree(1))  # local only: the store saves every 2 steps
        assert mgr.tier_status().local_steps == []  # its write waits for the key
    finally:
        gate.set()
    mgr.wait()
    assert mgr.tier_status().local_steps == [1]
    mgr.close()
    mgr = _manager(s3_store, tmp_path / "local")
    out = mgr.restore(mgr.latest_step(), _target())
    assert mgr.tier_status().last_restore.tier == "local" and out["n"] == 1
    assert np.asarray(out["w"]).tobytes() == np.asarray(_tree(1)["w"]).tobytes()
    mgr.close()


_WORKER = """
import json, os, sys
import jax
import numpy as np

jax.config.update("jax_cpu_collectives_implementation", "gloo")
p, n = int(os.environ["OBJCKPT_MP_PROCESS"]), int(os.environ["OBJCKPT_MP_COUNT"])
jax.distributed.initialize(f"127.0.0.1:{os.environ['OBJCKPT_MP_PORT']}", num_processes=n, process_id=p,
                           initialization_timeout=60)
from jax.sharding import NamedSharding, PartitionSpec as P
import objckpt
from objckpt.multihost import get_coordinator

job = json.loads(os.environ["OBJCKPT_MP_JOB"])
mesh = jax.sharding.Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)).reshape(n, 2), ("a", "b"))
values = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
sharding = NamedSharding(mesh, P("a", "b"))
state = {"w": jax.make_array_from_callback(values.shape, sharding, lambda i: values[i])}
target = {"w": jax.ShapeDtypeStruct(values.shape, np.float32, sharding=sharding)}
make = lambda: objckpt.CheckpointManager(job["url"], storage_options=job["so"],
                                         local=objckpt.LocalCopies(job["local"], interval_steps=1))
mgr = make()
mgr.save(0, state)
mgr.close()
counts = {}
cls = type(get_coordinator())
for name in ("barrier", "publish", "collect", "broadcast"):
    def counted(self, *a, __f=getattr(cls, name), __name=name, **k):
        counts[__name] = counts.get(__name, 0) + 1
        return __f(self, *a, **k)
    setattr(cls, name, counted)
mgr = make()
step = mgr.latest_step()
out = mgr.restore(step, target)
tier = mgr.tier_status().last_restore.tier
exact = all(np.array_equal(np.asarray(s.data), values[s.index]) for s in out["w"].addressable_shards)
mgr.close()
print("RESULT " + json.dumps({"step": step, "tier": tier, "exact": exact, "counts": counts}), flush=True)
get_coordinator().barrier("test_tiers_restart/exit", timeout=60)
os._exit(0)
"""


@pytest.mark.slow
def test_a_two_process_local_restart_takes_three_barriers(s3_store, tmp_path):
    """A real 2-process job (peers=1) restarts from its local tier: one barrier to agree on the step
    and tier, one once each process has opened its part, one once each has restored it (four
    before: the agreement ran again inside ``restore()``); bit for bit on every process."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(_WORKER))
    job = {"url": s3_store.url, "so": s3_store.storage_options, "local": str(tmp_path / "local")}
    outs: list[str] = []
    results = run_processes(2, job, timeout=150, devices_per_process=2, stdout=outs, worker=worker)
    assert all(r is not None for r in results), outs
    for r in results:
        assert r == {"step": 0, "tier": "local", "exact": True, "counts": r["counts"]}, r  # type: ignore[index]
        assert r["counts"]["barrier"] == 3 and r["counts"]["publish"] == 1, r["counts"]  # type: ignore[index]
    print("coordinator calls of a 2-process local restart:", json.dumps(results[0]["counts"]))  # type: ignore[index]
