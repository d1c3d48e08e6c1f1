"""Issue 77 ("Hardening 5"), items 12 and 13, and two bugs of issue 78: what deleters and tools
read of an incremental root.

Item 12: ``gc`` and a deletion read each committed step's root and, where it matters, its index
objects' heads (never their frames); a deletion reads further only the steps whose root names
the deleted one, and lists the root one level (not every object under it). Item 13: ``cp``
refuses an index head that lists a base's blob no row uses. Issue 78: ``verify --no-read`` of an
incremental step finds its bases' blobs; ``ls`` and ``rm`` say that a base whose manifest went
keeps the blobs later steps reference, and ``rm --force`` does not claim to remove them.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

import objckpt
from objckpt.cli import main
from objckpt.core.checksum import crc32c, sha256_hex
from objckpt.core.format.index3 import MAGIC
from objckpt.errors import FormatError
from objckpt.roots.sweep import delete_checkpoint, unreferenced_objects
from objckpt.transfer import runtime

LEAF = 64 << 10
ONE, TWO, THREE = "step_0000000001", "step_0000000002", "step_0000000003"


def _tree() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"w{i}": rng.standard_normal(LEAF // 4).astype(np.float32) for i in range(8)}


def _chain(target: Any, steps: int, **kw: Any) -> dict[str, np.ndarray]:
    """``steps`` incremental steps: each changes ``w0`` only, so each names step 1 (and no other) as its base."""
    tree = _tree()
    with objckpt.CheckpointManager(target.url, storage_options=target.storage_options, incremental=True, **kw) as m:
        for step in range(1, steps + 1):
            tree["w0"] = tree["w0"] + 1
            m.save(step, tree, force=True, wait=True)
    return tree


def _record(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any, Any]]:
    """Every ranged GET (url/key, start, end) and listing (url, prefix) of ``store``'s class."""
    seen: list[tuple[str, Any, Any]] = []
    cls = type(store)
    get_range, listing = cls.get_range, cls.list

    async def recorded_get(self: Any, key: str, *, start: int, end: int) -> bytes:
        seen.append((f"{self.url}/{key}", start, end))
        return await get_range(self, key, start=start, end=end)

    async def recorded_list(self: Any, prefix: str = "") -> Any:
        seen.append(("LIST " + self.url, prefix, None))
        return await listing(self, prefix)

    monkeypatch.setattr(cls, "get_range", recorded_get)
    monkeypatch.setattr(cls, "list", recorded_list)
    return seen


def _heads(store: Any) -> dict[str, int]:
    """Each index object's URL and its head's length, from the steps' roots."""
    out = {}
    for o in runtime.run_sync(store.list()):
        if o.key.endswith("/manifest.json"):
            step = o.key.partition("/")[0]
            for ref in json.loads(runtime.run_sync(store.get(o.key)))["indexes"]:
                out[f"{store.url}/{step}/{ref['key']}"] = ref["head"]
    return out


