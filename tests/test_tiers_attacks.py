"""The local tier and peer copies under attack (issue 67): a damaged or edited manifest, another
job's ``local=`` directory, symbolic links leading out of the tier, a peer copy naming another
process. Each is refused, and a restart takes the next location (the object store) with a log
line; nothing outside the tier is written or deleted.

The manager tests run one process of 8 CPU devices against the local S3 server, and edit the
local tier's files the way a damaged disk, a reused directory or an attacker would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.core.checksum import crc32c
from objckpt.core.format.local import RECORD
from objckpt.errors import FormatError, PartialCopyError, StoreError
from objckpt.locations.local_dirs import ForeignStepError, LocalDir, check_record, write_step
from objckpt.peers.copies import payload_of
from objckpt.restoring.api import restore_copy
from objckpt.roots.step_names import step_dir
from objckpt.roots.sweep import delete_objects
from objckpt.saving.local_snapshot import snapshot
from objckpt.transfer import runtime
from objckpt.transfer.retries import opened_store
from tests.multiprocess import run_processes

WORKER = Path(__file__).with_name("tiers_worker.py")

URL = "s3://bucket/root"
KEY = b"k" * 32  # run1's key, as a manager keeps it in its root (objckpt.locations.run_keys)


def _mesh() -> Any:
    return jax.make_mesh((4, 2), ("a", "b"))


def _tree(step: int) -> dict[str, Any]:
    """``v``: 16 values over 8 devices, boxes starting at 0, 2, 4, ... 14."""
    v = np.arange(16, dtype=np.float32) * 10 + step
    return {
        "v": jax.make_array_from_callback(v.shape, NamedSharding(_mesh(), P(("a", "b"))), lambda i: v[i]),
        "config": objckpt.Json({"lr": 0.5, "step": step}),
        "n": step,
    }


def _target() -> dict[str, Any]:
    """A replicated target: every device needs all 16 values, assembled from the 8 saved boxes."""
    return {
        "v": jax.ShapeDtypeStruct((16,), np.float32, sharding=NamedSharding(_mesh(), P())),
        "config": objckpt.Json(),
        "n": 0,
    }


def _manager(s3_store: Any, local: Path, url: str | None = None) -> objckpt.CheckpointManager:
    return objckpt.CheckpointManager(
        url or s3_store.url,
        storage_options=s3_store.storage_options,
        save_rules=objckpt.SavePolicy(save_interval_steps=10),
        local=objckpt.LocalCopies(local, interval_steps=10),
    )


def _saved(s3_store: Any, local: Path, steps: range, url: str | None = None) -> None:
    mgr = _manager(s3_store, local, url)
    for step in steps:
        mgr.save(step, _tree(step))
    mgr.wait()
    mgr.close()


def _edit_manifest(step: Path, old: bytes, new: bytes, *, reseal: bool) -> None:
    """Replace ``old`` (found once) by ``new`` in a local step's ``manifest.json``; ``reseal``: make
    the record pin the edit (its SHA-256, then the record's crc32c), as someone who can write the
    local disk would (a damaged disk does not); the MAC under the run's key, which lives in the
    root, stays as it was."""
    manifest = (step / "manifest.json").read_bytes()
    assert manifest.count(old) == 1, (old, manifest[:300])
    manifest = manifest.replace(old, new)
    (step / "manifest.json").write_bytes(manifest)
    if reseal:
        sealed = re.match(
            rb'\{"crc32c":(\d+),("mac":"[0-9a-f]+",)"record":(.*)\}\Z', (step / RECORD).read_bytes(), re.DOTALL
        )
        assert sealed is not None
        doc = json.loads(sealed.group(3))
        doc["manifest"] = {"size": len(manifest), "sha256": hashlib.sha256(manifest).hexdigest()}
        body = json.dumps(doc, separators=(",", ":")).encode()
        (step / RECORD).write_bytes(b'{"crc32c":%d,%s"record":%s}' % (crc32c(body), sealed.group(2), body))


def _flip(path: Path, at: int) -> None:
    """One bit of ``path`` flipped, at byte ``at`` (negative: from the end)."""
    raw = bytearray(path.read_bytes())
    raw[at] ^= 1
    path.write_bytes(bytes(raw))


def _restored_from(mgr: objckpt.CheckpointManager, step: int) -> str:
    """Restore the latest step; check it bit for bit against ``step``'s tree; the tier it came from."""
    out = mgr.restore(None, _target())
    assert np.asarray(out["v"]).tobytes() == np.asarray(_tree(step)["v"]).tobytes()
    assert (out["config"], out["n"]) == ({"lr": 0.5, "step": step}, step)
    return mgr.tier_status().last_restore.tier  # type: ignore[union-attr]


@pytest.mark.parametrize("where", ["manifest", "index", "blob"])
def test_a_flipped_bit_in_a_local_step_restores_from_the_object_store(s3_store, tmp_path, caplog, where):
    """One flipped bit anywhere in a local step: in its manifest (the record no longer pins it: not
    a step), in its index object (the manifest's crc32c of it refuses it) or in a piece of a blob
    (the piece's crc32c, over every re-read). Either way the step is not read from the local
    tier, and the store serves it bit for bit."""
    local = tmp_path / "local"
    _saved(s3_store, local, range(11))
    step = local / "process_0" / step_dir(10)
    if where == "manifest":
        _flip(step / "manifest.json", (step / "manifest.json").read_bytes().index(b'"lr":0.5') + 5)  # 0.5 -> 0.4
    else:
        [path] = step.rglob(f"*.{where}")
        value = np.float32(_tree(10)["n"] * 10 + 10).tobytes()  # v[1] of step 10, in a piece of the blob
        _flip(path, 20 if where == "index" else path.read_bytes().index(value))  # inside the index's head
    mgr = _manager(s3_store, local)
    with caplog.at_level("WARNING", logger="objckpt"):
        assert _restored_from(mgr, 10) == "store"
    expected = {
        "manifest": "not a usable step",
        "index": "not restored from the local tier",
        "blob": "ChecksumMismatch",
    }
    assert expected[where] in caplog.text
    mgr.close()


@pytest.mark.parametrize("start", [0, 1], ids=["box-named-twice", "boxes-overlap"])
def test_overlapping_boxes_are_refused_even_in_a_step_sealed_under_its_key(tmp_path, start):
    """Two boxes of a leaf claiming one slice (a box start 2 -> 0: the same box twice; 2 -> 1:
    two boxes that overlap), written with every checksum consistent and the record sealed under
    the run's key: the index reader refuses a box named twice, the one restore the overlap (a
    restore onto a replicated target would count a slice twice and leave another unwritten)."""
    tier = LocalDir(tmp_path, 0, 1, keep_last=2, url=URL, key_of={"run1": KEY}.get)
    snap = snapshot(_tree(1), root=URL, step=1, save_id="run1", process_index=0, process_count=1, metadata={})
    v = next(i for i, e in enumerate(snap.entries) if e.path == "['v']")
    moved = next(k for k, p in enumerate(snap.pieces) if p.leaf == v and p.start == (2,))
    piece = snap.pieces[moved]
    snap.pieces[moved] = dataclasses.replace(
        piece, start=(start,), stop=(start + 2,), source=(piece.source[0], (start,))
    )
    if start == 0:  # the save reads its index objects back as a reader does: never committed
        with pytest.raises(StoreError, match="would not read back.*both name leaf"):
            tier.write(snap)
        assert tier.steps() == {}
        return
    tier.write(snap)
    with pytest.raises(PartialCopyError, match="its pieces there overlap"):
        restore_copy(tier.open(tier.step_dir(1), tier.steps()[1]), _target())


@pytest.mark.parametrize("reseal", [False, True], ids=["edited", "edited-and-resealed"])
def test_an_edited_json_value_in_a_local_manifest_is_refused(s3_store, tmp_path, caplog, reseal):
    """A ``Json`` value 0.5 -> 0.7 in the step's manifest: its record (which pins the manifest's
    SHA-256) refuses it; with the record made to pin the edit, the MAC under the run's key (which
    lives in the root, not on the local disk) does."""
    local = tmp_path / "local"
    _saved(s3_store, local, range(11))
    _edit_manifest(local / "process_0" / step_dir(10), b'"lr":0.5', b'"lr":0.7', reseal=reseal)
    mgr = _manager(s3_store, local)
    with caplog.at_level("WARNING", logger="objckpt"):
        assert _restored_from(mgr, 10) == "store"
    assert ("not sealed under its run's key" if reseal else "not the one it pins") in caplog.text
    mgr.close()


def test_a_new_job_on_a_used_local_directory_never_resumes_the_other_jobs_state(s3_store, tmp_path):
    """Job A (its own root) leaves steps 10 and 20 in ``local=``; job B, with a fresh root and the
    same ``local=``, sees no step there and saves its own; job A's steps stay A's."""
    local = tmp_path / "local"
    root_a, root_b = f"{s3_store.url}/job-a", f"{s3_store.url}/job-b"
    _saved(s3_store, local, range(21), url=root_a)
    mgr = _manager(s3_store, local, root_b)
    assert mgr.latest_step() is None
    assert mgr.tier_status().local_steps == []
    with pytest.raises(objckpt.CheckpointNotFoundError):
        mgr.restore(None, _target())
    mgr.save(5, _tree(5), force=True)  # B's own step: its retention leaves A's alone
    mgr.wait()
    mgr.close()
    mgr = _manager(s3_store, local, root_a)
    assert mgr.latest_step() == 20
    assert _restored_from(mgr, 20) == "local"
    mgr.close()


def test_a_root_wiped_and_reused_never_resumes_the_old_local_steps(s3_store, tmp_path):
    """The same root URL, emptied (``objckpt rm --recursive``) and used by a new job with the same
    ``local=``: the old run's key went with the root, so its local steps are not this root's."""
    local = tmp_path / "local"
    _saved(s3_store, local, range(21))
    with opened_store(s3_store.url, s3_store.storage_options, objckpt.Options()) as store:
        keys = [o.key for o in runtime.run_sync(store.list())]
        assert any(k.startswith("local_tier/") for k in keys), keys  # the run's key, in the root
        runtime.run_sync(delete_objects(store, keys))
    mgr = _manager(s3_store, local)
    assert mgr.latest_step() is None and mgr.tier_status().local_steps == []
    mgr.close()


def _outside(tmp_path: Path) -> Path:
    """A directory outside the tier with a file and a subdirectory that must survive."""
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "keep.txt").write_bytes(b"precious")
    (outside / "sub" / "x").write_bytes(b"also precious")
    return outside


