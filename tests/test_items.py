"""Named non-array items (issue 55): ``objckpt.Json``, ``objckpt.PerProcess`` and stateful objects.

Round trips on the local S3 server; restoring an item alone reads no array bytes
(counted); ``PerProcess`` on 2 processes (each its own value, ``all=True``) and a
grain DataLoader's state through it; the count-mismatch error; ``inspect`` and the
CLI; hostile roots (each a FormatError naming the leaf); version 2 unchanged.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import objckpt
from objckpt.cli import main as cli_main
from objckpt.core.items import JSON_MAX_BYTES
from tests import multiprocess

WORKER = Path(__file__).with_name("items_worker.py")


class Tokenizer:
    """A custom item: JSON state."""

    def __init__(self, vocab: dict[str, int] | None = None) -> None:
        self.vocab = dict(vocab or {})

    def state_dict(self) -> dict[str, object]:
        return {"vocab": self.vocab, "size": np.int64(len(self.vocab))}

    def load_state_dict(self, state: dict[str, object]) -> None:
        assert state["size"] == len(state["vocab"])  # type: ignore[arg-type]
        self.vocab = dict(state["vocab"])  # type: ignore[call-overload]


class Blobby:
    """A custom item: bytes state."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = data

    def state_dict(self) -> bytes:
        return self.data

    def load_state_dict(self, state: bytes) -> None:
        self.data = state


def _tree() -> dict[str, object]:
    return {
        "params": {"w": jnp.arange(64 * 1024, dtype=jnp.float32).reshape(64, 1024), "b": np.ones(256, np.int32)},
        "config": objckpt.Json({"lr": 3e-4, "layers": [4, 8], "name": "decoder", "warmup": None}),
        "data": objckpt.PerProcess(b'{"last_seen": 10}'),
        "note": objckpt.PerProcess("text value"),
        "tok": Tokenizer({"a": 0, "b": 1}),
        "raw": Blobby(b"\x00\x01binary"),
    }


def test_round_trip_on_s3(s3_store):
    so = s3_store.storage_options
    objckpt.save(s3_store.url, _tree(), storage_options=so)
    tok, raw = Tokenizer(), Blobby()
    target = {
        "params": {"w": jax.ShapeDtypeStruct((64, 1024), jnp.float32), "b": None},
        "config": objckpt.Json(),
        "data": objckpt.PerProcess(),
        "note": objckpt.PerProcess(),
        "tok": tok,
        "raw": raw,
    }
    out = objckpt.restore(s3_store.url, target, storage_options=so)
    assert out["config"] == {"lr": 3e-4, "layers": [4, 8], "name": "decoder", "warmup": None}
    assert out["data"] == b'{"last_seen": 10}' and out["note"] == "text value"
    assert out["tok"] is tok and tok.vocab == {"a": 0, "b": 1}
    assert out["raw"] is raw and raw.data == b"\x00\x01binary"
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.arange(64 * 1024).reshape(64, 1024))
    # Without a target: plain values (a stateful object's state, this process's PerProcess value).
    plain = objckpt.restore(s3_store.url, storage_options=so)
    assert plain["tok"] == {"vocab": {"a": 0, "b": 1}, "size": 2} and plain["raw"] == b"\x00\x01binary"
    assert plain["data"] == b'{"last_seen": 10}' and plain["config"]["layers"] == [4, 8]
    # The save's own tree is a valid target: its items stand for what was saved.
    again = objckpt.restore(s3_store.url, _tree(), storage_options=so)
    assert again["data"] == b'{"last_seen": 10}' and again["tok"].vocab == {"a": 0, "b": 1}


def test_items_alone_read_no_array_bytes(s3_store):
    so = s3_store.storage_options
    objckpt.save(s3_store.url, _tree(), storage_options=so)
    stats = objckpt.TransferStats()
    out = objckpt.restore(s3_store.url, {"config": objckpt.Json()}, partial=True, storage_options=so, stats=stats)
    assert out == {"config": {"lr": 3e-4, "layers": [4, 8], "name": "decoder", "warmup": None}}
    assert stats.bytes_read == 0  # the document is in the root
    stats = objckpt.TransferStats()
    out = objckpt.restore(s3_store.url, {"data": objckpt.PerProcess()}, partial=True, storage_options=so, stats=stats)
    assert out == {"data": b'{"last_seen": 10}'}
    assert stats.bytes_read == len(b'{"last_seen": 10}')  # its own bytes, no array's, no index object
    stats = objckpt.TransferStats()
    objckpt.restore(s3_store.url, {"params": {"w": None}}, partial=True, storage_options=so, stats=stats)
    assert stats.bytes_read >= 64 * 1024 * 4  # the counter counts: an array is read


