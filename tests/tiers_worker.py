"""One process of a local-tier test job (tests/test_tiers_local.py): train, save, crash, resume.

Reads its job from OBJCKPT_TIERS_JOB (JSON), prints ``RESULT <json>`` and leaves with
``os._exit``, so a dead peer never holds it in JAX's shutdown. The state after step ``s``
is known exactly (every element of ``w`` is its index plus ``s + 1``; ``r``, replicated on
every device, likewise; the per-process item names the process and the step), so a
restore is checked bit for bit against the step it says it restored.

A job runs ``rounds`` rounds. Each round first damages this process's local tier as the
job's ``damage`` says (not round 0), then opens a manager, restores the latest step
(recording the step, the tier and whether every byte matched), trains ``steps`` more steps
(round 0: ``first_steps``) saving through the manager, and closes it. ``kill`` makes the
processes in ``victims`` SIGKILL themselves in the middle of the local save of one step.
``die`` makes process ``die["process"]`` SIGKILL itself before step ``die["step"]``; the others
go on saving (``die["steps"]`` more steps), record how their ``save``/``wait`` ended and how
long after the death, and print ``SURVIVOR <json>`` (the test reads it even if JAX then stops
them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

PROCESS = int(os.environ["OBJCKPT_TIERS_PROCESS"])
COUNT = int(os.environ["OBJCKPT_TIERS_COUNT"])
JOB: dict[str, Any] = json.loads(os.environ["OBJCKPT_TIERS_JOB"])


def _init() -> None:
    import jax

    if JOB.get("cpu_collectives"):  # the test's choice, never objckpt's
        jax.config.update("jax_cpu_collectives_implementation", JOB["cpu_collectives"])
    if COUNT > 1:
        jax.distributed.initialize(
            f"127.0.0.1:{os.environ['OBJCKPT_TIERS_PORT']}",
            num_processes=COUNT,
            process_id=PROCESS,
            initialization_timeout=60,
            heartbeat_timeout_seconds=int(JOB.get("heartbeat", 10)),
            shutdown_timeout_seconds=5,
        )


def _values(step: int) -> tuple[Any, Any]:
    """The global values of ``w`` and ``r`` after ``step``: the same for 8 devices (4 processes x 2) or 4."""
    import numpy as np

    w = np.arange(32 * 64, dtype=np.float32).reshape(32, 64) + (step + 1)
    r = np.arange(16, dtype=np.int32).reshape(4, 4) * 3 + (step + 1)
    return w, r


def _state(step: int) -> dict[str, Any]:
    """The exact state after ``step`` (-1: before the first)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import objckpt

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    w, r = _values(step)
    put = jax.make_array_from_callback
    return {
        "w": put(w.shape, NamedSharding(mesh, P("data")), lambda index: w[index]),
        "r": put(r.shape, NamedSharding(mesh, P()), lambda index: r[index]),
        "data": objckpt.PerProcess(f"process {PROCESS} after step {step}"),
        "config": objckpt.Json({"lr": 0.5, "layers": [1, 2]}),
        "step": step,
    }


