"""The manifest reader's strict rules, through the public calls a user makes on a checkpoint
someone else wrote: duplicate keys anywhere, numbers that overflow, encodings other than
plain UTF-8, sharding descriptions of any shape, and str leaves whose bytes are not text."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import objckpt
from objckpt.cli import main as cli_main
from objckpt.core.format import parse_manifest
from objckpt.errors import FormatError
from objckpt.transfer import runtime

LIMIT = 1 << 20


def _rewrite_manifest(target, edit) -> None:
    """Replace the committed manifest with ``edit(doc)`` (a dict) or raw bytes ``edit(data)``."""
    store = target.open()
    data = runtime.run_sync(store.get("manifest.json"))
    new = edit(data)
    if isinstance(new, dict):
        new = json.dumps(new).encode()
    runtime.run_sync(store.delete("manifest.json"))
    runtime.run_sync(store.put("manifest.json", new, mode="create"))


def _saved(target, tree, **kw):
    objckpt.save(target.url, tree, storage_options=target.storage_options, **kw)
    return target


def _restore(target, *args, **kw):
    return objckpt.restore(target.url, *args, storage_options=target.storage_options, **kw)


# ------------------------------------------------------------------ duplicate keys in the tree


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_duplicate_dict_keys_in_the_tree_are_a_format_error(store_target_factory, kind):
    target = _saved(store_target_factory(kind), {"k": {"a": np.arange(3), "b": np.arange(4), "c": np.arange(5)}})

    def same_keys(data):
        doc = json.loads(data)
        node = doc["tree"]["c"][0]
        assert node["t"] == "dict" and len(node["k"]) == 3
        node["k"] = ["w", "w", "w"]
        return doc

    _rewrite_manifest(target, same_keys)
    with pytest.raises(FormatError, match=r"'w' appears twice"):
        _restore(target)
    with pytest.raises(FormatError, match=r"'w' appears twice"):
        objckpt.inspect(target.url, storage_options=target.storage_options)


def test_keys_that_do_not_match_children_are_refused_at_parse_time():
    doc = _doc()
    doc["tree"]["k"] = ["a"]
    with pytest.raises(FormatError, match="keys do not match"):
        parse_manifest(json.dumps(doc).encode(), size_limit=LIMIT)


# ------------------------------------------------------------------ JSON rules json.loads leaves loose


def _doc() -> dict:
    return {
        "format": "objckpt",
        "version": 1,
        "save_id": "abc",
        "created": "2026-01-01T00:00:00Z",
        "num_processes": 1,
        "metadata": {},
        "tree": {"t": "dict", "k": ["a", "b"], "c": [{"t": "leaf", "i": 0}, {"t": "leaf", "i": 1}]},
        "blobs": [],
        "leaves": [{"path": "['a']", "kind": "int", "value": 1}, {"path": "['b']", "kind": "none"}],
    }


def test_the_reference_document_parses():
    parse_manifest(json.dumps(_doc()).encode(), size_limit=LIMIT)
    parse_manifest(json.dumps(_doc()).encode("utf-8"), size_limit=LIMIT)


@pytest.mark.parametrize(
    "data, message",
    [
        (json.dumps(_doc()).replace('"metadata": {}', '"metadata": {"lr": 1e999}').encode(), "overflows"),
        (json.dumps(_doc()).replace('"metadata": {}', '"metadata": {"lr": -1E+400}').encode(), "overflows"),
        (json.dumps(_doc()).replace('"version": 1,', '"version": 1, "version": 2,').encode(), "'version' twice"),
        (json.dumps(_doc()).replace('"metadata": {}', '"metadata": {"x": 1, "x": 2}').encode(), "'x' twice"),
        (b"\xef\xbb\xbf" + json.dumps(_doc()).encode(), "byte-order mark"),
        (json.dumps(_doc()).encode("utf-16"), "not UTF-8"),
        (json.dumps(_doc()).encode("utf-16-le"), "not valid JSON"),
        (json.dumps(_doc()).encode("utf-32"), "not UTF-8"),
        (json.dumps(_doc()).replace('"abc"', '"ab\\udc80c"').encode(), None),  # lone surrogate: valid JSON text
    ],
    ids=["1e999", "-1e400", "dup-version", "dup-metadata", "bom", "utf-16", "utf-16-le", "utf-32", "surrogate"],
)
def test_json_the_spec_forbids_is_a_format_error(data, message):
    if message is None:
        parse_manifest(data, size_limit=LIMIT)  # an escape, not an encoding problem: accepted
        return
    with pytest.raises(FormatError, match=message):
        parse_manifest(data, size_limit=LIMIT)


def test_an_overflowing_number_on_s3_fails_restore_and_inspect(s3_store, capsys):
    target = _saved(s3_store, {"w": np.arange(4, dtype=np.float32)}, metadata={"lr": 0.5})
    _rewrite_manifest(target, lambda data: data.replace(b'"lr":0.5', b'"lr":1e999'))
    with pytest.raises(FormatError, match="overflows"):
        _restore(target)
    with pytest.raises(FormatError, match="overflows"):
        objckpt.inspect(target.url, storage_options=target.storage_options)


def test_inspect_json_never_prints_non_standard_json(local_store, capsys):
    target = _saved(local_store, {"w": np.arange(4, dtype=np.float32)}, metadata={"lr": 0.5})
    _rewrite_manifest(target, lambda data: data.replace(b'"lr":0.5', b'"lr":1e999'))
    assert cli_main(["inspect", "--json", target.url]) == 1
    out, err = capsys.readouterr()
    assert "Infinity" not in out and "overflows" in err


# ------------------------------------------------------------------ sharding descriptions


@pytest.mark.parametrize(
    "sharding",
    [
        {"type": "NamedSharding", "mesh": {"x": 2}},
        {"type": "NamedSharding", "spec": ["x"]},
        {"type": "NamedSharding", "mesh": ["x"], "spec": 3},
        {"type": "NamedSharding", "mesh": {"x": "two"}, "spec": [{"a": 1}]},
        {"devices": "many"},
        {"type": 7, "devices": 2},
        {},
    ],
)
def test_inspect_shows_any_sharding_description_without_a_key_error(local_store, capsys, sharding):
    target = _saved(local_store, {"w": jax.numpy.arange(8, dtype=jax.numpy.float32)})

    def replace(data):
        doc = json.loads(data)
        doc["leaves"][0]["sharding"] = sharding
        return doc

    _rewrite_manifest(target, replace)
    assert cli_main(["inspect", target.url]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("['w']"))
    if sharding:
        assert json.dumps(sharding, sort_keys=True) in row
    assert cli_main(["inspect", "--json", target.url]) == 0
    assert json.loads(capsys.readouterr().out)["leaves"][0]["sharding"] == sharding


def test_inspect_still_formats_a_well_formed_named_sharding(local_store, capsys):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    spec = jax.sharding.PartitionSpec(("data", "model"), None)
    value = jax.device_put(np.zeros((8, 4), np.float32), jax.sharding.NamedSharding(mesh, spec))
    target = _saved(local_store, {"w": value})
    assert cli_main(["inspect", target.url]) == 0
    assert "mesh(data=2,model=2) spec(data+model,None)" in capsys.readouterr().out


# ------------------------------------------------------------------ str leaves and typed keys


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_str_leaf_that_is_not_utf8_is_a_format_error_naming_the_leaf(store_target_factory, kind):
    target = _saved(store_target_factory(kind), {"name": "ok", "tag": b"\xff\xfe not text"})

    def as_str(data):
        doc = json.loads(data)
        leaf = next(leaf for leaf in doc["leaves"] if leaf["path"] == "['tag']")
        leaf["kind"] = "str"
        return doc

    _rewrite_manifest(target, as_str)
    with pytest.raises(FormatError, match=r"leaf \['tag'\].*not UTF-8"):
        _restore(target)


def test_inspect_shows_a_typed_prng_key_as_its_key_type(local_store, capsys):
    keys = jax.random.split(jax.random.key(0), 3)
    target = _saved(local_store, {"rng": keys, "old": jax.random.PRNGKey(1)})
    info = objckpt.inspect(target.url)
    rng = info.leaves["['rng']"]
    assert rng.key_type == "key<threefry2x32>" and rng.shape == (3, 2)
    assert "key<threefry2x32>[3] (stored as uint32[3, 2])" in str(info)
    assert info.leaves["['old']"].key_type is None  # a raw uint32 key stays what it is
    assert cli_main(["inspect", target.url]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("['rng']"))
    assert "key<threefry2x32>" in row and "[3]" in row and "uint32" not in row
    assert cli_main(["inspect", "--json", target.url]) == 0
    leaves = {leaf["path"]: leaf for leaf in json.loads(capsys.readouterr().out)["leaves"]}
    assert leaves["['rng']"]["key_type"] == "key<threefry2x32>"
    restored = _restore(target)
    assert jax.random.key_impl(restored["rng"]) == jax.random.key_impl(keys)