@pytest.mark.parametrize("count", [2, 4])
def test_per_process_on_several_processes(s3_store, monkeypatch, count):
    monkeypatch.setattr(multiprocess, "WORKER", WORKER)
    so = s3_store.storage_options
    url = s3_store.url + "/items"
    results = multiprocess.run_processes(count, {"kind": "items", "url": url, "storage_options": so})
    expected = [f"process {p} of {count}" * (p + 1) for p in range(count)]
    for p, result in enumerate(results):
        assert result is not None, f"process {p} gave no result"
        assert result["data"] == expected[p]  # each process its own value
        assert result["rng"] == {"seed": 100 + p}
        assert result["config"] == {"lr": 0.1, "layers": [1, 2]}
        assert result["all"] == expected  # every process's, in saved process order
    # One process restoring what several saved: only every process's values, in saved order.
    with pytest.raises(objckpt.TargetMismatchError) as e:
        objckpt.restore(url, {"data": objckpt.PerProcess()}, partial=True, storage_options=so)
    assert "['data']" in str(e.value) and f"saved by {count} processes, restored on 1" in str(e.value)
    assert "PerProcess(all=True)" in str(e.value)
    out = objckpt.restore(url, {"data": objckpt.PerProcess(all=True)}, partial=True, storage_options=so)
    assert out["data"] == [v.encode() for v in expected]
    info = objckpt.inspect(url, storage_options=so)
    assert info.leaves["['data']"].value == [len(v) for v in expected]


def test_grain_iterator_state_on_two_processes(s3_store, monkeypatch):
    monkeypatch.setattr(multiprocess, "WORKER", WORKER)
    so = s3_store.storage_options
    job = {"kind": "grain", "url": s3_store.url + "/grain", "storage_options": so, "seed": 5}
    results = multiprocess.run_processes(2, job)
    seen = []
    for result in results:
        assert result is not None and result["step"] == 3
        assert result["resumed"] == result["uninterrupted"]  # the next batches equal an uninterrupted run's
        seen.append(result["drawn"] + result["uninterrupted"])
    assert seen[0] != seen[1]  # each process its own shard, so its own state


def test_inspect_and_cli(tmp_path, capsys):
    url = str(tmp_path / "ck")
    big = {"k" + str(i): "v" * 50 for i in range(20)}
    objckpt.save(
        url, {"config": objckpt.Json({"lr": 0.5}), "big": objckpt.Json(big), "data": objckpt.PerProcess(b"x" * 300)}
    )
    info = objckpt.inspect(url)
    assert info.leaves["['config']"].kind == "json" and info.leaves["['config']"].value == {"lr": 0.5}
    assert info.leaves["['data']"].kind == "per_process" and info.leaves["['data']"].value == [300]
    assert str(info.leaves["['config']"]) == "['config']  json: {\"lr\": 0.5}"
    assert "1 process(es): 300 B" in str(info.leaves["['data']"])
    assert cli_main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert '{"lr": 0.5}' in out  # a small document inline
    assert "<JSON document, 1.2 KiB: below>" in out  # a longer one under the table, pretty
    assert "\n['big'] (json):\n{\n" in out and f'  "k19": "{"v" * 50}"\n}}' in out
    assert "1 process(es): 300 B" in out
    assert cli_main(["inspect", "--json", url]) == 0
    doc = json.loads(capsys.readouterr().out)
    leaves = {leaf["path"]: leaf for leaf in doc["leaves"]}
    assert leaves["['config']"]["value"] == {"lr": 0.5} and leaves["['data']"]["value"] == [300]


def _saved(tmp_path: Path) -> tuple[str, dict[str, object]]:
    url = str(tmp_path / "ck")
    objckpt.save(url, {"w": np.arange(10), "config": objckpt.Json({"a": 1}), "data": objckpt.PerProcess(b"abc")})
    return url, json.loads((tmp_path / "ck" / "manifest.json").read_text())