def _untouched(outside: Path) -> bool:
    return sorted(p.relative_to(outside).as_posix() for p in outside.rglob("*")) == ["keep.txt", "sub", "sub/x"]


def test_a_symlinked_step_directory_is_never_written_or_emptied(s3_store, tmp_path, caplog):
    """``process_0/step_N`` linked to a directory outside the tier: saving step N locally is refused
    (StorePermissionError naming the path, a warning: the store's save goes on), and nothing there
    is written or deleted."""
    local, outside = tmp_path / "local", _outside(tmp_path)
    (local / "process_0").mkdir(parents=True)
    (local / "process_0" / step_dir(10)).symlink_to(outside, target_is_directory=True)
    mgr = _manager(s3_store, local)
    with caplog.at_level("WARNING", logger="objckpt"):
        for step in range(11):
            mgr.save(step, _tree(step))
        mgr.wait()
    assert re.search(rf"step 10 not saved locally.*{step_dir(10)} resolves to .*outside", caplog.text)
    assert mgr.steps() == [0, 10]
    mgr.close()
    assert _untouched(outside)


def test_a_symlinked_process_directory_is_never_written_or_emptied(s3_store, tmp_path, caplog):
    local, outside = tmp_path / "local", _outside(tmp_path)
    local.mkdir()
    (local / "process_0").symlink_to(outside, target_is_directory=True)
    mgr = _manager(s3_store, local)
    with caplog.at_level("WARNING", logger="objckpt"):
        mgr.save(0, _tree(0))
        mgr.wait()
    assert re.search("step 0 not saved locally.*outside", caplog.text)
    mgr.close()
    assert _untouched(outside)


