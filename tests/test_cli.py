"""The ``objckpt`` command line, run as a subprocess against the local S3 and GCS servers.

Store settings reach the CLI the way they reach it on a workstation: through
the environment (``AWS_*`` for SeaweedFS, ``STORAGE_EMULATOR_HOST`` for
fake-gcs-server) or through flags.
"""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_bit_exact, full_manifest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.saving.live_markers import is_marker
from objckpt.storage import from_url
from objckpt.transfer import runtime

pytestmark = [pytest.mark.s3, pytest.mark.gcs]

_SCRIPT = Path(sys.executable).with_name("objckpt")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "objckpt.cli"]


@dataclass
class Run:
    rc: int
    out: str
    err: str


def _env(s3, gcs) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "OBJCKPT_"))}
    env.update(s3.env())
    env.update(gcs.env())
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONWARNINGS"] = "ignore"  # a library's import-time warning is not ours to assert on
    return env


@pytest.fixture(scope="module")
def env(s3_service, gcs_service):
    return _env(s3_service, gcs_service)


def cli(env, *args: str, timeout: float = 120) -> Run:
    done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return Run(done.returncode, done.stdout, done.stderr)


def _one_line_error(run: Run, rc: int = 1) -> str:
    assert run.rc == rc, run
    assert run.err.startswith("objckpt: error: ") and run.err.count("\n") == 1, run.err
    assert "Traceback" not in run.err
    return run.err


def _tree(seed=0):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    w = jax.device_put(
        jnp.arange(512 * 256, dtype=jnp.float32).reshape(512, 256) + seed, NamedSharding(mesh, P("x", "y"))
    )
    return {
        "params": {"w": w, "b": jnp.linspace(0, 1, 1000, dtype=jnp.bfloat16)},
        "opt": {"mu": np.arange(30000, dtype=np.int32)},
        "step": 100 + seed,
        "name": "run",
    }


SMALL_BLOBS = objckpt.Options(blob_size=128 * 1024)


@pytest.fixture(scope="module")
def saved(s3_service):
    """A plain checkpoint on S3: (url, tree)."""
    url = s3_service.url(f"cli-{uuid.uuid4().hex[:10]}/ckpt")
    tree = _tree()
    objckpt.save(url, tree, storage_options=s3_service.storage_options(), options=SMALL_BLOBS, metadata={"run": "a"})
    return url, tree


def _store(url, s3, gcs):
    return from_url(url, **(s3.storage_options() if url.startswith("s3://") else gcs.storage_options()))


def _blobs(url, s3, gcs) -> dict[str, int]:
    return {b.key: b.size for b in full_manifest(_store(url, s3, gcs)).blobs}


def _index_bytes(url, s3, gcs) -> int:
    """Bytes of the checkpoint's index objects (format v2: one per process)."""
    return sum(ref.size for ref in full_manifest(_store(url, s3, gcs)).indexes)


# ------------------------------------------------------------------------------------ basics


def test_help_version_and_usage_errors(env):
    run = cli(env, "--help")
    assert run.rc == 0 and all(c in run.out for c in ("ls", "inspect", "verify", "cp", "gc", "rm"))
    assert cli(env, "--version").out.startswith("objckpt ")
    assert cli(env).rc == 2  # no command
    assert cli(env, "cp", "s3://b/x").rc == 2  # no destination
    err = _one_line_error(cli(env, "ls", "/tmp/x", "--region", "us-east-1"), rc=2)
    assert "--region does not apply to file:// URLs" in err
    err = _one_line_error(cli(env, "ls", "s3://b/x", "-o", "novalue"), rc=2)
    assert "KEY=VALUE" in err


# ------------------------------------------------------------------------------- ls / gc / rm


