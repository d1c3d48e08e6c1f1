"""The recovery tiers (issue 56): local tier, peer copy, object store; which step and tier a restart takes.

The fault tests run 4 JAX processes x 2 CPU devices (tests/tiers_worker.py) against the local
S3 server; every restore is checked bit for bit against the step it says it restored. The
restart scenarios that need no killed process (a tier wiped, different newest steps) run
their trials as rounds inside one job: damage, restart the manager, restore, train on,
close. The SIGKILL scenarios need a fresh job per trial.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.core.format.local import RECORD, parse_part_record, seal, unseal
from objckpt.errors import ChecksumMismatchError, FormatError, PartialCopyError, TargetMismatchError
from objckpt.layouts.native import NativeCheckpoint
from objckpt.locations.agreement import LOCAL, PEER, STORE, Inventory, decide
from objckpt.locations.local_dirs import ForeignStepError, LocalDir, complete_steps, read_record
from objckpt.peers.copies import _Incoming, payload_of, unpack
from objckpt.restoring.api import restore_copy
from objckpt.roots.step_names import step_dir
from objckpt.saving.local_snapshot import snapshot
from tests.multiprocess import run_processes

WORKER = Path(__file__).with_name("tiers_worker.py")
KILL_TRIALS = int(os.environ.get("OBJCKPT_TIER_TRIALS", "1"))  # per SIGKILL test (a fresh 4-process job each)
ROUNDS = int(os.environ.get("OBJCKPT_TIER_ROUNDS", "10"))  # per restart test (rounds inside one job)


# ---------------------------------------------------------------------------- the decision (pure)


def _inv(p: int, own: dict[int, str], *, count: int = 4, held: dict[int, dict[int, str]] | None = None) -> Inventory:
    return Inventory(p, {s: (i, count) for s, i in own.items()}, held or {}, True, [0, 10] if p == 0 else None)


def test_decide_takes_the_newest_step_in_the_fastest_tier_that_has_it_everywhere():
    everywhere = {p: _inv(p, {10: "a", 15: "a"}) for p in range(4)}
    assert decide(everywhere, 4, want=None, keepers=None).tiers == (LOCAL,)
    assert decide(everywhere, 4, want=None, keepers=None).step == 15
    assert decide(everywhere, 4, want=10, keepers=None).tiers == (LOCAL, STORE)
    # process 2 lacks step 15: the newest complete everywhere is 10
    uneven = {**everywhere, 2: _inv(2, {10: "a"})}
    assert decide(uneven, 4, want=None, keepers=None).step == 10
    # ...unless its keeper (process 0 with keepers 2 -> 0) holds its copy of 15
    keepers = [2, 3, 0, 1]
    held = {**uneven, 0: _inv(0, {10: "a", 15: "a"}, held={2: {15: "a"}})}
    got = decide(held, 4, want=None, keepers=keepers)
    assert (got.step, got.tiers, got.fetch) == (15, (PEER,), {2: 0})
    # a copy of another save (another run that reached step 15) is not that step
    other = {**uneven, 0: _inv(0, {10: "a", 15: "a"}, held={2: {15: "b"}})}
    assert decide(other, 4, want=None, keepers=keepers).step == 10
    # two runs that both reached 15: not one step
    mixed = {**everywhere, 3: _inv(3, {10: "a", 15: "b"})}
    assert decide(mixed, 4, want=None, keepers=None).step == 10


def test_decide_falls_back_to_the_store_and_tries_local_on_another_process_count():
    wiped = {p: _inv(p, {}) for p in range(4)}
    assert decide(wiped, 4, want=None, keepers=[2, 3, 0, 1]) == decide(wiped, 4, want=10, keepers=None)
    assert decide(wiped, 4, want=None, keepers=None).tiers == (STORE,)
    # saved by 4 processes, restarted on 2: local only for a step the store holds too, and tried first
    two = {p: _inv(p, {10: "a", 15: "a"}) for p in range(2)}
    got = decide(two, 2, want=None, keepers=None)
    assert (got.step, got.tiers) == (10, (LOCAL, STORE))
    assert decide({p: _inv(p, {}) for p in range(4)}, 4, want=12, keepers=None).tiers == ()


# ---------------------------------------------------------------------------- one process's tier


ROOT = "s3://bucket/root"
KEYS = {"run1": b"k" * 32}  # the run keys a manager keeps in its root (objckpt.locations.run_keys)


def _tree(step: int) -> dict[str, Any]:
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step
    return {
        "w": jax.make_array_from_callback(w.shape, NamedSharding(mesh, P("a", "b")), lambda i: w[i]),
        "b": jax.device_put(np.arange(8, dtype=np.int8) + step, NamedSharding(mesh, P())),
        "data": objckpt.PerProcess(b"it=%d" % step),
        "config": objckpt.Json({"step": step}),
        "n": step,
    }


def _snap(step: int, **how: Any) -> Any:
    return snapshot(
        _tree(step), step=step, root=ROOT, save_id="run1", process_index=0, process_count=1, metadata={}, **how
    )


def test_a_local_step_is_an_objckpt_checkpoint_its_record_pins(tmp_path):
    """What a local save writes is a checkpoint like any other (objckpt.inspect and verify read it),
    and its record names the root, the step, the run, the process and the manifest's SHA-256."""
    tier = LocalDir(tmp_path, 0, 1, keep_last=2, url=ROOT, key_of=KEYS.get)
    record = tier.write(_snap(1))
    directory = tier.step_dir(1)
    assert record == tier.read(directory) and record.step == 1 and record.save_id == "run1"
    assert record.pins((directory / "manifest.json").read_bytes())
    info = objckpt.inspect(directory.as_uri())
    assert info.format_version == 3 and info.num_processes == 1 and info.save_id == "run1"
    assert sorted(info.leaves) == ["['b']", "['config']", "['data']", "['n']", "['w']"]
    assert {p.name for p in directory.rglob("*") if p.is_file()} >= {"manifest.json", RECORD}
    assert any(p.suffix == ".index" for p in directory.rglob("*")) and any(
        p.suffix == ".blob" for p in directory.rglob("*")
    )


