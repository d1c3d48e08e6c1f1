"""The manifest reader: round trip, and strict rejection of broken or hostile input."""

from __future__ import annotations

import copy
import json

import pytest

from objckpt.core.format import BlobEntry, LeafEntry, Manifest, Piece, check_blob_key, manifest_to_json, parse_manifest
from objckpt.errors import FormatError

LIMIT = 1 << 20


def _manifest() -> Manifest:
    pieces = (
        Piece((0, 0), (2, 4), "ab/x-p0-000000.blob", 0, 32, 1),
        Piece((2, 0), (4, 4), "ab/x-p0-000000.blob", 64, 32, 2),
    )
    return Manifest(
        save_id="x",
        created="2026-01-01T00:00:00Z",
        tree={"t": "dict", "k": ["n", "w"], "c": [{"t": "leaf", "i": 1}, {"t": "leaf", "i": 0}]},
        leaves=(LeafEntry("['w']", "array", "float32", (4, 4), pieces), LeafEntry("['n']", "float", value=0.1)),
        blobs=(BlobEntry("ab/x-p0-000000.blob", 96),),
        metadata={"note": "hi"},
    )


def _doc() -> dict:
    return json.loads(manifest_to_json(_manifest()))


def test_round_trip():
    m = _manifest()
    assert parse_manifest(manifest_to_json(m), size_limit=LIMIT) == m
    assert m.total_bytes == 64


def _mutate(path, value):
    doc = _doc()
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("version",), 99, "'version'"),
        (("format",), "orbax", "'format'"),
        (("blobs", 0, "key"), "../escape.blob", "'blobs[0]'.key"),
        (("blobs", 0, "key"), "/abs.blob", "'blobs[0]'.key"),
        (("blobs", 0, "key"), "s3://other/b", "'blobs[0]'.key"),
        (("leaves", 0, "dtype"), "object", "'leaves[0]'.dtype"),
        (("leaves", 0, "pieces", 0, "length"), 31, "'leaves[0]'.pieces[0].length"),
        (("leaves", 0, "pieces", 0, "stop"), [2, 5], "'leaves[0]'.pieces[0]"),
        (("leaves", 0, "pieces", 1, "start"), [1, 0], "'leaves[0]'.pieces"),
        (("leaves", 0, "pieces", 1, "offset"), 70, "'leaves[0]'.pieces[1]"),
        (("leaves", 0, "pieces", 0, "blob"), "zz/other.blob", "'leaves[0]'.pieces[0].blob"),
        (("leaves", 0, "shape"), [4, -4], "'leaves[0]'.shape"),
        (("leaves", 1, "value"), "0xzz", "'leaves[1]'.value"),
        (("leaves", 0, "extra"), 1, "'leaves[0]'"),
        (("save_id",), KeyError, "(top level)"),
        (("tree", "c", 0, "i"), 5, "'tree'"),
    ],
)
def test_violations_name_the_field(path, value, field):
    with pytest.raises(FormatError) as info:
        parse_manifest(_mutate(path, value), size_limit=LIMIT)
    assert field in str(info.value)


_PIECE_MUTATIONS = [
    ("start", [0]),
    ("start", [0, 0, 0]),
    ("start", [0, True]),
    ("start", [0.0, 0]),
    ("start", "00"),
    ("start", [-1, 0]),
    ("stop", [2, 5]),
    ("stop", [0, 4]),
    ("stop", [2, False]),
    ("blob", "zz/other.blob"),
    ("blob", 7),
    ("offset", -1),
    ("offset", 65),
    ("offset", True),
    ("offset", 1.0),
    ("length", 31),
    ("length", 32.0),
    ("crc32c", 2**32),
    ("crc32c", -1),
    ("crc32c", True),
    ("crc32c", "1"),
    ("extra", 1),
    ("crc32c", KeyError),
]


@pytest.mark.parametrize(("field", "value"), _PIECE_MUTATIONS)
def test_thefast_piece_check_refuses_whatever_the_full_one_refuses(field, value):
    """Pieces are parsed by a fast check that formats no messages, falling back to the
    full one, which names the field: both must refuse the same pieces."""
    from objckpt.core.pieces import fast_piece, piece_from_json

    piece = {"start": [0, 0], "stop": [2, 4], "blob": "ab/b", "offset": 64, "length": 32, "crc32c": 5}
    blobs = {"ab/b": 96}
    assert fast_piece(dict(piece), [4, 4], 4, blobs) == piece_from_json(dict(piece), "p", [4, 4], 4, blobs)
    if value is KeyError:
        del piece[field]
    else:
        piece[field] = value
    assert fast_piece(piece, [4, 4], 4, blobs) is None
    with pytest.raises(FormatError):
        piece_from_json(piece, "p", [4, 4], 4, blobs)


def test_hole_is_rejected():
    doc = _doc()
    doc["leaves"][0]["pieces"].pop()
    with pytest.raises(FormatError, match="cover"):
        parse_manifest(json.dumps(doc).encode(), size_limit=LIMIT)


def test_overlap_with_matching_volume_is_rejected():
    doc = _doc()
    doc["leaves"][0]["pieces"][1] = copy.deepcopy(doc["leaves"][0]["pieces"][0]) | {"offset": 64}
    with pytest.raises(FormatError, match="overlap"):
        parse_manifest(json.dumps(doc).encode(), size_limit=LIMIT)


def test_size_cap_and_garbage():
    with pytest.raises(FormatError, match="limit"):
        parse_manifest(manifest_to_json(_manifest()), size_limit=10)
    with pytest.raises(FormatError, match="JSON"):
        parse_manifest(b"\x80\x04pickle", size_limit=LIMIT)
    with pytest.raises(FormatError):
        parse_manifest(b"[]", size_limit=LIMIT)
    with pytest.raises(FormatError, match="NaN"):
        parse_manifest(manifest_to_json(_manifest()).replace(b'"note":"hi"', b'"note":NaN'), size_limit=LIMIT)


@pytest.mark.parametrize("key", ["a/../b", "./a", "a//b", "a\\b", "", "C:/x", "a/b c", "http://x"])
def test_blob_keys_that_escape_are_refused(key):
    assert not check_blob_key(key)


@pytest.mark.parametrize("key", ["ab/1234-p0-000001.blob", "x", "00/a.b-c_d"])
def test_normal_blob_keys_pass(key):
    assert check_blob_key(key)