def test_ls_gc_rm_on_a_manager_root(env, s3_service):
    root = s3_service.url(f"cli-{uuid.uuid4().hex[:10]}/run")
    so = s3_service.storage_options()
    with objckpt.CheckpointManager(root, storage_options=so) as manager:
        for step in (1, 2, 3):
            manager.save(step, _tree(step))
    store = from_url(root, **so)
    runtime.run_sync(store.delete("step_0000000003/manifest.json"))  # step 3 never committed
    runtime.run_sync(store.put("step_0000000002/ff/orphan.blob", b"x" * 100))  # a failed save's leftover
    listing = runtime.run_sync(store.list())

    run = cli(env, "ls", root)
    assert run.rc == 0, run
    lines = run.out.splitlines()
    assert lines[0].split() == ["STEP", "COMMITTED", "SIZE", "OBJECTS", "TIME"]
    assert [line.split()[:2] for line in lines[1:]] == [["1", "yes"], ["2", "yes"], ["3", "no"]]

    rows = json.loads(cli(env, "ls", root, "--json").out)
    assert [(r["step"], r["committed"]) for r in rows] == [(1, True), (2, True), (3, False)]
    for r in rows:
        objs = [o for o in listing if o.key.startswith(r["name"] + "/")]
        assert r["objects"] == len(objs) and r["bytes"] == sum(o.size for o in objs)
        assert r["url"] == f"{root}/{r['name']}" and r["time"].endswith("Z")

    # gc: young objects are safe by default; --dry-run deletes nothing
    run = cli(env, "gc", root)
    assert run.rc == 0 and "deleted 0 unreferenced object(s)" in run.out, run
    run = cli(env, "gc", root, "--grace-seconds", "0", "--dry-run")
    doomed = [line.split()[-1] for line in run.out.splitlines() if line.startswith("would delete ")]
    assert run.rc == 0 and f"{root}/step_0000000002/ff/orphan.blob" in doomed and len(doomed) >= 2
    assert all("step_0000000003/" in d or d.endswith("orphan.blob") for d in doomed)
    assert len(runtime.run_sync(store.list())) == len(listing)
    report = json.loads(cli(env, "gc", root, "--grace-seconds", "0", "--json").out)
    assert sorted(f"{root}/{k}" for k in report["keys"]) == sorted(doomed) and not report["dry_run"]
    assert [r["step"] for r in json.loads(cli(env, "ls", root, "--json").out)] == [1, 2]
    assert cli(env, "verify", f"{root}/step_0000000002").rc == 0

    # rm: a step goes (manifest first); the root with steps in it is refused
    run = cli(env, "rm", f"{root}/step_0000000001")
    assert run.rc == 0 and run.out.startswith(f"removed checkpoint {root}/step_0000000001"), run
    assert [r["step"] for r in json.loads(cli(env, "ls", root, "--json").out)] == [2]
    assert "holds other checkpoints" in _one_line_error(cli(env, "rm", root), rc=2)
    assert "nothing to remove" in _one_line_error(cli(env, "rm", f"{root}/step_0000000001"))
    runtime.run_sync(store.put("step_0000000009/aa/x.blob", b"123"))
    assert "pass --force" in _one_line_error(cli(env, "rm", f"{root}/step_0000000009"))
    run = cli(env, "rm", f"{root}/step_0000000009", "--force")
    assert run.rc == 0 and "uncommitted objects" in run.out
    assert cli(env, "ls", f"{root}/nothing-here").out.startswith("no checkpoints under")


def test_ls_a_prefix_of_plain_checkpoints(env, saved, gcs_service):
    url, tree = saved
    prefix = gcs_service.url(f"cli-{uuid.uuid4().hex[:10]}")
    objckpt.save(f"{prefix}/a", {"x": np.ones(3)}, storage_options=gcs_service.storage_options())
    objckpt.save(f"{prefix}/deeper/b", {"x": np.ones(3)}, storage_options=gcs_service.storage_options())
    run = cli(env, "ls", prefix)
    assert run.rc == 0, run
    assert [line.split()[:2] for line in run.out.splitlines()] == [
        ["CHECKPOINT", "COMMITTED"],
        ["a", "yes"],
        ["deeper/b", "yes"],
    ]
    parent = url.rsplit("/", 1)[0]
    assert [r["name"] for r in json.loads(cli(env, "ls", parent, "--json").out)] == ["ckpt"]


# ----------------------------------------------------------------------------- inspect / verify


def test_inspect_table_totals_metadata(env, saved):
    url, tree = saved
    run = cli(env, "inspect", url)
    assert run.rc == 0, run
    lines = run.out.splitlines()
    assert lines[0] == f"checkpoint {url}"
    assert lines[1].split() == ["LEAF", "DTYPE", "SHAPE", "SIZE", "SAVED", "SHARDING"]
    rows = {line.split()[0]: line for line in lines[2:] if line.startswith("[")}
    assert "float32" in rows["['params']['w']"] and "[512, 256]" in rows["['params']['w']"]
    assert "512.0 KiB" in rows["['params']['w']"] and "mesh(x=4,y=2) spec(x,y)" in rows["['params']['w']"]
    assert "bfloat16" in rows["['params']['b']"] and "host (numpy)" in rows["['opt']['mu']"]
    assert "= 100" in rows["['step']"] and "str" in rows["['name']"]
    assert any(line.startswith("total: 5 leaves") and "blobs" in line for line in lines)
    assert lines[-1] == 'metadata: {"run": "a"}'
    doc = json.loads(cli(env, "inspect", url, "--json").out)
    leaves = {leaf["path"]: leaf for leaf in doc["leaves"]}
    assert leaves["['params']['w']"]["shape"] == [512, 256] and leaves["['step']"]["value"] == 100
    assert doc["metadata"] == {"run": "a"} and doc["total_bytes"] == sum(x["nbytes"] for x in doc["leaves"])
    err = _one_line_error(cli(env, "inspect", url + "-missing"))
    assert f"no committed checkpoint at {url}-missing" in err