def test_a_torn_local_save_is_never_read_and_retention_removes_it(tmp_path):
    tier = LocalDir(tmp_path, 0, 1, keep_last=2, url=ROOT, key_of=KEYS.get)
    for step in (1, 2, 3):
        tier.write(_snap(step))
    assert sorted(tier.steps()) == [2, 3]  # keep_last=2
    torn = tier.step_dir(4)
    torn.mkdir()
    (torn / "manifest.json").write_bytes((tier.step_dir(3) / "manifest.json").read_bytes())
    assert sorted(tier.steps()) == [2, 3]  # a checkpoint without its record: no step
    (torn / RECORD).write_bytes((tier.step_dir(3) / RECORD).read_bytes())  # a record of step 3, in step 4
    assert sorted(complete_steps(tier.own)) == [2, 3]
    cut = tier.own / ".tmp-step_0000000005-0a1b2c3d"  # a write cut off before it was moved into place
    cut.mkdir()
    tier.retain()
    assert not torn.exists() and not cut.exists() and sorted(tier.steps()) == [2, 3]


def test_a_step_saved_again_replaces_the_old_one_whole(tmp_path):
    tier = LocalDir(tmp_path, 0, 1, keep_last=2, url=ROOT, key_of=KEYS.get)
    first = tier.write(_snap(1))
    again = tier.write(
        snapshot(_tree(9), step=1, root=ROOT, save_id="run1", process_index=0, process_count=1, metadata={})
    )
    assert first != again and tier.read(tier.step_dir(1)) == again
    out = _restore_step(tier, 1, {"w": np.zeros((64, 32), np.float32)}, partial=True)
    assert np.array_equal(out["w"], np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + 9)


