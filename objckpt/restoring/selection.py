"""Which saved leaves a restore reads: the target's leaves paired with the saved ones by path.

A target names leaves by key path; ``None`` at a saved subtree stands for the
whole subtree (host numpy in plain containers), and ``partial`` lets a target
leave saved leaves out, which are then not read at all. Inline leaves (Python
scalars, strings) come from the manifest itself.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.tree_util import keystr

from objckpt.core.format import LeafEntry, Manifest
from objckpt.core.tree import check_names, find_subtree, flatten_target, leaf_indices
from objckpt.errors import TargetMismatchError


def select(manifest: Manifest, target: Any, partial: bool) -> tuple[dict[int, Any], dict[str, dict[str, Any]]]:
    """Which saved leaves to restore, each with its target leaf; and the saved subtrees
    that ``None`` target leaves stand for (by target path: their skeleton nodes)."""
    if target is None:
        return {i: None for i in range(len(manifest.leaves))}, {}
    flat, _ = flatten_target(target)
    index = {leaf.path: i for i, leaf in enumerate(manifest.leaves)}
    subtrees = none_subtrees(manifest, target, index)
    covered = {i: None for node in subtrees.values() for i in leaf_indices(node)}
    flat = [(path, value) for path, value in flat if path not in subtrees]
    named = {path for path, _ in flat} | {manifest.leaves[i].path for i in covered}
    missing = [path for path, _ in flat if path not in index]
    unnamed = [leaf.path for leaf in manifest.leaves if leaf.path not in named]
    check_names(missing, unnamed, partial=partial)
    return {index[path]: value for path, value in flat} | covered, subtrees


def none_subtrees(manifest: Manifest, target: Any, index: dict[str, int]) -> dict[str, dict[str, Any]]:
    """The ``None`` target leaves that name a saved subtree rather than a leaf, with its skeleton node.

    Such a ``None`` restores the whole subtree as host numpy in plain containers,
    as ``restore(url)`` does for the whole tree.
    """
    found = {}
    for keypath, value in jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda x: x is None)[0]:
        path = keystr(keypath)
        if value is not None or path in index:
            continue
        node = find_subtree(manifest.tree, keypath)
        if node is None or node.get("t") == "leaf":
            continue
        leaves = [manifest.leaves[i].path for i in leaf_indices(node)]
        if leaves and all(p.startswith(path) for p in leaves):
            found[path] = node
    return found


def inline_value(entry: LeafEntry, target: Any) -> Any:
    if isinstance(target, (jax.ShapeDtypeStruct, jax.Array)):
        raise TargetMismatchError(f"leaf {entry.path}: saved a Python {entry.kind}, the target asks for an array")
    return entry.value