def test_a_data_file_linked_out_of_the_tier_is_never_read(s3_store, tmp_path, caplog):
    """A step's blob replaced by a link to a file outside the tier (its very bytes): the link is
    not followed (the blob is missing to the restore), and the store serves the step."""
    local = tmp_path / "local"
    _saved(s3_store, local, range(11))
    directory = local / "process_0" / step_dir(10)
    [data] = directory.rglob("*.blob")
    moved = tmp_path / "elsewhere.blob"
    data.rename(moved)
    data.symlink_to(moved)
    mgr = _manager(s3_store, local)
    with caplog.at_level("WARNING", logger="objckpt"):
        assert _restored_from(mgr, 10) == "store"
    assert "not restored from the local tier" in caplog.text and "does not exist" in caplog.text
    mgr.close()


def test_a_peer_copy_naming_another_process_or_root_is_not_held(tmp_path):
    """Process 0 keeps process 1's copies under ``peer/process_1/``: a step there whose record
    names process 0 (or another root) is not process 1's copy, is not offered, and is not sent."""
    tier = LocalDir(tmp_path, 0, 2, keep_last=2, url=URL, key_of={"run1": KEY}.get)
    mine = dict(save_id="run1", process_count=2, metadata={})
    good = snapshot(_tree(3), root=URL, step=3, process_index=1, **mine)  # type: ignore[arg-type]
    write_step(tier.held_dir(1) / step_dir(3), good, key=KEY, options=objckpt.Options())
    forged = snapshot(_tree(4), root=URL, step=4, process_index=0, **mine)  # type: ignore[arg-type]
    write_step(tier.held_dir(1) / step_dir(4), forged, key=KEY, options=objckpt.Options())
    other = snapshot(_tree(5), root="s3://bucket/other", step=5, process_index=1, **mine)  # type: ignore[arg-type]
    write_step(tier.held_dir(1) / step_dir(5), other, key=KEY, options=objckpt.Options())
    unkeyed = snapshot(_tree(6), root=URL, step=6, process_index=1, **mine)  # type: ignore[arg-type]
    write_step(tier.held_dir(1) / step_dir(6), unkeyed, key=b"x" * 32, options=objckpt.Options())  # not the run's key
    assert {o: sorted(s) for o, s in tier.held().items()} == {1: [3]}
    assert len(payload_of(tier, tier.held_dir(1) / step_dir(3), 1)) >= 4  # its files, then the table
    with pytest.raises(FormatError, match="not sealed under its run's key"):
        payload_of(tier, tier.held_dir(1) / step_dir(6), 1)
    for step in (4, 5):
        with pytest.raises(ForeignStepError):
            payload_of(tier, tier.held_dir(1) / step_dir(step), 1)
    with pytest.raises(FormatError, match="process 0's step, not process 1's"):
        check_record(
            (tier.held_dir(1) / step_dir(4) / RECORD).read_bytes(), "from process 0", root=URL, process_index=1
        )
    tier.retain()  # not this manager's to delete
    assert (tier.held_dir(1) / step_dir(4) / RECORD).exists()