def test_a_peer_payload_unpacks_to_its_step_and_a_short_or_foreign_one_is_refused(tmp_path):
    tier = LocalDir(tmp_path, 0, 1, keep_last=2, url=ROOT, key_of=KEYS.get)
    tier.write(_snap(1))
    payload = np.concatenate(payload_of(tier, tier.step_dir(1)))
    got = unpack(payload, "process 1", tier, 0)
    assert got.record == read_record(tier.step_dir(1))
    on_disk = {str(p.relative_to(tier.step_dir(1))): p.read_bytes() for p in tier.step_dir(1).rglob("*") if p.is_file()}
    assert {k: v.tobytes() for k, v in got.objects.items()} == on_disk
    with pytest.raises(FormatError, match="peer copy from process 1: its files do not fill the payload exactly"):
        unpack(payload[:-1], "process 1", tier, 0)
    with pytest.raises(FormatError, match="peer copy from process 1: not a local-tier step"):
        unpack(np.concatenate([np.frombuffer(b"OBJCKPT9", np.uint8), payload[8:]]), "process 1", tier, 0)
    with pytest.raises(FormatError, match="peer copy from process 1: 3 bytes is not a local-tier step"):
        unpack(payload[:3], "process 1", tier, 0)
    other = LocalDir(tmp_path / "other", 0, 1, keep_last=2, url="s3://bucket/another", key_of=KEYS.get)
    other.write(
        snapshot(
            _tree(1), step=1, root="s3://bucket/another", save_id="run1", process_index=0, process_count=1, metadata={}
        )
    )
    with pytest.raises(ForeignStepError, match="a step of the root s3://bucket/another"):
        unpack(np.concatenate(payload_of(other, other.step_dir(1))), "process 1", tier, 0)
    # a checkpoint's file edited in flight: the record no longer pins its manifest
    doctored = payload.copy()
    start = bytes(doctored).index(b'"format":"objckpt"')
    doctored[start + 1] ^= 1
    with pytest.raises(FormatError, match="not the one its record pins"):
        unpack(doctored, "process 1", tier, 0)


def test_a_keeper_writes_each_file_of_a_peer_copy_as_it_arrives_in_chunks_of_any_size(tmp_path):
    """The keeper's sink gets a payload in offset order, in chunks the transfer picks: a head cut
    anywhere, files split across chunks. What it places is the owner's step, file for file."""
    owner = LocalDir(tmp_path / "owner", 1, 2, keep_last=2, url=ROOT, key_of=KEYS.get)
    owner.write(snapshot(_tree(3), step=3, root=ROOT, save_id="run1", process_index=1, process_count=2, metadata={}))
    payload = np.concatenate(payload_of(owner, owner.step_dir(3)))
    keeper = LocalDir(tmp_path / "keeper", 0, 2, keep_last=2, url=ROOT, key_of=KEYS.get)
    incoming = _Incoming(keeper, 1)
    for at in range(0, payload.size, 7):
        incoming(at, memoryview(payload[at : at + 7]))
    record = incoming.finish(payload.size)
    assert record is not None and record == owner.read(owner.step_dir(3))
    held = keeper.held_dir(1) / step_dir(3)
    files = lambda d: {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}  # noqa: E731
    assert files(held) == files(owner.step_dir(3))
    assert sorted(keeper.held()[1]) == [3] and not list(keeper.held_dir(1).glob(".tmp-*"))
    short = _Incoming(keeper, 1)
    short(0, memoryview(payload[:100]))
    with pytest.raises(FormatError, match="100 of"):
        short.finish(payload.size)


