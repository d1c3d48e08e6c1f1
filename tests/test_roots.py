"""objckpt.roots: a manager root's step layout, listing, deletion and gc sweep, one home for the
manager, its replicas and the command line (checked here without JAX devices or a manager)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import numpy as np
import pytest

import objckpt
from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import SaveInProgressError
from objckpt.options import Options
from objckpt.roots.listing import committed_steps, group_checkpoints, root_steps
from objckpt.roots.orbax_steps import COMMIT_FILE, STEP_METADATA
from objckpt.roots.step_names import STEP_DIR, resolve_step_url, step_dir
from objckpt.roots.sweep import collect, delete_root
from objckpt.saving.live_markers import marker_key
from objckpt.storage.base import Store
from objckpt.transfer import runtime
from objckpt.transfer.retries import opened_store

TREE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, dtype=np.int32)}


@pytest.fixture
def root(local_store) -> Iterator[Store]:
    """A manager root on local disk with steps 1 and 20 committed (saved for real) and step 3 begun."""
    for step in (1, 20):
        objckpt.save(f"{local_store.url}/{step_dir(step)}", TREE)
    with opened_store(local_store.url, None, Options()) as store:
        runtime.run_sync(store.put(f"{step_dir(3)}/blobs/orphan", b"x" * 10))
        yield store


def _keys(store: Store) -> set[str]:
    return {o.key for o in runtime.run_sync(store.list())}


def _mark_live(store: Store, prefix: str) -> str:
    key = f"{prefix}/{marker_key('ab' * 8, 0)}"
    doc = {"key": key, "lease_seconds": 600, "written": time.time()}
    runtime.run_sync(store.put(key, json.dumps(doc).encode()))
    return key


def test_step_names_sort_as_numbers_and_parse_back() -> None:
    names = [step_dir(n) for n in (0, 7, 300, 10**10)]
    assert names[:3] == ["step_0000000000", "step_0000000007", "step_0000000300"]
    assert sorted(names) == names
    assert [int(STEP_DIR.match(n).group(1)) for n in names] == [0, 7, 300, 10**10]  # type: ignore[union-attr]
    assert STEP_DIR.match("step_300") is None and STEP_DIR.match("300") is None
    with pytest.raises(ValueError, match="step must be >= 0"):
        step_dir(-1)


def test_committed_steps_need_a_manifest_and_count_orbax_only_when_asked(root: Store) -> None:
    assert runtime.run_sync(committed_steps(root)) == [1, 20]
    assert root_steps(root.url) == [1, 20]
    runtime.run_sync(root.put(f"7/{STEP_METADATA}", b"{}"))  # an Orbax step on local disk: its metadata commits it
    runtime.run_sync(root.put("8/state/array", b"x"))  # an Orbax step without metadata is not one
    assert runtime.run_sync(committed_steps(root, orbax=True)) == [1, 7, 20]
    assert runtime.run_sync(committed_steps(root)) == [1, 20]


def test_a_step_named_the_short_way_resolves_only_when_nothing_is_at_the_literal_path(root: Store) -> None:
    base = root.url.rstrip("/")
    assert resolve_step_url(f"{base}/20") == f"{base}/{step_dir(20)}"
    assert resolve_step_url(f"{base}/step_1") == f"{base}/{step_dir(1)}"
    assert resolve_step_url(f"{base}/3") == f"{base}/{step_dir(3)}"  # uncommitted: rm --force may want it
    assert resolve_step_url(f"{base}/4") == f"{base}/4"  # no such step
    long = f"{base}/{step_dir(20)}"
    assert resolve_step_url(long) == long
    runtime.run_sync(root.put("20/_CHECKPOINT_METADATA", b"{}"))  # something at ROOT/20: it is what is meant
    assert resolve_step_url(f"{base}/20") == f"{base}/20"


def test_group_checkpoints_finds_steps_nested_checkpoints_and_orbax_but_no_markers(root: Store) -> None:
    _mark_live(root, step_dir(3))
    runtime.run_sync(root.put(f"9/{STEP_METADATA}", b"{}"))
    runtime.run_sync(root.put("9/state/_METADATA", b"{}"))
    found = {e.name: e for e in group_checkpoints(runtime.run_sync(root.list()), root.url)}
    assert sorted(found) == ["9", step_dir(1), step_dir(3), step_dir(20)]
    assert [found[step_dir(n)].committed for n in (1, 3, 20)] == [True, False, True]
    assert found[step_dir(3)].objects == 1, "a live-save marker was counted as an object of its step"
    assert (found["9"].format, found["9"].step, found["9"].committed) == ("orbax", 9, True)
    # In a bucket, an Orbax step is committed only by its commit file.
    listing = runtime.run_sync(root.list())
    assert not {e.name: e for e in group_checkpoints(listing, "s3://bucket/root")}["9"].committed
    runtime.run_sync(root.put(f"9/{COMMIT_FILE}", b""))
    listing = runtime.run_sync(root.list())
    assert {e.name: e for e in group_checkpoints(listing, "s3://bucket/root")}["9"].committed


def test_collect_sweeps_only_unreferenced_objects_and_a_dry_run_deletes_nothing(root: Store) -> None:
    before = _keys(root)
    found = runtime.run_sync(collect(root, grace=0, manifest_size_limit=1 << 20, dry_run=True))
    assert [o.key for o in found] == [f"{step_dir(3)}/blobs/orphan"]
    assert _keys(root) == before
    found = runtime.run_sync(collect(root, grace=3600, manifest_size_limit=1 << 20))
    assert found == [] and _keys(root) == before  # younger than the grace period
    runtime.run_sync(collect(root, grace=0, manifest_size_limit=1 << 20))
    assert _keys(root) == before - {f"{step_dir(3)}/blobs/orphan"}
    assert objckpt.restore(f"{root.url}/{step_dir(20)}")["b"].tolist() == [1] * 5


def test_collect_leaves_a_step_a_save_is_writing_into(root: Store) -> None:
    _mark_live(root, step_dir(3))
    assert runtime.run_sync(collect(root, grace=0, manifest_size_limit=1 << 20)) == []
    assert f"{step_dir(3)}/blobs/orphan" in _keys(root)


def test_delete_root_removes_manifests_first_then_everything(root: Store) -> None:
    objects = runtime.run_sync(root.list())
    manifests = runtime.run_sync(delete_root(root, objects))
    assert sorted(manifests) == [f"{step_dir(1)}/{MANIFEST_KEY}", f"{step_dir(20)}/{MANIFEST_KEY}"]
    assert _keys(root) == set()


def test_delete_root_refuses_a_save_in_flight_unless_forced(root: Store) -> None:
    marker = _mark_live(root, step_dir(3))
    before = _keys(root)
    with pytest.raises(SaveInProgressError, match="nothing removed"):
        runtime.run_sync(delete_root(root, runtime.run_sync(root.list())))
    assert _keys(root) == before
    runtime.run_sync(delete_root(root, runtime.run_sync(root.list()), force=True))
    assert marker not in _keys(root) and _keys(root) == set()
