"""Hostile or broken input: fuzzed manifests, escaping keys, no code-executing deserialisers."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from source_scan import parse_source

from objckpt.core.format import BlobEntry, LeafEntry, Manifest, Piece, check_blob_key, manifest_to_json, parse_manifest
from objckpt.errors import FormatError

LIMIT = 1 << 20
PACKAGE = Path(__file__).resolve().parents[1] / "objckpt"


def _valid_doc() -> dict:
    pieces = tuple(Piece((r, 0), (r + 2, 8), "0a/s-p0-000000.blob", r * 64, 64, 1234) for r in range(0, 8, 2))
    manifest = Manifest(
        save_id="abc",
        created="2026-01-01T00:00:00Z",
        tree={
            "t": "dict",
            "k": ["a", "b", "c", "d"],
            "c": [
                {"t": "leaf", "i": 0},
                {"t": "leaf", "i": 1},
                {"t": "list", "c": [{"t": "leaf", "i": 2}]},
                {"t": "leaf", "i": 3},
            ],
        },
        leaves=(
            LeafEntry("['a']", "array", "float32", (8, 8), pieces, sharding={"type": "NamedSharding"}),
            LeafEntry("['b']", "int", value=3),
            LeafEntry("['c'][0]", "float", value=0.5),
            LeafEntry("['d']", "str", "uint8", (3,), (Piece((0,), (3,), "0b/s-p0-000001.blob", 0, 3, 99),)),
        ),
        blobs=(BlobEntry("0a/s-p0-000000.blob", 512), BlobEntry("0b/s-p0-000001.blob", 3)),
    )
    return json.loads(manifest_to_json(manifest))


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.sampled_from(
        ["../x", "/etc/passwd", "s3://other/b", "a/../../b", "float32", "array", "leaf", "0a/s-p0-000000.blob"]
    ),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20,
)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _mutate(doc, path, action, value):
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if action == "delete":
        del parent[last]
    elif action == "add" and isinstance(parent, dict):
        parent[f"extra{len(parent)}"] = value
    else:
        parent[last] = value
    return doc


def _check_result(data: bytes) -> None:
    try:
        manifest = parse_manifest(data, size_limit=LIMIT)
    except FormatError:
        return
    # Whatever the reader accepts is safe to plan reads from.
    sizes = {b.key: b.size for b in manifest.blobs}
    for blob in manifest.blobs:
        assert check_blob_key(blob.key)
    for leaf in manifest.leaves:
        for piece in leaf.pieces:
            assert piece.blob in sizes and piece.offset + piece.length <= sizes[piece.blob]
            assert all(0 <= a < b <= n for a, b, n in zip(piece.start, piece.stop, leaf.shape or ()))


@settings(max_examples=600, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), action=st.sampled_from(["replace", "delete", "add"]), value=json_values)
def test_mutated_manifests_raise_format_error_or_are_valid(data, action, value):
    doc = _valid_doc()
    paths = list(_paths(doc))
    path = data.draw(st.sampled_from(paths))
    mutated = _mutate(doc, path, action, value)
    _check_result(json.dumps(mutated).encode())


@settings(max_examples=300, deadline=2000)
@given(value=json_values)
def test_random_json_documents(value):
    _check_result(json.dumps(value).encode())


@settings(max_examples=300, deadline=2000)
@given(raw=st.binary(max_size=512))
def test_random_bytes(raw):
    _check_result(raw)


def test_pathological_inputs_do_not_hang_or_crash():
    for data in (
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b"\xff\xfe",
        b"",
        b"x" * (LIMIT + 1),
    ):
        _check_result(data)
    doc = _valid_doc()
    doc["leaves"][0]["shape"] = [2**62, 2**62]
    _check_result(json.dumps(doc).encode())
    for depth in (300, 5000):  # past the skeleton's nesting limit, and past Python's recursion limit
        doc = _valid_doc()
        doc["tree"] = "TREE"
        deep = '{"t":"list","c":[' * depth + '{"t":"leaf","i":0}' + "]}" * depth
        _check_result(json.dumps(doc).replace('"TREE"', deep).encode())


FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def test_library_never_imports_a_code_executing_deserialiser():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = parse_source(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                offenders.append(f"{path.name}:{node.lineno} allow_pickle=")
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) in {"load", "loads"}
                and getattr(node.func.value, "id", None) in {"np", "numpy", "torch", "yaml"}
            ):
                offenders.append(f"{path.name}:{node.lineno} {node.func.value.id}.{node.func.attr}")
            offenders.extend(f"{path.name}:{node.lineno} imports {n}" for n in names if n in FORBIDDEN_MODULES)
    assert offenders == []