def test_a_damaged_local_record_is_a_format_error_never_another_exception(tmp_path):
    """Every field of a real local record replaced by each of a set of wrong values: the strict
    parse answers FormatError or a valid record, never TypeError or KeyError."""
    tier = LocalDir(tmp_path, 0, 1, keep_last=2, url=ROOT, key_of=KEYS.get)
    raw = tier.write(_snap(1))
    doc = json.loads(unseal(raw.to_json(KEYS["run1"])))
    wrong = [None, 1, -1, "x", [], {}, [1], 1.5, True, [[0]], {"size": 1}, "f" * 64, 2**70, ""]

    def paths(node: Any, path: tuple[Any, ...] = ()) -> Any:
        yield path
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in children:
            yield from paths(child, (*path, key))

    checked = 0
    for path in [p for p in paths(doc) if p]:
        for value in wrong:
            mutated = json.loads(json.dumps(doc))
            node = mutated
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
            try:
                parse_part_record(seal(json.dumps(mutated).encode(), KEYS["run1"]))
            except FormatError:
                pass
            checked += 1
    assert checked > 100


def _restore_step(tier: LocalDir, step: int, target: Any, *, partial: bool = False, checkpoint: Any = None) -> Any:
    """A local step restored by the one restore, as the manager's tiers do."""
    checkpoint = checkpoint or tier.open(tier.step_dir(step), tier.steps()[step])
    return restore_copy(checkpoint, target, partial=partial)


def test_local_restore_reads_its_boxes_bit_exact_through_the_one_restore_and_refuses_what_it_does_not_hold(tmp_path):
    tier = LocalDir(tmp_path, 0, 1, keep_last=2, url=ROOT, key_of=KEYS.get)
    tree = _tree(7)
    tier.write(snapshot(tree, step=7, root=ROOT, save_id="run1", process_index=0, process_count=1, metadata={}))
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    target = {
        "w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=NamedSharding(mesh, P("y", "x"))),  # another layout
        "b": jax.ShapeDtypeStruct((8,), np.int8, sharding=NamedSharding(mesh, P("x"))),
        "data": objckpt.PerProcess(),
        "config": objckpt.Json(),
        "n": 0,
    }
    out = _restore_step(tier, 7, target)
    assert np.asarray(out["w"]).tobytes() == np.asarray(tree["w"]).tobytes()
    assert out["w"].sharding == target["w"].sharding
    assert np.asarray(out["b"]).tobytes() == np.asarray(tree["b"]).tobytes()
    assert (out["data"], out["config"], out["n"]) == (b"it=7", {"step": 7}, 7)
    # what the one restore gives every location: a checked cast, a partial restore, the saved sharding
    as_bf16 = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16, sharding=target["w"].sharding)
    cast = _restore_step(tier, 7, {**target, "w": as_bf16})
    assert cast["w"].dtype == jnp.bfloat16
    expected = np.asarray(tree["w"]).astype(jnp.bfloat16).astype(np.float32)
    assert np.array_equal(np.asarray(cast["w"], np.float32), expected)
    as_int = jax.ShapeDtypeStruct((64, 32), np.int32, sharding=target["w"].sharding)
    with pytest.raises(TargetMismatchError, match="w"):
        _restore_step(tier, 7, {**target, "w": as_int})
    only_w = _restore_step(tier, 7, {"w": jax.ShapeDtypeStruct((64, 32), np.float32)}, partial=True)
    assert np.asarray(only_w["w"]).tobytes() == np.asarray(tree["w"]).tobytes()
    assert only_w["w"].sharding == tree["w"].sharding  # no sharding asked: the saved one, rebuilt
    # a box the copy does not hold (one of w's pieces left out): PartialCopyError naming the leaf, never a hole
    opened = tier.open(tier.step_dir(7), tier.steps()[7])
    leaves = opened.manifest.leaves
    w = next(i for i, leaf in enumerate(leaves) if leaf.path == "['w']")
    fewer = list(leaves[w].pieces)[1:]
    short = dataclasses.replace(
        opened.manifest, leaves=(*leaves[:w], dataclasses.replace(leaves[w], pieces=tuple(fewer)), *leaves[w + 1 :])
    )
    holed = NativeCheckpoint(opened.store, short, size_limit=1 << 20, holds_process=0)
    with pytest.raises(PartialCopyError, match=r"leaf \['w'\]"):
        _restore_step(tier, 7, target, checkpoint=holed)
    [blob] = tier.step_dir(7).rglob("*.blob")  # one flipped bit in a piece: its crc32c refuses it
    raw = bytearray(blob.read_bytes())
    raw[1000] ^= 1
    blob.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError):
        _restore_step(tier, 7, target)


