"""Pytree flattening to a JSON skeleton and back."""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest

from objckpt.core.tree import build, flatten
from objckpt.errors import FormatError


class Pair(NamedTuple):
    a: int
    b: list


def test_skeleton_is_json_and_rebuilds_plain_containers():
    tree = {"x": [1, (2, None)], "y": {}, "z": Pair(3, [4]), 5: "int key"}
    leaves, skeleton = flatten(tree)
    json.dumps(skeleton)
    paths = [leaf.path for leaf in leaves]
    # str and int keys cannot be sorted together, so insertion order stands
    assert paths == ["['x'][0]", "['x'][1][0]", "['x'][1][1]", "['z'].a", "['z'].b[0]", "[5]"]
    rebuilt = build(json.loads(json.dumps(skeleton)), lambda i: leaves[i].value)
    assert rebuilt == {5: "int key", "x": [1, (2, None)], "y": {}, "z": {"a": 3, "b": [4]}}


def test_unsupported_dict_key_is_named():
    with pytest.raises(TypeError, match=r"\(1, 2\)"):
        flatten({(1, 2): 1})


@pytest.mark.parametrize(
    "bad",
    [
        {"t": "what"},
        {"t": "dict", "k": ["a"], "c": []},
        {"t": "list"},
        {"t": "leaf", "i": "0"},
        [],
        {"t": "dict", "k": [[1]], "c": [{"t": "leaf", "i": 0}]},
    ],
)
def test_malformed_skeleton_raises_format_error(bad):
    with pytest.raises(FormatError):
        build(bad, lambda i: i)