def _target() -> dict[str, Any]:
    """What a restart restores into: the saved shardings, or (``reshard``) others: ``w`` replicated
    (as Flax NNX leaves an unannotated leaf it saved sharded) and ``r`` split over the devices."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import objckpt

    state = _state(0)
    if JOB.get("reshard"):
        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        for name, spec in (("w", P()), ("r", P("data"))):
            array = state[name]
            state[name] = jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=NamedSharding(mesh, spec))
    return {**state, "data": objckpt.PerProcess(all=bool(JOB.get("all_values"))), "config": objckpt.Json()}


def _exact(restored: dict[str, Any], step: int) -> list[str]:
    import numpy as np

    want, target = _state(step), _target()
    bad = []
    for name, full in zip(("w", "r"), _values(step)):
        got = restored[name]
        if got.sharding != target[name].sharding:
            bad.append(f"{name}: sharding {got.sharding}")
        for a in got.addressable_shards:
            x, y = np.asarray(a.data), full[a.index]
            if x.dtype != y.dtype or x.tobytes() != y.tobytes():
                bad.append(f"{name}: shard {a.index} differs")
    if JOB.get("all_values"):  # every process's value, as the job that saved them had them
        want["data"].value = [f"process {p} after step {step}" for p in range(int(JOB["all_values"]))]
    if restored["data"] != want["data"].value:
        bad.append(f"data: {restored['data']!r}")
    if restored["config"] != {"lr": 0.5, "layers": [1, 2]} or restored["step"] != step:
        bad.append(f"config/step: {restored['config']!r} {restored['step']!r}")
    return bad


def _install_kill(kill: dict[str, Any]) -> None:
    """SIGKILL this process inside the local save of ``kill["step"]``: while its first blob is half
    written (``point="data"``) or once its checkpoint is written and the record half written
    (``"manifest"``)."""
    from objckpt.locations import local_dirs
    from objckpt.saving.local_snapshot import save_part

    if PROCESS not in kill["victims"]:
        return
    original = local_dirs.write_step

    def write_step(directory: Path, snap: Any, *, key: bytes, options: Any) -> Any:
        if snap.step != kill["step"]:
            return original(directory, snap, key=key, options=options)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = local_dirs.tmp_dir(directory)
        if kill["point"] == "data":
            (tmp / "00").mkdir()
            (tmp / "00" / f"{snap.save_id}-p0-000000.blob").write_bytes(bytes(snap.buffer)[: snap.buffer.size // 2])
        else:
            save_part(tmp.as_uri(), snap, options)
            (tmp / ".part.json.tmp").write_bytes(b'{"crc32c":1,"mac":"')
        _killed(PROCESS).touch()
        if PROCESS == 0:  # JAX's service lives in process 0: the other victims die by their own kill first
            _wait_for_victims(kill)
        os.kill(os.getpid(), signal.SIGKILL)

    local_dirs.write_step = write_step  # type: ignore[assignment]


def _killed(process: int) -> Path:
    """The marker a victim leaves just before it kills itself."""
    markers = Path(JOB["local"]).parent / "killed"
    markers.mkdir(parents=True, exist_ok=True)
    return markers / f"{process}-{JOB['kill']['step']}"


def _wait_for_victims(kill: dict[str, Any], timeout: float = 60) -> None:
    """Wait until every other victim has reached its kill: a survivor (process 0 above all, where
    JAX's coordination service runs) that left first would have JAX stop the victims before it."""
    deadline = time.monotonic() + timeout
    others = [p for p in kill["victims"] if p != PROCESS]
    while not all(_killed(p).exists() for p in others) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)


def _die_or_survive(mgr: Any, die: dict[str, Any], tree_of: Any) -> None:
    """The victim kills itself; a survivor saves on (local saves with their peer copies) and waits,
    prints how that ended and how many seconds after the victim's death, and leaves."""
    marker = Path(JOB["local"]).parent / "died"
    if PROCESS == die["process"]:
        marker.write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    while not marker.exists():
        time.sleep(0.01)
    died = float(marker.read_text() or time.time())
    outcome: dict[str, Any] = {"error": None}
    try:
        for step in range(die["step"], die["step"] + int(die.get("steps", 3))):
            mgr.save(step, tree_of(step))
        mgr.wait()
    except Exception as e:
        outcome = {"error": type(e).__name__, "message": str(e)[:2000]}
    outcome["seconds"] = time.time() - died
    print("SURVIVOR " + json.dumps(outcome), flush=True)
    sys.stderr.flush()
    os._exit(0)


def _forge(step: Path, old: bytes, new: bytes) -> None:
    """Edit a local step's manifest, and its record to pin the edit (its SHA-256, its crc32c), as
    someone who can write the disk but has not the run's key (which lives in the root) would."""
    import hashlib
    import json
    import re

    from objckpt.core.checksum import crc32c

    manifest = (step / "manifest.json").read_bytes()
    assert manifest.count(old) == 1, old
    manifest = manifest.replace(old, new)
    (step / "manifest.json").write_bytes(manifest)
    sealed = re.match(
        rb'\{"crc32c":(\d+),("mac":"[0-9a-f]+",)"record":(.*)\}\Z', (step / "part.json").read_bytes(), re.DOTALL
    )
    assert sealed is not None
    doc = json.loads(sealed.group(3))
    doc["manifest"] = {"size": len(manifest), "sha256": hashlib.sha256(manifest).hexdigest()}
    body = json.dumps(doc, separators=(",", ":")).encode()
    (step / "part.json").write_bytes(b'{"crc32c":%d,%s"record":%s}' % (crc32c(body), sealed.group(2), body))