def _leaf(doc: dict[str, object], path: str) -> dict[str, object]:
    return next(leaf for leaf in doc["leaves"] if leaf["path"] == path)  # type: ignore[attr-defined,index]


def _hostile(tmp_path: Path, change) -> str:
    url, doc = _saved(tmp_path)
    change(doc)
    (tmp_path / "ck" / "manifest.json").write_text(json.dumps(doc))
    return url


@pytest.mark.parametrize(
    ("name", "change", "words"),
    [
        ("json over the cap", lambda d: _leaf(d, "['config']").update(value="x" * JSON_MAX_BYTES), "over the"),
        ("outside its blob", lambda d: _leaf(d, "['data']")["processes"][0].update(offset=10**6), "outside"),
        ("negative offset", lambda d: _leaf(d, "['data']")["processes"][0].update(offset=-1), "non-negative"),
        ("wrong process count", lambda d: _leaf(d, "['data']")["processes"].append({}), "one value per process (1)"),
        ("unknown encoding", lambda d: _leaf(d, "['data']")["processes"][0].update(encoding="pickle"), "encoding"),
        ("unsafe blob key", lambda d: _leaf(d, "['data']")["processes"][0].update(blob="../x"), "unsafe key"),
        ("extra field", lambda d: _leaf(d, "['config']").update(shape=[1]), "unknown ['shape']"),
        ("no blob", lambda d: _leaf(d, "['data']")["processes"][0].pop("blob"), "missing"),
    ],
)
def test_hostile_roots(tmp_path, name, change, words):
    url = _hostile(tmp_path, change)
    with pytest.raises(objckpt.FormatError) as e:
        objckpt.restore(url)
    message = str(e.value)
    assert "leaves[" in message and words in message, message
    if name not in ("extra field", "no blob"):
        assert "leaf ['config']" in message or "leaf ['data']" in message, message


def test_a_value_checked_by_its_crc32c(tmp_path):
    url = _hostile(tmp_path, lambda d: _leaf(d, "['data']")["processes"][0].update(crc32c=12345))
    stats = objckpt.TransferStats()
    with pytest.raises(objckpt.ChecksumMismatchError, match=r"leaf \['data'\]: process 0's value.*over 5 reads"):
        objckpt.restore(url, stats=stats)
    assert stats.checksum_retries == 4  # read again before it is called corruption
    assert objckpt.restore(url, {"config": objckpt.Json()}, partial=True) == {"config": {"a": 1}}


