"""Issue 77 (Hardening 5), items 24-27 and 29: what a new user meets first.

24: Ctrl-C during a synchronous save stops it promptly, aborts its uploads and leaves nothing
that ``objckpt rm --force URL`` does not remove. 25: every "no checkpoint" error names the
nearest steps, and ``export`` takes ``ROOT/30``. 26: the retention warning says how old a live
marker is. 27: inspect of a safetensors directory and of an incremental checkpoint; NNX names.
29: an abandoned replica copy leaves nothing once ``close()`` returns.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import objckpt
from objckpt.cli import main as cli_main
from objckpt.core.format import MANIFEST_KEY
from objckpt.manager.abandoned_copies import SETTLE_S
from objckpt.storage import from_url
from objckpt.storage.fsspec import posix
from objckpt.transfer import runtime

_SCRIPT = Path(sys.executable).with_name("objckpt")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "objckpt.cli"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=180, check=False)


def _keys(url: str, storage_options: dict | None) -> list[str]:
    store = from_url(url, **(storage_options or {}))
    return [o.key for o in runtime.run_sync(store.list())]


# ------------------------------------------------------------------ item 24: Ctrl-C during save

_SAVER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import jax, jax.numpy as jnp
    import objckpt
    from objckpt.transfer import runtime

    # Any thread of a process may take its SIGINT; here objckpt's I/O thread does, always.
    runtime.get_loop()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    url, options = sys.argv[1], json.loads(sys.argv[2])
    tree = {f"w{i}": jnp.full((16, 1024, 1024), i, jnp.float32) for i in range(8)}  # 512 MiB
    jax.block_until_ready(tree)
    said = []

    def progress(p):
        if not said and 64 << 20 <= p.done_bytes < p.total_bytes:
            said.append(1)
            print("uploading", flush=True)

    try:
        objckpt.save(url, tree, storage_options=options, progress=progress)
    except KeyboardInterrupt:
        print("save raised at", time.time(), file=sys.stderr, flush=True)
        raise
    print("committed", flush=True)
    """
)