def test_manager_restores_from_local_then_store_and_gc_leaves_the_local_tier_alone(s3_store, tmp_path, caplog):
    local = tmp_path / "local"
    mgr = objckpt.CheckpointManager(
        s3_store.url,
        storage_options=s3_store.storage_options,
        save_rules=objckpt.SavePolicy(save_interval_steps=10),
        local=objckpt.LocalCopies(local, interval_steps=5),
    )
    for step in range(13):
        assert mgr.save(step, _tree(step)) == (step % 5 == 0)
    mgr.wait()
    mgr.close()
    mgr = objckpt.CheckpointManager(s3_store.url, storage_options=s3_store.storage_options, local=str(local))
    status = mgr.tier_status()
    assert (status.local_steps, status.store_steps, status.peers) == ([5, 10], [0, 10], False)
    assert mgr.latest_step() == 10
    target = {**_tree(0), "data": objckpt.PerProcess(), "config": objckpt.Json()}
    with caplog.at_level("INFO", logger="objckpt"):
        out = mgr.restore(None, target)
    last = mgr.tier_status().last_restore
    assert last is not None and last.tier == "local"
    assert list(last.phases) == ["decide", "open", "agree_open", "restore", "agree_done"]  # where the time went
    assert all(v >= 0 for v in last.phases.values()) and sum(last.phases.values()) <= last.seconds
    assert "restored step 10 from the local tier" in caplog.text
    assert np.asarray(out["w"]).tobytes() == np.asarray(_tree(10)["w"]).tobytes() and out["data"] == b"it=10"
    before = sorted(p.relative_to(local) for p in local.rglob("*"))
    mgr.gc(grace_seconds=0)
    mgr.delete(0)  # an old step: no roll-back
    assert sorted(p.relative_to(local) for p in local.rglob("*")) == before  # gc and delete never reach it
    out = mgr.restore(5, target)  # only local: the store never had step 5
    assert mgr.tier_status().last_restore.tier == "local" and out["n"] == 5  # type: ignore[union-attr]
    assert mgr.tier_status().local_steps == [5]  # the job goes on from 5: local step 10 retired
    for p in (local / "process_0").iterdir():
        p.rename(p.with_name("gone_" + p.name))  # the local tier lost: the store serves
    out = mgr.restore(None, target)
    last = mgr.tier_status().last_restore
    assert last is not None and last.tier == "store" and out["n"] == 10
    assert list(last.phases) == ["decide", "store"]
    assert np.asarray(out["w"]).tobytes() == np.asarray(_tree(10)["w"]).tobytes()
    with pytest.raises(objckpt.CheckpointNotFoundError, match="step 5"):
        mgr.restore(5, target)
    mgr.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"local": "ROOT/local"}, "inside the manager's root"),
        ({"local": "s3://bucket/local"}, "a directory on this host"),
        ({"local": "LOCAL", "interval_steps": 0}, "interval_steps and keep_last must be at least 1"),
        ({"local": "LOCAL", "keep_last": 0}, "interval_steps and keep_last must be at least 1"),
        ({"local": "LOCAL", "peers": 2}, "peers must be 0 or 1"),
    ],
)
def test_bad_local_tier_arguments_are_refused(tmp_path, kwargs, message):
    root = tmp_path / "root"
    kwargs = {
        k: v.replace("ROOT", str(root)).replace("LOCAL", str(tmp_path / "l")) if isinstance(v, str) else v
        for k, v in kwargs.items()
    }
    with pytest.raises(ValueError, match=message):
        objckpt.CheckpointManager(str(root), local=objckpt.LocalCopies(kwargs.pop("local"), **kwargs))


