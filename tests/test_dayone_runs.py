"""Whole runs on the command line (issue 52, item 6): ``cp ROOT DST``, ``rm --recursive ROOT``,
``gc`` refusing a step, and a step named ``ROOT/300`` or ``ROOT/step_300``.

Run in process against the local S3 server (through the environment, as a user's shell
sets it) and on ``file://``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

import objckpt
from objckpt.cli._main import main as cli_main
from objckpt.storage import from_url
from objckpt.transfer import runtime

KINDS = [pytest.param("s3", marks=pytest.mark.s3), "local"]
MARKER = "_live/0123abcd-p0"  # a live-save marker of some save


def _tree(step: int) -> dict[str, Any]:
    return {"w": np.arange(50_000, dtype=np.float32) + step, "n": np.arange(7, dtype=np.int32) * step}


@pytest.fixture
def target(request: pytest.FixtureRequest, store_target_factory: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``make()`` → (url, storage_options) of a fresh root of the test's kind; the CLI's
    environment points at the local S3 server."""
    kind = request.param
    if kind == "s3":
        s3 = request.getfixturevalue("s3_service")
        for name in [k for k in os.environ if k.startswith("AWS_")]:
            monkeypatch.delenv(name)
        for name, value in s3.env().items():
            monkeypatch.setenv(name, value)

    def make() -> tuple[str, dict[str, Any]]:
        t = store_target_factory(kind)
        url = t.url if kind == "s3" else f"file://{t.url}"
        return url, dict(t.storage_options or {})

    return make


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli_main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _root_with_steps(url: str, so: dict[str, Any]) -> None:
    """Steps 1 and 2 committed, step 3 uncommitted (its manifest gone: a save killed before it)."""
    with objckpt.CheckpointManager(url, storage_options=so) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _tree(step))
    runtime.run_sync(from_url(url, **so).delete("step_0000000003/manifest.json"))


def _listing(url: str, so: dict[str, Any]) -> dict[str, int]:
    return {o.key: o.size for o in runtime.run_sync(from_url(url, **so).list())}


def _assert_step(url: str, so: dict[str, Any], step: int) -> None:
    restored = objckpt.restore(url, storage_options=so)
    for name, want in _tree(step).items():
        assert np.asarray(restored[name]).tobytes() == want.tobytes(), (url, name)


@pytest.mark.parametrize("target", KINDS, indirect=True)
def test_cp_root_copies_every_committed_step_and_a_rerun_resumes(target, capsys):
    (src, so), (dst, dso), (some, _) = target(), target(), target()
    _root_with_steps(src, so)

    rc, out, err = _run(capsys, "cp", src, dst)
    assert rc == 0, err
    assert objckpt.CheckpointManager(dst, storage_options=dso).steps() == [1, 2]
    assert not any(k.startswith("step_0000000003/") for k in _listing(dst, dso)), "an uncommitted step was copied"
    for step in (1, 2):
        _assert_step(f"{dst}/step_{step:010d}", dso, step)
    assert "2 step(s) copied" in out

    before = _listing(dst, dso)
    rc, out, err = _run(capsys, "cp", src, dst, "--json")
    assert rc == 0, err
    assert [(r["step"], r["copied"]) for r in json.loads(out)] == [(1, False), (2, False)]
    assert _listing(dst, dso) == before

    # Cut off mid-step: step 2's manifest and one blob are missing; the rerun copies only the blob.
    blobs = [k for k in before if k.startswith("step_0000000002/") and k.endswith(".blob")]
    runtime.run_sync(from_url(dst, **dso).delete("step_0000000002/manifest.json"))
    runtime.run_sync(from_url(dst, **dso).delete(blobs[0]))
    rc, out, err = _run(capsys, "cp", src, dst, "--json")
    assert rc == 0, err
    rows = {r["step"]: r for r in json.loads(out)}
    assert not rows[1]["copied"] and rows[2]["copied"]
    assert rows[2]["method"] == ("server-side" if src.startswith("s3://") else "streamed"), rows[2]
    assert rows[2]["blobs_copied"] == 1 and rows[2]["blobs_skipped"] == len(blobs) - 1
    _assert_step(f"{dst}/step_0000000002", dso, 2)

    rc, out, err = _run(capsys, "cp", src, some, "--steps", "2")
    assert rc == 0, err
    assert objckpt.CheckpointManager(some, storage_options=_).steps() == [2]
    rc, out, err = _run(capsys, "cp", src, some, "--steps", "3")
    assert rc == 1 and "no committed step 3" in err, err


@pytest.mark.parametrize("target", KINDS, indirect=True)
def test_rm_root_needs_the_flag_and_respects_a_live_marker(target, capsys):
    root, so = target()
    _root_with_steps(root, so)
    before = _listing(root, so)

    rc, _, err = _run(capsys, "rm", root)
    assert rc == 2 and "--recursive" in err, err
    assert _listing(root, so) == before

    runtime.run_sync(from_url(root, **so).put(f"step_0000000002/{MARKER}", b"{}"))
    rc, _, err = _run(capsys, "rm", root, "--recursive")
    assert rc == 1 and MARKER in err and "nothing removed" in err, err
    assert len(_listing(root, so)) == len(before) + 1, "a save in flight lost objects"

    runtime.run_sync(from_url(root, **so).delete(f"step_0000000002/{MARKER}"))
    rc, out, err = _run(capsys, "rm", root, "-r")
    assert rc == 0, err
    assert "2 committed checkpoint(s)" in out
    assert _listing(root, so) == {}


@pytest.mark.parametrize("target", KINDS, indirect=True)
def test_gc_of_a_step_says_it_needs_a_root(target, capsys):
    root, so = target()
    _root_with_steps(root, so)
    for url in (f"{root}/step_0000000001", f"{root}/step_0000000003", f"{root}/2"):
        rc, _, err = _run(capsys, "gc", url)
        assert rc == 2 and "gc needs a manager root" in err, (url, err)
    rc, out, err = _run(capsys, "gc", root)
    assert rc == 0 and "deleted 0 unreferenced" in out, err


@pytest.mark.parametrize("target", KINDS, indirect=True)
def test_a_step_named_300_or_step_300_is_found(target, capsys):
    (root, so), (dst, dso) = target(), target()
    _root_with_steps(root, so)

    for name in ("1", "step_1", "step_01"):
        rc, out, err = _run(capsys, "inspect", f"{root}/{name}")
        assert rc == 0 and out.splitlines()[0].endswith("/step_0000000001"), (name, out, err)
    rc, out, err = _run(capsys, "verify", f"{root}/2")
    assert rc == 0 and "OK" in out.upper(), err
    rc, _, err = _run(capsys, "cp", f"{root}/step_2", dst)
    assert rc == 0, err
    _assert_step(dst, dso, 2)
    rc, out, err = _run(capsys, "rm", f"{root}/1")
    assert rc == 0 and "step_0000000001" in out, err
    assert objckpt.CheckpointManager(root, storage_options=so).steps() == [2]
    rc, _, err = _run(capsys, "inspect", f"{root}/9")
    assert rc == 1 and f"{root}/9" in err, err

    # A checkpoint stored at the literal path is the one meant, step directory or not.
    objckpt.save(f"{root}/2", _tree(20), storage_options=so)
    rc, out, err = _run(capsys, "inspect", f"{root}/2", "--json")
    assert rc == 0 and json.loads(out)["url"].endswith(f"{root.rpartition('/')[2]}/2"), out