@pytest.mark.serial  # a wall-clock bound: run alone, after the others (tests/run.sh)
@pytest.mark.parametrize("kind", ["s3", "local"])
def test_ctrl_c_stops_a_synchronous_save_and_rm_force_clears_it(kind, store_target_factory, s3_service):
    target = store_target_factory(kind)
    url = target.url if kind == "s3" else "file://" + target.url
    # One CPU device: the child's own teardown (JAX's) is not what is timed.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "XLA_FLAGS"))}
    env.update(s3_service.env())
    child = subprocess.Popen(
        [sys.executable, "-c", _SAVER, url, json.dumps(target.storage_options or {})],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "uploading\n", child.stderr
        child.send_signal(signal.SIGINT)
        signalled, at = time.monotonic(), time.time()
        _, err = child.communicate(timeout=60)
        seconds = time.monotonic() - signalled
    finally:
        child.kill()
    assert child.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, err
    raised = float(err.split("save raised at ")[1].split()[0]) - at
    assert seconds < 2.0, f"the child exited {seconds:.1f} s after SIGINT (save raised after {raised:.2f} s)"
    left = _keys(url, target.storage_options)
    assert "manifest.json" not in left, left
    if left:  # what the save could not delete in time (a write under way, the marker)
        removed = _cli("rm", "--force", url, env=env)
        assert removed.returncode == 0, removed.stderr
    assert _keys(url, target.storage_options) == []
    if kind == "s3":
        prefix = url.split("/", 3)[3]
        uploads = s3_service._boto_client().list_multipart_uploads(Bucket=s3_service.bucket, Prefix=prefix)
        assert uploads.get("Uploads", []) == []


# ------------------------------------------------------------------ item 25: step hints everywhere


def _root(url: str, storage_options: dict | None, steps: tuple[int, ...]) -> None:
    mgr = objckpt.CheckpointManager(url, storage_options=storage_options)
    for step in steps:
        mgr.save(step, {"w": np.arange(4, dtype=np.float32)}, force=True)
    mgr.wait()
    mgr.close()


def _not_found(call, *args, **kwargs) -> str:
    with pytest.raises(objckpt.CheckpointNotFoundError) as e:
        call(*args, **kwargs)
    return str(e.value)


@pytest.mark.s3
def test_restore_the_manager_and_export_name_the_steps_nearest_a_missing_one(
    s3_service, s3_store, tmp_path, monkeypatch, capsys
):
    url, so = s3_store.url, s3_store.storage_options
    _root(url, so, (10, 20, 30))
    near = (
        f"; the manager root {url} has no committed step 25: the steps nearest it are 10, 20, 30"
        f" (3 in all, the latest 30; try {url}/step_0000000030)"
    )
    for name in ("step_25", "25"):
        message = _not_found(objckpt.restore, f"{url}/{name}", storage_options=so)
        assert message == f"no committed checkpoint at {url}/{name} (no manifest.json){near}", message
    mgr = objckpt.CheckpointManager(url, storage_options=so)
    assert _not_found(mgr.restore, 25).endswith(near)
    mgr.close()
    # A misspelt step: the URL of the step meant.
    assert _not_found(objckpt.restore, f"{url}/stpe_30", storage_options=so).endswith(
        f"; the manager root {url} holds step 30 as {url}/step_0000000030"
    )
    for name, value in s3_service.env().items():
        monkeypatch.setenv(name, value)
    assert cli_main(["export", f"{url}/25", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.strip().endswith(near), err
    # export takes the short form that inspect, verify, cp and rm take
    assert cli_main(["export", f"{url}/30", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert f"exported {url}/step_0000000030 to" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors").exists()


# ------------------------------------------------------------------ item 26: a dead writer's marker


def test_retention_names_an_old_marker_of_another_save_as_maybe_a_dead_writers(local_store, caplog):
    from objckpt.saving.live_markers import marker_key

    url = f"file://{local_store.url}"
    mgr = objckpt.CheckpointManager(url, retention=objckpt.Retention(keep_last=1))
    mgr.save(1, {"x": np.arange(10)}, wait=True)
    # What a writer killed meanwhile leaves in the step (an incremental save marks its base too).
    marker = marker_key(uuid.uuid4().hex, 0)
    path = Path(local_store.url) / "step_0000000001" / marker
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    when = time.time() - 200  # two refresh intervals (120 s of the 600 s lease) and more
    os.utime(path, (when, when))
    with caplog.at_level(logging.WARNING, logger="objckpt"):
        mgr.save(2, {"x": np.arange(10) + 2}, wait=True)
    assert mgr.steps() == [1, 2]
    [warning] = [r.getMessage() for r in caplog.records if "retention left step 1" in r.getMessage()]
    step = f"{url}/step_0000000001"
    assert "a save is writing" not in warning, warning
    assert f"live-save marker {marker} is 200 s old, not rewritten since" in warning, warning
    assert "it may be a dead writer's" in warning and "lease (600 s)" in warning, warning
    assert f"`objckpt rm --force {step}` deletes it now" in warning, warning
    assert cli_main(["rm", "--force", step]) == 0
    mgr.save(3, {"x": np.arange(10) + 3}, wait=True)
    assert mgr.steps() == [3]
    mgr.close()


# ------------------------------------------------------------------ item 27: what inspect and export say


@pytest.mark.s3
def test_inspect_names_a_safetensors_directory_and_an_incremental_checkpoints_bases(
    s3_service, s3_store, monkeypatch, capsys
):
    url, so = s3_store.url, s3_store.storage_options
    digest = objckpt.Options(format_version=3, digest="sha256")
    tree = {"a": np.arange(64, dtype=np.float32), "b": np.ones(4096, np.float32)}
    objckpt.save(f"{url}/full", tree, storage_options=so, options=digest)
    tree["a"] = tree["a"] + 1
    objckpt.save(f"{url}/next", tree, storage_options=so, base=f"{url}/full")
    objckpt.export_safetensors(f"{url}/full", f"{url}/hf", src_storage_options=so)
    for name, value in s3_service.env().items():
        monkeypatch.setenv(name, value)

    assert cli_main(["inspect", f"{url}/hf"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"safetensors checkpoint {url}/hf\n"), out
    assert "written by safetensors" in out and "format v0" not in out and "save_id" not in out, out

    assert cli_main(["inspect", f"{url}/next"]) == 0
    out = capsys.readouterr().out
    assert "\nincremental: 256 B from its own blobs, 16.0 KiB from full\n" in out, out
    assert cli_main(["inspect", "--json", f"{url}/next"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_from"] == {"": 256, "full": 16384}


def test_an_nnx_state_exports_names_ending_in_value_and_the_documented_names_drops_it(tmp_path):
    from jax.tree_util import GetAttrKey, register_pytree_with_keys_class

    @register_pytree_with_keys_class
    class Variable:  # how flax.nnx.Variable flattens: its array under the attribute key `value`
        def __init__(self, value):
            self.value = value

        def tree_flatten_with_keys(self):
            return ((GetAttrKey("value"), self.value),), None

        def tree_flatten(self):
            return (self.value,), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    from safetensors.numpy import load_file

    state = {"linear": {"kernel": Variable(np.ones((2, 3), np.float32)), "bias": Variable(np.zeros(3, np.float32))}}
    objckpt.save(str(tmp_path / "ck"), state)
    objckpt.export_safetensors(str(tmp_path / "ck"), str(tmp_path / "as_is"))
    assert sorted(load_file(tmp_path / "as_is" / "model.safetensors")) == ["linear.bias.value", "linear.kernel.value"]
    doc = (Path(__file__).parents[1] / "docs" / "SAFETENSORS.md").read_text()
    [names] = re.findall(r"`names=(lambda name: [^`]+)` drops it", doc)  # the note on NNX names
    objckpt.export_safetensors(str(tmp_path / "ck"), str(tmp_path / "named"), names=eval(names))
    assert sorted(load_file(tmp_path / "named" / "model.safetensors")) == ["linear.bias", "linear.kernel"]


def test_the_readme_install_line_names_every_extra_it_advertises():
    import tomllib

    root = Path(__file__).parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    install = (root / "README.md").read_text().split("## Save and restore")[0]
    line = next(line for line in install.splitlines() if line.startswith("pip install -e"))
    for extra in set(extras) - {"dev", "bench"}:  # the user's extras; dev and bench are named below it
        assert extra in line, f"README's install line does not name the {extra!r} extra: {line}"


# ------------------------------------------------------------------ item 29: replicas


def _replica_disk(monkeypatch, under: Path, hold) -> dict[str, float]:
    """Writes of the local store under ``under`` go through ``hold(key)`` on their worker thread
    first (a slow disk); returns when each key's first write began and ended (time.monotonic)."""
    write = posix.write_inside
    seen: dict[str, float] = {}
    lock = threading.Lock()

    def slow_write(root: str, key: str, data, *, exclusive: bool) -> None:
        if not root.startswith(str(under)):
            return write(root, key, data, exclusive=exclusive)
        name = os.path.relpath(os.path.join(root, key), under)  # the key under the replica's root
        with lock:
            first = f"start {name}" not in seen
            if first:
                seen[f"start {name}"] = time.monotonic()
        if first:
            hold(name)
        write(root, key, data, exclusive=exclusive)
        if first:
            seen[f"end {name}"] = time.monotonic()

    monkeypatch.setattr(posix, "write_inside", slow_write)
    return seen


def test_an_abandoned_copys_write_landing_after_the_settling_time_is_deleted_before_close_returns(
    tmp_path, monkeypatch, caplog
):
    """Step 1's copy to b stops (the root deleted it) with one of its writes held on its thread
    for longer than SETTLE_S after the sweeps began: close() waits for that thread, then sweeps."""
    root, b = tmp_path / "root", tmp_path / "b"
    gate, held = threading.Event(), []

    def hold(key: str) -> None:
        if not held and key.endswith(".blob"):
            held.append(key)
            gate.wait(30)
        else:
            time.sleep(0.2)

    seen = _replica_disk(monkeypatch, b, hold)
    options = objckpt.Options(blob_size=16 * 1024, max_concurrency=4, read_window=64 * 1024)
    swept = lambda: any("abandoned copy of step 1" in r.getMessage() for r in caplog.records)  # noqa: E731
    state = lambda step, n=16 * 1024: {"w": np.arange(n, dtype=np.float32) * (step + 1)}  # noqa: E731
    try:
        with (
            caplog.at_level("INFO", logger="objckpt"),
            objckpt.CheckpointManager(
                str(root), retention=objckpt.Retention(keep_last=2), replicas=[str(b)], options=options
            ) as mgr,
        ):
            mgr.save(1, state(1, 96 * 1024), wait=True)  # 24 blobs: the copy to b takes seconds
            deadline = time.monotonic() + 60
            while not held:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            mgr.save(2, state(2), wait=True)
            mgr.save(3, state(3), wait=True)  # the root deletes step 1: the copy stops
            while not swept():
                assert time.monotonic() < deadline
                time.sleep(0.02)
            threading.Timer(SETTLE_S + 1.5, gate.set).start()  # lands after the settling time
    finally:
        gate.set()
    deadline = time.monotonic() + 30
    while f"end {held[0]}" not in seen:  # the held write has landed (before close returned, or after)
        assert time.monotonic() < deadline
        time.sleep(0.02)
    keys = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert [k for k in keys if k.startswith("step_0000000001")] == [], keys


def test_no_attempt_of_a_copy_runs_when_its_manifest_is_written(tmp_path, monkeypatch):
    """The first write of each index object at b takes longer than the request timeout: it is
    retried, and the retry lands first. The replica's manifest is written after the first
    attempt's thread returned, not while it still writes."""
    root, b = tmp_path / "root", tmp_path / "b"
    seen = _replica_disk(monkeypatch, b, lambda key: time.sleep(1.5 if key.endswith(".index") else 0))
    options = objckpt.Options(request_timeout=0.5)
    with objckpt.CheckpointManager(str(root), replicas=[str(b)], options=options) as mgr:
        mgr.save(1, {"w": np.arange(1000, dtype=np.float32)}, wait=True)
    deadline = time.monotonic() + 30
    while not any(k.startswith("end ") and k.endswith(".index") for k in seen):  # the first attempt's thread
        assert time.monotonic() < deadline
        time.sleep(0.02)
    [index] = [k.removeprefix("end ") for k in list(seen) if k.startswith("end ") and k.endswith(".index")]
    manifest = f"step_0000000001/{MANIFEST_KEY}"
    assert seen[f"start {manifest}"] >= seen[f"end {index}"], (seen, "the manifest began before the index landed")
    assert (b / manifest).exists()