def test_verify_ok_then_every_problem_named(env, saved, s3_service, gcs_service):
    url, _ = saved
    run = cli(env, "verify", url)
    assert run.rc == 0 and run.out.startswith(f"verify {url}: OK;") and run.err == "", run

    copy_url = gcs_service.url(f"cli-{uuid.uuid4().hex[:10]}/damaged")
    assert cli(env, "cp", url, copy_url).rc == 0
    sizes = _blobs(copy_url, s3_service, gcs_service)
    flipped, short, gone = sorted(sizes, key=lambda k: (-sizes[k], k))[:3]  # big blobs: one leaf's pieces each
    store = _store(copy_url, s3_service, gcs_service)
    data = bytearray(runtime.run_sync(store.get(flipped)))
    manifest = full_manifest(store)
    piece = min((p for leaf in manifest.leaves for p in leaf.pieces if p.blob == flipped), key=lambda p: p.offset)
    data[piece.offset + piece.length // 2] ^= 0xFF  # inside the blob's first piece
    runtime.run_sync(store.put(flipped, bytes(data)))
    runtime.run_sync(store.put(short, runtime.run_sync(store.get(short))[:5]))
    runtime.run_sync(store.delete(gone))

    run = cli(env, "verify", copy_url)
    assert run.rc == 1, run
    problems = {line.split(":")[0]: line for line in run.out.splitlines() if line.startswith("PROBLEM ")}
    assert sorted(problems) == ["PROBLEM checksum", "PROBLEM missing", "PROBLEM short"], run.out
    assert problems["PROBLEM checksum"].startswith("PROBLEM checksum: checksum mismatch in leaf ['")
    assert f"{copy_url}/{flipped} bytes [{piece.offset}, " in problems["PROBLEM checksum"]
    assert problems["PROBLEM short"].startswith(f"PROBLEM short: short blob {copy_url}/{short}: 5 bytes")
    assert problems["PROBLEM missing"].startswith(f"PROBLEM missing: missing blob {copy_url}/{gone}")
    assert run.out.splitlines()[-1].startswith(f"verify {copy_url}: FAILED, 3 problem(s)")
    doc = json.loads(cli(env, "verify", copy_url, "--json").out)
    assert not doc["ok"] and sorted(p["kind"] for p in doc["problems"]) == ["checksum", "missing", "short"]


# ------------------------------------------------------------------------------------------- cp


def test_cp_s3_to_gcs_restores_bit_exact_and_refuses_a_committed_destination(env, saved, s3_service, gcs_service):
    url, tree = saved
    dst = gcs_service.url(f"cli-{uuid.uuid4().hex[:10]}/copy")
    run = cli(env, "cp", url, dst, "--json")
    assert run.rc == 0 and run.err == "", run
    stats = json.loads(run.out)
    blobs = _blobs(url, s3_service, gcs_service)
    assert stats["blobs_copied"] == len(blobs) and stats["bytes_copied"] == sum(blobs.values())
    assert stats["bytes_read"] == stats["bytes_copied"] + _index_bytes(url, s3_service, gcs_service)
    assert stats["blobs_skipped"] == 0
    restored = objckpt.restore(dst, tree, storage_options=gcs_service.storage_options())
    assert_tree_bit_exact(tree, restored)
    assert restored["params"]["w"].sharding == tree["params"]["w"].sharding

    before = runtime.run_sync(_store(dst, s3_service, gcs_service).get("manifest.json"))
    err = _one_line_error(cli(env, "cp", url, dst))
    assert f"a committed checkpoint already exists at {dst}" in err
    assert runtime.run_sync(_store(dst, s3_service, gcs_service).get("manifest.json")) == before
    err = _one_line_error(cli(env, "cp", url + "-missing", dst + "-2"))
    assert "no committed checkpoint" in err


def test_cp_killed_midway_then_rerun_copies_only_what_was_missing(env, s3_service, gcs_service):
    src = s3_service.url(f"cli-{uuid.uuid4().hex[:10]}/big")
    tree = {"w": np.arange(48 * 64 * 1024, dtype=np.int32).reshape(48, -1), "step": 1}  # 12 MiB
    objckpt.save(src, tree, storage_options=s3_service.storage_options(), options=objckpt.Options(blob_size=2**18))
    blobs = _blobs(src, s3_service, gcs_service)
    assert len(blobs) >= 48
    dst = gcs_service.url(f"cli-{uuid.uuid4().hex[:10]}/copy")
    store = _store(dst, s3_service, gcs_service)

    # one blob at a time, so the copy is caught midway
    child = subprocess.Popen(
        [*CLI, "cp", src, dst, "--concurrency", "1", "--memory-budget", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while len([o for o in runtime.run_sync(store.list()) if not is_marker(o.key)]) < 4:
            assert child.poll() is None, "the copy finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    time.sleep(0.3)  # let a PUT whose body was already sent land
    listed = runtime.run_sync(store.list())
    assert any(is_marker(o.key) for o in listed), "the copy's live-save marker, as a save's, until it commits"
    present = {o.key: o.size for o in listed if not is_marker(o.key)}
    assert "manifest.json" not in present
    assert 4 <= len(present) < len(blobs)
    assert "no committed checkpoint" in _one_line_error(cli(env, "inspect", dst))
    # one blob that did land is damaged (right size, wrong bytes): the rerun must notice
    damaged = sorted(present)[0]
    runtime.run_sync(store.put(damaged, b"\0" * present[damaged]))

    run = cli(env, "cp", src, dst, "--json")
    assert run.rc == 0, run
    stats = json.loads(run.out)
    missing = sum(size for key, size in blobs.items() if key not in present)
    assert stats["bytes_copied"] == missing + present[damaged]
    assert stats["bytes_read"] == stats["bytes_copied"] + _index_bytes(src, s3_service, gcs_service)
    assert stats["blobs_skipped"] == len(present) - 1 and stats["blobs_copied"] == len(blobs) - len(present) + 1
    assert cli(env, "verify", dst).rc == 0
    assert_tree_bit_exact(tree, objckpt.restore(dst, tree, storage_options=gcs_service.storage_options()))


def test_cp_store_flags_instead_of_environment(env, saved, s3_service, tmp_path):
    """Endpoint, region and keys from flags; the environment holds nothing for S3."""
    url, tree = saved
    bare = {k: v for k, v in env.items() if not k.startswith("AWS_")}
    flags = ["--src-endpoint-url", s3_service.endpoint_url, "--src-region", s3_service.region,
             "--src-option", f"key={s3_service.access_key}", "--src-option", f"secret={s3_service.secret_key}"]  # fmt: skip
    dst = str(tmp_path / "local-copy")
    run = cli(bare, "cp", url, dst, *flags)
    assert run.rc == 0, run
    assert s3_service.secret_key not in run.out + run.err
    assert_tree_bit_exact(tree, objckpt.restore(dst, tree))
    # and back from local disk to S3
    back = s3_service.url(f"cli-{uuid.uuid4().hex[:10]}/back")
    assert cli(env, "cp", dst, back).rc == 0
    assert cli(env, "verify", back).rc == 0


# ------------------------------------------------------------------------------- errors, secrets


def test_errors_are_one_line_without_credentials_unless_debug(env, saved, s3_service):
    url, _ = saved
    wrong = "WRONG" + uuid.uuid4().hex
    run = cli(env, "ls", url, "-o", f"secret={wrong}")
    err = _one_line_error(run)
    assert wrong not in err and s3_service.secret_key not in err and s3_service.access_key not in err
    run = cli(env, "ls", url, "-o", f"secret={wrong}", "--debug")
    assert run.rc != 0 and "Traceback" in run.err


# ----------------------------------------------------------------------------------- progress


def _under_pty(env, *args: str) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal: (exit status, stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    child = subprocess.Popen([*CLI, *args], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    shown = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    out = child.stdout.read().decode() if child.stdout else ""
    return child.wait(60), out, shown.decode(errors="replace")


def test_progress_bar_on_a_terminal_only(env, saved, gcs_service):
    url, _ = saved
    rc, out, shown = _under_pty(env, "verify", url)
    assert rc == 0 and out.startswith(f"verify {url}: OK")
    assert shown.startswith("\rverify:") and "100%|" in shown and "B/s" in shown, shown  # tqdm's bar
    dst = gcs_service.url(f"cli-{uuid.uuid4().hex[:10]}/pty")
    rc, out, shown = _under_pty(env, "cp", url, dst)
    assert rc == 0 and shown.startswith("\rcp:") and "100%|" in shown, shown
    rc, _, shown = _under_pty(env, "verify", url, "--no-progress")
    assert rc == 0 and shown == ""
    run = cli(env, "verify", url)  # stderr is a pipe: silent
    assert run.rc == 0 and run.err == ""