def test_item_kinds_refused_by_older_versions_and_mismatched_targets(tmp_path):
    url, doc = _saved(tmp_path / "b")
    for r in doc["indexes"]:  # type: ignore[attr-defined]
        r.pop("head")
    doc["version"] = 2
    (tmp_path / "b" / "ck" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(objckpt.FormatError, match="unknown kind 'json'"):
        objckpt.restore(url)
    other, _ = _saved(tmp_path / "c")
    with pytest.raises(
        objckpt.TargetMismatchError, match=r"leaf \['config'\]: saved a Json item, the target asks for a PerProcess"
    ):
        objckpt.restore(other, {"config": objckpt.PerProcess()}, partial=True)
    with pytest.raises(
        objckpt.TargetMismatchError, match=r"leaf \['w'\]: saved a ndarray leaf, the target asks for a Json"
    ):
        objckpt.restore(other, {"w": objckpt.Json()}, partial=True)
    with pytest.raises(
        objckpt.TargetMismatchError, match=r"leaf \['data'\]: saved a PerProcess item, the target asks for an array"
    ):
        objckpt.restore(other, {"data": jax.ShapeDtypeStruct((3,), jnp.uint8)}, partial=True)


def test_save_errors_name_the_leaf(tmp_path):
    with pytest.raises(ValueError, match=r"leaf \['c'\]: the JSON document is \d+ bytes, over"):
        objckpt.save(str(tmp_path / "a"), {"c": objckpt.Json("x" * JSON_MAX_BYTES)})
    with pytest.raises(TypeError, match=r"leaf \['c'\]: not a JSON document"):
        objckpt.save(str(tmp_path / "b"), {"c": objckpt.Json({"f": object()})})
    with pytest.raises(ValueError, match=r"leaf \['d'\]: PerProcess\(\) without a value"):
        objckpt.save(str(tmp_path / "c"), {"d": objckpt.PerProcess()})
    with pytest.raises(ValueError, match=r"leaf \['c'\]: .*format_version=3"):
        objckpt.save(str(tmp_path / "d"), {"c": objckpt.Json({})}, options=objckpt.Options(format_version=2))
    assert not (tmp_path / "a").exists() or not (tmp_path / "a" / "manifest.json").exists()


def test_version_2_checkpoints_unaffected(tmp_path):
    url = str(tmp_path / "v2")
    tree = {"w": np.arange(12.0), "s": "text", "b": b"bytes", "n": 3}
    objckpt.save(url, tree, options=objckpt.Options(format_version=2))
    assert json.loads((tmp_path / "v2" / "manifest.json").read_text())["version"] == 2
    out = objckpt.restore(url)
    assert out["s"] == "text" and out["b"] == b"bytes" and out["n"] == 3
    np.testing.assert_array_equal(out["w"], np.arange(12.0))


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_value_outside_its_blob_when_read(kind, store_target_factory, monkeypatch):
    """A root that passes the parse (its offset within the process's blob bytes) but points past
    the end of the blob it names: the read comes back short, a FormatError naming the leaf."""
    from objckpt.core.format import v2
    from objckpt.storage import from_url
    from objckpt.transfer import runtime

    monkeypatch.setattr(v2, "_check_items", lambda *args: None)
    target = store_target_factory(kind)
    objckpt.save(
        target.url, {"w": np.arange(10), "data": objckpt.PerProcess(b"abc")}, storage_options=target.storage_options
    )
    store = from_url(target.url, **target.storage_options)
    doc = json.loads(runtime.run_sync(store.get("manifest.json")))
    _leaf(doc, "['data']")["processes"][0]["offset"] = 1000
    runtime.run_sync(store.put("manifest.json", json.dumps(doc).encode()))
    with pytest.raises(objckpt.FormatError, match=r"leaf \['data'\]: process 0's value lies outside blob"):
        objckpt.restore(target.url, storage_options=target.storage_options)


def test_copy_and_verify_keep_items(tmp_path):
    """A PerProcess value lies in a blob its process's index object lists: cp copies it, verify passes."""
    url, _ = _saved(tmp_path)
    dst = str(tmp_path / "copy")
    objckpt.copy(url, dst)
    assert objckpt.verify(dst).ok
    out = objckpt.restore(dst, {"config": objckpt.Json(), "data": objckpt.PerProcess()}, partial=True)
    assert out == {"config": {"a": 1}, "data": b"abc"}


def test_digests_pin_per_process_values(tmp_path):
    url = str(tmp_path / "ck")
    objckpt.save(url, {"data": objckpt.PerProcess(b"abc")}, options=objckpt.Options(digest="sha256"))
    doc = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    ref = _leaf(doc, "['data']")["processes"][0]  # type: ignore[index]
    assert len(ref["sha256"]) == 64
    assert objckpt.restore(url, options=objckpt.Options(digest="sha256")) == {"data": b"abc"}
    ref["sha256"] = "0" * 64
    (tmp_path / "ck" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(objckpt.ChecksumMismatchError, match=r"leaf \['data'\].*do not match their sha256"):
        objckpt.restore(url)


def test_verify_checks_per_process_values(tmp_path):
    url, doc = _saved(tmp_path)
    ref = _leaf(doc, "['data']")["processes"][0]  # type: ignore[index]
    path = tmp_path / "ck" / ref["blob"]
    data = bytearray(path.read_bytes())
    data[ref["offset"]] ^= 0xFF
    path.write_bytes(bytes(data))
    report = objckpt.verify(url)
    assert not report.ok
    assert any("['data']" in str(p) for p in report.problems), report.problems


def test_stateful_objects_inside_items(tmp_path):
    """``PerProcess(obj)`` saves each process's ``state_dict()``; ``Json(obj)`` one JSON state; a target
    item holding an object gets it loaded and returns it."""
    url = str(tmp_path / "ck")
    objckpt.save(url, {"mine": objckpt.PerProcess(Blobby(b"\xffown")), "tok": objckpt.Json(Tokenizer({"z": 0}))})
    raw = objckpt.restore(url)
    assert raw == {"mine": b"\xffown", "tok": {"vocab": {"z": 0}, "size": 1}}
    blob, tok = Blobby(), Tokenizer()
    out = objckpt.restore(url, {"mine": objckpt.PerProcess(blob), "tok": objckpt.Json(tok)})
    assert out["mine"] is blob and blob.data == b"\xffown"
    assert out["tok"] is tok and tok.vocab == {"z": 0}
    with pytest.raises(TypeError, match=r"leaf \['tok'\]: not a JSON document"):
        objckpt.save(str(tmp_path / "b"), {"tok": objckpt.Json(Blobby(b"x"))})  # bytes state: not JSON


def test_per_process_items_fit_the_commit_report(tmp_path):
    """Each process reports where its values lie through the coordinator (4 KiB a process): a
    tree with more items than fit is refused, naming the way out; 20 fit."""
    objckpt.save(str(tmp_path / "a"), {f"v{i}": objckpt.PerProcess(b"x") for i in range(20)})
    with pytest.raises(ValueError, match="PerProcess items take .* one PerProcess"):
        objckpt.save(str(tmp_path / "b"), {f"v{i}": objckpt.PerProcess(b"x") for i in range(40)})
    assert not (tmp_path / "b" / "manifest.json").exists()


def _config(i: int) -> dict[str, object]:
    return {
        "model": {"layers": 24 + i, "d_model": 4096, "heads": 32, "activation": "gelu", "norm": "rmsnorm"},
        "optimizer": {"name": "adamw", "lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1, "warmup": 2000},
        "data": {"path": "gs://bucket/tokens/train-*.tfrecord", "seq_len": 2048, "global_batch": 512},
        "loss": float("nan"),
    }


@pytest.mark.s3
def test_inspect_shows_documents_and_prints_one_item_whole(s3_service, s3_store, monkeypatch, capsys):
    url = s3_store.url
    history = {f"step_{i}": {"loss": 1.0 / (i + 1), "lr": 3e-4} for i in range(200)}  # ~9 KiB
    tree = {"config": objckpt.Json(_config(0)), "run": {"history": objckpt.Json(history)}, "w": np.arange(8)}
    objckpt.save(url, tree, storage_options=s3_store.storage_options)
    for name, value in s3_service.env().items():
        monkeypatch.setenv(name, value)
    assert cli_main(["inspect", url]) == 0
    out = capsys.readouterr().out
    # A training config of a few hundred bytes: pretty, whole, under the table.
    assert re.search(r"\['config'\] +json +<JSON document, 3\d\d B: below> +3\d\d B  -\n", out), out
    shown = out[out.index("\n['config'] (json):\n") :]
    assert '  "optimizer": {\n    "name": "adamw",\n    "lr": 0.0003,\n    "betas": [0.9, 0.95],' in shown
    assert '  "loss": NaN\n}' in shown
    # A longer document: its first 4 KiB of lines, then a marker naming what prints it whole.
    shown = out[out.index("\n['run']['history'] (json):\n") :]
    assert '"step_10": {"loss": ' in shown and '"step_199"' not in shown
    assert re.search(r"\n\.\.\. \(cut: \d+ of 202 lines shown; objckpt inspect (\S+) --item run/history prints", shown)
    assert len(shown[: shown.index("\n... (cut")].encode()) <= 4096 + len("\n['run']['history'] (json):\n")
    assert cli_main(["inspect", url, "--item", "run/history"]) == 0
    whole = capsys.readouterr().out
    assert json.loads(whole) == history and whole.count("\n") == 202  # 202 lines, each ended
    for name in ("config", "['config']"):
        assert cli_main(["inspect", url, "--item", name]) == 0
        text = capsys.readouterr().out
        doc = json.loads(text)  # Python's JSON reads NaN back
        assert doc["model"] == _config(0)["model"] and doc["loss"] != doc["loss"]
    assert cli_main(["inspect", "--json", url, "--item", "config"]) == 0
    leaf = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"--json printed {c}"))
    assert leaf["path"] == "['config']" and leaf["value"]["loss"] == "NaN" and leaf["value"]["data"]["seq_len"] == 2048
    assert cli_main(["inspect", url, "--item", "w"]) == 0
    assert capsys.readouterr().out.startswith("['w']  int64[8]")
    assert cli_main(["inspect", url, "--item", "nope"]) == 2
    err = capsys.readouterr().err
    assert "has no leaf named 'nope'" in err and "its items: config, run/history" in err, err