def _damage(round_: int) -> None:
    """This process's part of the round's damage to the local tier."""
    damage = JOB.get("damage")
    mine = Path(JOB["local"]) / f"process_{PROCESS}"
    victim = round_ % COUNT
    if damage == "wipe_one" and PROCESS == victim or damage == "wipe_all":
        shutil.rmtree(mine, ignore_errors=True)
    if damage == "forge_peer":  # the victim's directory gone; its keeper's copy edited, its crc32c recomputed
        if PROCESS == victim:
            shutil.rmtree(mine, ignore_errors=True)
        if PROCESS == (victim + COUNT // 2) % COUNT:
            held = sorted((mine / "peer" / f"process_{victim}").glob("step_*/part.json"))
            if held:
                _forge(held[-1].parent, b'"lr":0.5', b'"lr":0.7')
    if damage == "drop_newest_one" and PROCESS == victim:
        steps = sorted(p for p in mine.glob("step_*") if (p / "part.json").exists())
        if steps:
            shutil.rmtree(steps[-1])


def run() -> dict[str, Any]:
    import jax

    import objckpt

    if JOB.get("kill"):
        _install_kill(JOB["kill"])
    rounds = []
    for round_ in range(int(JOB.get("rounds", 1))):
        if round_ > 0:
            _damage(round_)
        mgr = objckpt.CheckpointManager(
            JOB["url"],
            storage_options=JOB.get("storage_options") or {},
            options=objckpt.Options(barrier_timeout=float(JOB.get("barrier_timeout", 60))),
            save_rules=objckpt.SavePolicy(save_interval_steps=int(JOB.get("save_interval", 1000))),
            local=objckpt.LocalCopies(
                JOB["local"],
                interval_steps=int(JOB.get("local_interval", 5)),
                keep_last=2,
                peers=int(JOB.get("peers", 0)),
            ),
        )
        start = mgr.latest_step()
        record: dict[str, Any] = {"start": start}
        if start is not None:
            restored = mgr.restore(start, _target())
            record.update(tier=mgr.tier_status().last_restore.tier, bad=_exact(restored, start))  # type: ignore[union-attr]
        print("RESTORED " + json.dumps(record), flush=True)  # before a kill can come
        first = 0 if start is None else start + 1
        steps = int(JOB["first_steps"] if round_ == 0 and "first_steps" in JOB else JOB["steps"])
        update = jax.jit(lambda x: x + 1)
        total = jax.jit(lambda x: x.sum())  # over every process's shards: a cross-process collective
        state = _state(start if start is not None else -1)
        w, r = state["w"], state["r"]
        for step in range(first, first + steps):
            if JOB.get("die") and step == JOB["die"]["step"]:
                _die_or_survive(mgr, JOB["die"], _state)
            w, r = update(w), update(r)
            if JOB.get("collective_steps"):  # a step with a collective while the peer copy may run beside it
                float(total(w))
            tree = {**_state(step), "w": w, "r": r}
            mgr.save(step, tree)
        mgr.close()
        status = mgr.tier_status()
        record.update(last=first + steps - 1, local_steps=status.local_steps, held=status.peer_held)
        record["peers"] = status.peers
        rounds.append(record)
    if JOB.get("kill") and PROCESS not in JOB["kill"]["victims"]:
        _wait_for_victims(JOB["kill"])
    return {"rounds": rounds}


def main() -> None:
    _init()
    try:
        result = run()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    _linger()
    os._exit(0)


def _linger(timeout: float = 30) -> None:
    """Process 0 hosts JAX's coordination service: it stays until every other living process has
    printed its result (each says so in the key-value store), or JAX would stop them first."""
    if COUNT == 1:
        return
    from jax._src import distributed

    client = distributed.global_state.client
    victims = set(JOB["kill"]["victims"]) if JOB.get("kill") else set()
    try:
        if PROCESS != 0:
            client.key_value_set(f"tiers_worker/done/{PROCESS}", "1")
            return
        others = len([p for p in range(1, COUNT) if p not in victims])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(client.key_value_dir_get("tiers_worker/done/")) < others:
            time.sleep(0.05)
    except Exception:  # the service is failing: nothing to wait for
        pass


if __name__ == "__main__":
    main()
