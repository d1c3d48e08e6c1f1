"""A ``Json`` item's document as the user gave it: NaN and infinities come back as floats (the
manifest holds them as strings and lists where), deep or self-containing documents are refused
at save naming the leaf, and checkpoints written before keep reading as they did."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import objckpt
from objckpt.core.metadata import MAX_DEPTH

LOSS = {
    "loss": float("nan"),
    "inf": float("inf"),
    "hist": [1.5, np.float32("-inf"), "NaN", {"deep": [float("nan")]}],
    "by_step": {3: float("inf")},
    "name": "Infinity",  # a user's string stays a string
}


def _assert_loss(out: dict) -> None:
    assert math.isnan(out["loss"]) and out["inf"] == math.inf
    assert out["hist"][0] == 1.5 and out["hist"][1] == -math.inf and out["hist"][2] == "NaN"
    assert math.isnan(out["hist"][3]["deep"][0]) and out["by_step"] == {"3": math.inf}
    assert out["name"] == "Infinity"
    for v in (out["loss"], out["inf"], out["hist"][1], out["hist"][3]["deep"][0], out["by_step"]["3"]):
        assert type(v) is float


def test_non_finite_floats_round_trip_as_floats(s3_store):
    so = s3_store.storage_options
    tree = {"config": objckpt.Json(LOSS), "nan": objckpt.Json(float("nan")), "pp": objckpt.PerProcess(LOSS)}
    objckpt.save(s3_store.url, tree, storage_options=so)
    out = objckpt.restore(s3_store.url, storage_options=so)
    _assert_loss(out["config"])
    _assert_loss(out["pp"])
    assert type(out["nan"]) is float and math.isnan(out["nan"])
    again = objckpt.restore(s3_store.url, {"config": objckpt.Json()}, partial=True, storage_options=so)
    _assert_loss(again["config"])
    _assert_loss(objckpt.inspect(s3_store.url, storage_options=so).leaves["['config']"].value)


def test_the_manifest_stays_strict_json_and_old_checkpoints_read_as_before(tmp_path):
    url = str(tmp_path / "ck")
    objckpt.save(url, {"config": objckpt.Json(LOSS), "plain": objckpt.Json({"lr": 0.1})})
    text = (tmp_path / "ck" / "manifest.json").read_text()
    doc = json.loads(text, parse_constant=lambda name: pytest.fail(f"the manifest holds {name}"))
    leaves = {leaf["path"]: leaf for leaf in doc["leaves"]}
    assert leaves["['config']"]["value"]["loss"] == "NaN"
    assert leaves["['config']"]["floats"] == [["loss"], ["inf"], ["hist", 1], ["hist", 3, "deep", 0], ["by_step", "3"]]
    assert "floats" not in leaves["['plain']"]  # a document without them is written as before
    # A checkpoint written before floats were listed: its strings stay strings.
    leaves["['config']"].pop("floats")
    (tmp_path / "ck" / "manifest.json").write_text(json.dumps(doc))
    out = objckpt.restore(url)
    assert out["config"]["loss"] == "NaN" and out["config"]["hist"][1] == "-Infinity"


@pytest.mark.parametrize(
    ("floats", "words"),
    [
        ([["name"]], "does not lead to 'NaN'"),  # a float there, not a string
        ([["hist", 0]], "does not lead to 'NaN'"),
        ([["missing"]], "leads nowhere"),
        ([["hist", 9]], "leads nowhere"),
        ([["hist", True]], "leads nowhere"),
        ([["loss"], ["loss"]], "does not lead to 'NaN'"),  # the same path twice
        ([], "non-empty list"),
        ("loss", "non-empty list"),
        ([["x"] * (MAX_DEPTH + 1)], "not a key path"),
    ],
)
def test_a_hostile_floats_list_is_a_format_error_naming_the_leaf(tmp_path, floats, words):
    url = str(tmp_path / "ck")
    objckpt.save(url, {"config": objckpt.Json({**LOSS, "name": 1.0})})
    path = tmp_path / "ck" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["leaves"][0]["floats"] = floats
    path.write_text(json.dumps(doc))
    with pytest.raises(objckpt.FormatError, match=r"leaves\[0\]'\.floats: leaf \['config'\]") as e:
        objckpt.restore(url)
    assert words in str(e.value)


def test_the_local_tier_keeps_non_finite_floats(s3_store, tmp_path):
    mgr = objckpt.CheckpointManager(s3_store.url, storage_options=s3_store.storage_options, local=tmp_path / "local")
    mgr.save(1, {"w": np.arange(4.0), "config": objckpt.Json(LOSS)}, force=True)
    mgr.wait()
    out = mgr.restore(1, {"w": None, "config": objckpt.Json()})
    assert mgr.tier_status().last_restore.tier == "local"  # type: ignore[union-attr]
    _assert_loss(out["config"])
    mgr.close()


def _nested(depth: int) -> dict:
    doc: dict = {}
    inner = doc
    for _ in range(depth - 1):
        inner["a"] = {}
        inner = inner["a"]
    return doc


def test_a_document_nested_too_deep_is_refused_naming_the_leaf(tmp_path):
    url = str(tmp_path / "deep")
    with pytest.raises(ValueError, match=rf"leaf \['config'\]: not a JSON document: .*deeper than {MAX_DEPTH}"):
        objckpt.save(url, {"config": objckpt.Json(_nested(100_000))})
    with pytest.raises(ValueError, match=r"leaf \['pp'\]: not a JSON document: .*deeper than"):
        objckpt.save(url, {"pp": objckpt.PerProcess(_nested(100_000))})
    cycle: dict = {"x": 1}
    cycle["self"] = cycle
    with pytest.raises(ValueError, match=r"leaf \['loop'\]: .*contains itself"):
        objckpt.save(url, {"loop": objckpt.Json(cycle)})
    with pytest.raises(ValueError, match=r"metadata\['run'\].*deeper than"):
        objckpt.save(url, {"w": np.arange(3)}, metadata={"run": _nested(100_000)})
    assert not Path(url).exists() or not (Path(url) / "manifest.json").exists()
    objckpt.save(url, {"config": objckpt.Json(_nested(MAX_DEPTH))})  # the cap itself is fine
    assert objckpt.restore(url)["config"] == _nested(MAX_DEPTH)