# ---------------------------------------------------------------------------- 4 processes


def _launch(
    n: int,
    job: dict[str, Any],
    *,
    timeout: float = 150,
    codes: list[int] | None = None,
    restored: list[list[dict[str, Any]]] | None = None,
) -> list[dict[str, Any] | None]:
    """Run ``job`` in ``n`` worker processes of 2 CPU devices; each one's RESULT (None if none).

    ``codes``: filled with their exit statuses; ``restored``: with each one's RESTORED records
    (printed right after each restore, so a process killed later still tells what it restored).
    """
    outs: list[str] = []
    results = run_processes(
        n,
        job,
        timeout=timeout,
        devices_per_process=2,
        returncodes=codes,
        stdout=outs,
        worker=WORKER,
        env_prefix="OBJCKPT_TIERS",
    )
    if restored is not None:
        restored.extend(
            [json.loads(line[len("RESTORED ") :]) for line in out.splitlines() if line.startswith("RESTORED ")]
            for out in outs
        )
    return results


def _job(s3_store: Any, local: Path, **extra: Any) -> dict[str, Any]:
    return {"url": s3_store.url, "storage_options": s3_store.storage_options, "local": str(local), **extra}


def _restored(results: list[dict[str, Any] | None]) -> list[tuple[int, str]]:
    """(step, tier) of each round, the same on every process, every restore bit-exact."""
    assert all(r is not None for r in results), results
    rounds = [r["rounds"] for r in results]  # type: ignore[index]
    assert all(len(x) == len(rounds[0]) for x in rounds)
    out = []
    for k in range(len(rounds[0])):
        got = {(x[k]["start"], x[k].get("tier")) for x in rounds}
        assert len(got) == 1, f"round {k}: processes disagree: {got}"
        assert all(not x[k].get("bad") for x in rounds), [x[k].get("bad") for x in rounds]
        out.append(got.pop())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("victims", ["every", "one"])
def test_sigkill_mid_local_save_restores_the_previous_step(s3_store, tmp_path, victims):
    """SIGKILL inside a local save (half its data file written, or all of it and half a manifest):
    of every process, or of one while the others complete theirs. That step is then not complete
    everywhere, so every process restarts from the local step before it, bit-exact. Trials chain:
    each restarted job trains on and is killed in the local save 10 steps later, so K trials take
    K + 1 jobs."""
    local = tmp_path / "local"
    expected = None
    completed = 0
    for trial in range(KILL_TRIALS + 1):
        kill_step = 15 + 10 * trial
        victims_now = [0, 1, 2, 3] if victims == "every" else [(trial + 1) % 4]
        kill = {
            "step": kill_step,
            "victims": victims_now,
            "point": ("data", "manifest")[(trial + len(victims_now)) % 2],
        }
        steps = 16 if trial == 0 else 15
        last = trial == KILL_TRIALS
        codes: list[int] = []
        restored: list[list[dict[str, Any]]] = []
        _launch(
            4,
            _job(s3_store, local, steps=1 if last else steps, kill=None if last else kill),
            codes=codes,
            restored=restored,
        )
        # every process restored the step before the torn one, from the local tier, bit-exact
        assert all(
            r == [{"start": expected, **({"tier": "local", "bad": []} if expected is not None else {})}]
            for r in restored
        ), restored
        if last:
            assert codes == [0, 0, 0, 0]
            break
        assert all(codes[p] == -signal.SIGKILL for p in victims_now), codes
        # a victim's step is a directory it was writing, never moved into place: no step there
        name = f"step_{kill_step:010d}"
        assert all(not (local / f"process_{p}" / name / RECORD).exists() for p in victims_now)
        assert all(any((local / f"process_{p}").glob(f".tmp-{name}-*")) for p in victims_now)
        # a survivor that ran to its end completed the step; JAX may stop the others first, once
        # its service hears of the victim's death (counted when they had completed it all the same)
        ran = [p for p in range(4) if p not in victims_now and codes[p] == 0]
        committed = [
            p
            for p in range(4)
            if p not in victims_now and (local / f"process_{p}" / f"step_{kill_step:010d}" / RECORD).exists()
        ]
        assert set(ran) <= set(committed), (ran, committed)
        completed += len(committed)
        expected = kill_step - 5
    assert victims == "every" or completed, "no survivor completed the torn step: the case was not exercised"