# ----------------------------------------------------------------------------- item 12


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_gc_reads_index_heads_only(kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    target = request.getfixturevalue(f"{kind}_store")
    _chain(target, 4)
    store = target.open()
    heads = _heads(store)
    seen = _record(store, monkeypatch)
    found = runtime.run_sync(
        unreferenced_objects(store, grace=0, manifest_size_limit=objckpt.Options.manifest_size_limit)
    )
    assert found == []
    index_reads = [(url, end) for url, _, end in seen if url in heads]
    assert len(index_reads) == len(heads), index_reads  # each index object once, its head alone
    assert all(end <= heads[url] for url, end in index_reads), index_reads


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_delete_reads_only_the_steps_that_name_it(
    kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = request.getfixturevalue(f"{kind}_store")
    tree = _chain(target, 4)
    store = target.open()
    heads = _heads(store)
    seen = _record(store, monkeypatch)
    runtime.run_sync(delete_checkpoint(store.child(THREE)))  # steps 2 and 4 name step 1 only
    assert not [url for url, _, _ in seen if url in heads and f"/{THREE}/" not in url], seen
    assert not [s for s in seen if s[0] == f"LIST {store.url}" and not s[1]], "the root was listed recursively"
    monkeypatch.undo()
    assert not runtime.run_sync(store.list(f"{THREE}/"))
    # Step 1, which every step names: its blobs stay, step 4 restores, gc keeps them.
    runtime.run_sync(delete_checkpoint(store.child(ONE)))
    assert runtime.run_sync(store.list(f"{ONE}/"))
    assert not runtime.run_sync(unreferenced_objects(store, grace=0, manifest_size_limit=1 << 30))
    got = objckpt.restore(f"{target.url}/step_0000000004", storage_options=target.storage_options)
    assert all(np.array_equal(got[k], tree[k]) for k in tree)


def test_a_base_named_through_json_escapes_keeps_its_blobs(local_store: Any) -> None:
    """A root may spell a base's name with ``\\u`` escapes (valid JSON, read as the same name):
    a deleter that looks for the name's bytes must still find it."""
    tree = _chain(local_store, 2)
    store = local_store.open()
    root = runtime.run_sync(store.get(f"{TWO}/manifest.json"))
    escaped = root.replace(f'"name":"{ONE}"'.encode(), b'"name":"step\\u005f0000000001"')
    assert escaped != root
    runtime.run_sync(store.put(f"{TWO}/manifest.json", escaped))
    runtime.run_sync(delete_checkpoint(store.child(ONE)))
    got = objckpt.restore(f"{local_store.url}/{TWO}")
    assert all(np.array_equal(got[k], tree[k]) for k in tree)


# ----------------------------------------------------------------------------- item 13


def _list_extra_blob(store: Any, step: str, extra: str, size: int) -> None:
    """Rewrite ``step``'s index head to list blob ``extra`` (of ``size`` bytes) that no row uses,
    and its root to pin the new head: a crafted but checksum-consistent checkpoint."""
    root = json.loads(runtime.run_sync(store.get(f"{step}/manifest.json")))
    ref = root["indexes"][0]
    data = runtime.run_sync(store.get(f"{step}/{ref['key']}"))
    (length,) = struct.unpack_from("<I", data, len(MAGIC))
    prefix = len(MAGIC) + 4
    doc = json.loads(data[prefix : prefix + length])
    doc["blobs"].append([extra, size])
    frames, delta = doc["frames"], 0
    for _ in range(8):  # the frames' offsets move with the head's length
        doc["frames"] = [[f[0], f[1], f[2] + delta, *f[3:]] for f in frames]
        text = json.dumps(doc, separators=(",", ":")).encode()
        if prefix + len(text) - ref["head"] == delta:
            break
        delta = prefix + len(text) - ref["head"]
    head = MAGIC + struct.pack("<I", len(text)) + text
    body = head + data[ref["head"] :]
    runtime.run_sync(store.put(f"{step}/{ref['key']}", body))
    ref.update(size=len(body), crc32c=crc32c(head), sha256=sha256_hex(head), head=len(head))
    ref.update(blobs=ref["blobs"] + 1, blob_bytes=ref["blob_bytes"] + size)
    runtime.run_sync(store.put(f"{step}/manifest.json", json.dumps(root).encode()))


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_cp_refuses_a_listed_reference_no_row_uses(kind: str, request: pytest.FixtureRequest) -> None:
    target = request.getfixturevalue(f"{kind}_store")
    so = target.storage_options
    _chain(target, 2)
    store = target.open()
    save_id = json.loads(runtime.run_sync(store.get(f"{ONE}/manifest.json")))["save_id"]
    neighbour = f"ab/{save_id}-p0-000099.blob"  # another object in the base's prefix, named as its blob
    secret = b"a neighbour's bytes" * 10
    runtime.run_sync(store.put(f"{ONE}/{neighbour}", secret))
    _list_extra_blob(store, TWO, f"../{ONE}/{neighbour}", len(secret))
    with pytest.raises(
        FormatError, match=r"lists the base's blob \.\./step_0000000001/ab/\w+-p0-000099\.blob, which no row uses"
    ):
        objckpt.copy(f"{target.url}/{TWO}", f"{target.url}-copy/{TWO}", src_storage_options=so, dst_storage_options=so)
    copied = target.open().parent().child(target.url.rpartition("/")[2] + "-copy")  # type: ignore[union-attr]
    assert not runtime.run_sync(copied.list())


# ----------------------------------------------------------------------------- issue 78


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_verify_without_reading_finds_the_bases_blobs(kind: str, request: pytest.FixtureRequest) -> None:
    target = request.getfixturevalue(f"{kind}_store")
    _chain(target, 2)
    report = objckpt.verify(f"{target.url}/{TWO}", storage_options=target.storage_options, read_data=False)
    assert report.ok, report.problems
    runtime.run_sync(target.open().delete(_one_blob(target)))
    report = objckpt.verify(f"{target.url}/{TWO}", storage_options=target.storage_options, read_data=False)
    assert [p.kind for p in report.problems] == ["missing"], report.problems


def _one_blob(target: Any) -> str:
    return next(o.key for o in runtime.run_sync(target.open().list(f"{ONE}/")) if o.key.endswith(".blob"))


def _cli(target: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    if target.kind == "s3":
        for name, value in request_env(target).items():
            monkeypatch.setenv(name, value)
    capsys.readouterr()
    status = main([*args, "--no-progress"])
    out = capsys.readouterr()
    return status, out.out, out.err


def request_env(target: Any) -> dict[str, str]:
    so = target.storage_options
    return {
        "AWS_ACCESS_KEY_ID": so["key"],
        "AWS_SECRET_ACCESS_KEY": so["secret"],
        "AWS_ENDPOINT_URL": so["client_kwargs"]["endpoint_url"],
        "AWS_DEFAULT_REGION": so["client_kwargs"].get("region_name", "us-east-1"),
    }


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_ls_and_rm_say_a_base_keeps_what_later_steps_reference(
    kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = request.getfixturevalue(f"{kind}_store")
    _chain(
        target, 2, retention=objckpt.Retention(keep_last=1)
    )  # retention deleted step 1's manifest; step 2 references its blobs
    store = target.open()
    kept = sorted(o.key for o in runtime.run_sync(store.list(f"{ONE}/")))
    assert kept
    status, out, _ = _cli(target, monkeypatch, capsys, "ls", target.url)
    assert status == 0
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["1"])
    assert row[1] == "referenced", out
    status, out, _ = _cli(target, monkeypatch, capsys, "ls", target.url, "--json")
    assert [e["referenced"] for e in json.loads(out)] == [len(kept), 0]
    status, out, err = _cli(target, monkeypatch, capsys, "rm", f"{target.url}/{ONE}")
    assert status != 0 and "--force" not in err and "reference" in err, err
    status, out, err = _cli(target, monkeypatch, capsys, "rm", f"{target.url}/{ONE}", "--force")
    assert status == 0 and ": 0 objects" in out and f"kept {len(kept)} objects" in out, out
    assert sorted(o.key for o in runtime.run_sync(store.list(f"{ONE}/"))) == kept


@pytest.mark.parametrize("kind", ["memory", "local", "s3", "gcs"])
def test_list_names_lists_one_level(kind: str, request: pytest.FixtureRequest) -> None:
    store = request.getfixturevalue(f"{kind}_store").open()
    for key in ("a/x/1", "a/2", "b/3", "c"):
        runtime.run_sync(store.put(key, b"1"))
    assert runtime.run_sync(store.list_names()) == ["a", "b", "c"]
    assert runtime.run_sync(store.list_names("a/")) == ["2", "x"]
    assert runtime.run_sync(store.list_names("zz/")) == []