# ---------------------------------------------------------------------------- 2 processes


@pytest.mark.slow
def test_a_forged_peer_copy_is_never_restored_and_the_store_serves_the_step(s3_store, tmp_path):
    """A real 2-process job, peers=1: process 1's local directory wiped, and the copy of its newest
    step that process 0 keeps edited (a ``Json`` value 0.5 -> 0.7, the crc32c recomputed). The
    forged copy is not offered; the restart restores that step from the object store, bit for bit."""
    job = {
        "url": s3_store.url,
        "storage_options": s3_store.storage_options,
        "local": str(tmp_path / "local"),
        "local_interval": 5,
        "save_interval": 5,
        "peers": 1,
        "first_steps": 11,
        "steps": 1,
        "rounds": 2,
        "damage": "forge_peer",
    }
    outs: list[str] = []
    results = run_processes(
        2, job, timeout=150, devices_per_process=2, stdout=outs, worker=WORKER, env_prefix="OBJCKPT_TIERS"
    )
    assert all(r is not None for r in results), outs
    rounds = [r["rounds"] for r in results]  # type: ignore[index]
    assert [x[1]["start"] for x in rounds] == [10, 10] and [x[1]["tier"] for x in rounds] == ["store", "store"], rounds
    assert not any(x[1]["bad"] for x in rounds), rounds


# ---------------------------------------------------------------------------- 2 processes, one killed


@pytest.mark.slow
def test_a_killed_peer_ends_the_survivors_save_with_a_coordination_error_naming_it(s3_store, tmp_path):
    """2 processes, peers=1, local saves every step; process 1 dies (SIGKILL) before step 3. The
    survivor's next saves or its wait end within 60 s with a CoordinationError naming process 1
    (objckpt's barrier timeout is its default, 300 s; JAX's heartbeat timeout is its default, 100 s,
    after which JAX stops the survivor itself)."""
    job = {
        "url": s3_store.url,
        "storage_options": s3_store.storage_options,
        "local": str(tmp_path / "local"),
        "local_interval": 1,
        "peers": 1,
        "barrier_timeout": 300,
        "heartbeat": 100,
        "save_interval": 2,
        "first_steps": 6,
        "die": {"process": 1, "step": 3, "steps": 3},
    }
    outs: list[str] = []
    run_processes(2, job, timeout=170, devices_per_process=2, stdout=outs, worker=WORKER, env_prefix="OBJCKPT_TIERS")
    lines = [line for line in outs[0].splitlines() if line.startswith("SURVIVOR ")]
    assert lines, f"the survivor printed no outcome: {outs[0][-2000:]}"
    outcome = json.loads(lines[0][len("SURVIVOR ") :])
    assert outcome["error"] == "CoordinationError", outcome
    assert re.search(r"process(es)?\b[^.]*\b1\b", outcome["message"]), outcome["message"]
    assert outcome["seconds"] < 60, outcome
    print("survivor:", outcome["error"], f"{outcome['seconds']:.1f} s after the kill")
    mgr = objckpt.CheckpointManager(s3_store.url, storage_options=s3_store.storage_options)
    assert mgr.steps(), "no step was committed before the kill"
    for step in mgr.steps():  # every step committed before the kill restores exactly (tests/tiers_worker.py's state)
        target = {"w": np.zeros((32, 64), np.float32), "step": 0, "data": objckpt.PerProcess(all=True)}
        out = mgr.restore(step, target, partial=True)
        want = np.arange(32 * 64, dtype=np.float32).reshape(32, 64) + (step + 1)
        assert np.asarray(out["w"]).tobytes() == want.tobytes() and out["step"] == step
    mgr.close()