def _rounds(s3_store: Any, local: Path, **job: Any) -> list[tuple[Any, Any]]:
    """Round 0 trains steps 0..10 (local steps 5 and 10); then ``ROUNDS`` rounds of damage and restart."""
    results = _launch(4, _job(s3_store, local, first_steps=11, local_interval=5, rounds=ROUNDS + 1, **job))
    got = _restored(results)
    assert got[0] == (None, None)
    return got[1:]


@pytest.mark.slow
def test_one_local_tier_wiped_restores_from_the_peer_copy(s3_store, tmp_path):
    """Each round one process's whole local directory (its steps and the copies it keeps) is
    gone; the others hold the newest step, and the lost process's keeper sends it back through
    JAX's transfer server: local + peer, bit-exact. Then 5 more steps, each with a cross-process
    collective (gloo) while the local save's peer copy runs beside it in the background."""
    local = tmp_path / "local"
    results = _launch(
        4,
        _job(
            s3_store,
            local,
            first_steps=11,
            local_interval=5,
            rounds=ROUNDS + 1,
            steps=5,
            damage="wipe_one",
            peers=1,
            cpu_collectives="gloo",
            collective_steps=True,
        ),
    )
    got = _restored(results)
    assert got[1:] == [(10 + 5 * k, "peer") for k in range(ROUNDS)], got
    # The step brought back was written into the wiped process's own tier too (beside the next one)
    for k in range(1, ROUNDS + 1):
        victim, step = k % 4, 10 + 5 * (k - 1)
        assert results[victim]["rounds"][k]["local_steps"] == [step, step + 5], (k, results[victim]["rounds"][k])


@pytest.mark.slow
def test_all_local_tiers_wiped_restore_from_the_object_store(s3_store, tmp_path):
    got = _rounds(s3_store, tmp_path / "local", steps=5, damage="wipe_all", save_interval=5)
    assert got == [(10 + 5 * k, "store") for k in range(ROUNDS)], got


@pytest.mark.slow
def test_local_tiers_with_different_newest_steps_restore_the_newest_complete_everywhere(s3_store, tmp_path):
    """Each round one process loses its newest local step (the store has only step 0): every
    process restores the step before it, from the local tier, then trains 10 steps."""
    got = _rounds(s3_store, tmp_path / "local", steps=10, damage="drop_newest_one")
    assert got == [(5 + 5 * k, "local") for k in range(ROUNDS)], got


@pytest.mark.slow
def test_another_process_count_restores_from_the_object_store(s3_store, tmp_path):
    local = tmp_path / "local"
    job = _job(s3_store, local, steps=11, local_interval=5, save_interval=10)
    _restored(_launch(4, job))
    # each process's PerProcess value of 4 processes: all of them, to re-split (the store's rule)
    assert _restored(_launch(2, {**job, "steps": 1, "all_values": 4})) == [(10, "store")]


@pytest.mark.slow
def test_a_restart_onto_another_sharding_restores_from_the_local_tier(s3_store, tmp_path):
    """2 processes x 2 devices save ``w`` split over the devices and ``r`` replicated; the restart's
    target has ``w`` replicated (what Flax NNX's annotations say for a leaf ``nnx.jit`` left
    sharded) and ``r`` split. The store holds no step: the local tier serves it, bit for bit,
    each process reading its own boxes and the devices resharding."""
    job = _job(s3_store, tmp_path / "local", reshard=True, rounds=2, first_steps=6, steps=1, local_interval=5)
    results = _launch(2, job)
    assert _restored(results) == [(None, None), (5, "local")]
