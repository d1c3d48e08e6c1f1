"""Pytree ↔ (leaf list, JSON skeleton), without pickle.

A checkpoint must describe its tree in plain JSON so that ``restore(url)`` with
no target can rebuild nested dicts, lists and tuples, and so a hostile
manifest can never name code to run. Custom pytree nodes (NamedTuples, flax
dataclasses, optax states) are walked through JAX's own registry and recorded
by their keys; without a target they come back as dicts keyed by field name,
with a target they come back as the target's own types.

Leaf paths are ``jax.tree_util.keystr`` strings: they name leaves in the
manifest and in every error message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey, keystr

from objckpt.errors import FormatError, TargetMismatchError

KeyEntry = Any  # one element of a jax key path


@dataclass(frozen=True)
class Leaf:
    """One leaf of a tree: its path string and value."""

    path: str
    value: Any


def _children(node: Any) -> list[tuple[KeyEntry, Any]] | None:
    """One level of ``node``'s children, or None when ``node`` is a leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if len(flat) == 1 and flat[0][0] == ():
        return None
    return [(path[0], child) for path, child in flat]


def _key_json(entry: KeyEntry, path: str) -> str | int:
    if isinstance(entry, DictKey):
        key = entry.key
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise TypeError(f"dict key {key!r} at {path or 'the root'}: only str and int keys can be saved")
        return key
    if isinstance(entry, SequenceKey):
        return entry.idx
    if isinstance(entry, GetAttrKey):
        return entry.name
    if isinstance(entry, FlattenedIndexKey):
        return entry.key
    raise TypeError(f"unsupported pytree key {entry!r} at {path or 'the root'}")


def flatten(tree: Any) -> tuple[list[Leaf], dict[str, Any]]:
    """Leaves in a stable order plus a JSON skeleton that references them by index.

    ``None`` is recorded as a leaf of its own (kind "none" in the manifest), so it
    survives a round trip even though JAX treats it as an empty subtree.
    """
    leaves: list[Leaf] = []

    def walk(node: Any, keypath: tuple[KeyEntry, ...]) -> dict[str, Any]:
        path = keystr(keypath)
        if node is None:
            leaves.append(Leaf(path, None))
            return {"t": "leaf", "i": len(leaves) - 1}
        if type(node) is dict:
            keys = list(node.keys())
            try:
                keys = sorted(keys)  # JAX's own order for dicts
            except TypeError:
                pass
            for k in keys:
                _key_json(DictKey(k), path)
            return {"t": "dict", "k": keys, "c": [walk(node[k], (*keypath, DictKey(k))) for k in keys]}
        if type(node) in (list, tuple):
            return {"t": type(node).__name__, "c": [walk(v, (*keypath, SequenceKey(i))) for i, v in enumerate(node)]}
        children = _children(node)
        if children is None:
            leaves.append(Leaf(path, node))
            return {"t": "leaf", "i": len(leaves) - 1}
        return {
            "t": "node",
            "type": f"{type(node).__module__}.{type(node).__qualname__}",
            "k": [_key_json(entry, path) for entry, _ in children],
            "c": [walk(child, (*keypath, entry)) for entry, child in children],
        }

    skeleton = walk(tree, ())
    return leaves, skeleton


def build(skeleton: dict[str, Any], make_leaf: Callable[[int], Any], *, depth_limit: int = 256) -> Any:
    """Rebuild plain Python containers from a skeleton; custom nodes become dicts.

    Raises:
        FormatError: the skeleton is malformed (it comes from an untrusted manifest).
    """

    def walk(node: Any, depth: int, where: str) -> Any:
        if depth > depth_limit:
            raise FormatError(f"manifest field 'tree': nesting deeper than {depth_limit} at {where}")
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise FormatError(f"manifest field 'tree': malformed node at {where or 'the root'}")
        kind = node["t"]
        if kind == "leaf":
            index = node.get("i")
            if not isinstance(index, int) or isinstance(index, bool):
                raise FormatError(f"manifest field 'tree': bad leaf index at {where or 'the root'}")
            return make_leaf(index)
        children = node.get("c")
        if not isinstance(children, list):
            raise FormatError(f"manifest field 'tree': node without children list at {where or 'the root'}")
        if kind in ("list", "tuple"):
            items = [walk(c, depth + 1, f"{where}[{i}]") for i, c in enumerate(children)]
            return items if kind == "list" else tuple(items)
        if kind in ("dict", "node"):
            keys = node.get("k")
            if not isinstance(keys, list) or len(keys) != len(children):
                raise FormatError(f"manifest field 'tree': keys do not match children at {where or 'the root'}")
            out: dict[Any, Any] = {}
            for k, c in zip(keys, children):
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise FormatError(f"manifest field 'tree': bad key {k!r} at {where or 'the root'}")
                out[k] = walk(c, depth + 1, f"{where}[{k!r}]")
            return out
        raise FormatError(f"manifest field 'tree': unknown node type {kind!r} at {where or 'the root'}")

    return walk(skeleton, 0, "")


def flatten_target(target: Any) -> tuple[list[tuple[str, Any]], Any]:
    """Flatten a restore target, keeping ``None`` as a leaf (it means "as numpy")."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda x: x is None)
    return [(keystr(path), value) for path, value in flat], treedef


def unflatten_target(treedef: Any, values: list[Any]) -> Any:
    """The inverse of :func:`flatten_target`."""
    return jax.tree_util.tree_unflatten(treedef, values)


def find_subtree(skeleton: dict[str, Any], keypath: tuple[KeyEntry, ...]) -> dict[str, Any] | None:
    """The skeleton node at ``keypath`` (a JAX key path of a target), or None when there is none.

    Keys are matched as :func:`flatten` records them, so a target's dict key,
    attribute name or index finds the saved node of any container type; the
    caller checks the leaf paths below it.
    """
    node: Any = skeleton
    for entry in keypath:
        children = node.get("c") if isinstance(node, dict) else None
        if not isinstance(children, list):
            return None
        if node.get("t") in ("list", "tuple"):
            position = entry.idx if isinstance(entry, SequenceKey) else None
        else:
            try:
                key = _key_json(entry, "")
            except TypeError:
                return None
            keys = node.get("k")
            matches = [n for n, k in enumerate(keys or ()) if k == key and type(k) is type(key)]
            position = matches[0] if matches else None
        if position is None or not 0 <= position < len(children):
            return None
        node = children[position]
    return node if isinstance(node, dict) else None


def leaf_indices(node: dict[str, Any]) -> list[int]:
    """The leaf indexes under a skeleton node, in skeleton order."""
    out: list[int] = []
    stack = [node]
    while stack:
        current = stack.pop()
        if current.get("t") == "leaf":
            out.append(current["i"])
        else:
            stack.extend(reversed(current.get("c", [])))
    return out


def check_names(missing: list[str], unnamed: list[str], *, partial: bool, what: str = "the checkpoint") -> None:
    """Refuse a target that names leaves ``what`` lacks (``missing``), or leaves out some it
    holds (``unnamed``) without ``partial``: one error listing both."""
    if not missing and (not unnamed or partial):
        return
    parts = []
    if missing:
        parts.append(f"target leaves not in the checkpoint: {', '.join(missing)}")
    if unnamed and not partial:
        parts.append(
            f"checkpoint leaves the target does not name: {', '.join(unnamed)} (pass partial=True to skip them)"
        )
    raise TargetMismatchError(f"target does not match {what}; " + "; ".join(parts))
