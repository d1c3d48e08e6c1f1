"""Which saved leaves a restore reads: the target's leaves paired with the saved ones by path.

A target names leaves by key path; ``None`` at a saved subtree stands for the
whole subtree (host numpy in plain containers), and ``partial`` lets a target
leave saved leaves out, which are then not read at all. Inline leaves (Python
scalars, ``Json`` documents) come from the manifest itself; a target's items
(``Json()``, ``PerProcess()``, stateful objects) must name a saved item of their kind.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey, keystr

from objckpt.core.format import ITEM_KINDS, LeafEntry, Manifest
from objckpt.core.items import UNSET, Json, PerProcess, is_item
from objckpt.core.tree import KeyEntry, check_names, find_subtree, flatten_target, leaf_indices
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
    try:
        check_names(missing, unnamed, partial=partial)
    except TargetMismatchError as e:
        hints = did_you_mean(manifest, target, set(missing))
        if not hints:
            raise
        raise TargetMismatchError(f"{e}; did you mean {', '.join(hints)}?") from None
    chosen = {index[path]: value for path, value in flat} | covered
    for i, value in chosen.items():
        check_item_target(manifest.leaves[i], value)
    return chosen, subtrees


def check_item_target(entry: LeafEntry, target: Any) -> None:
    """Refuse a target item of another kind than the saved leaf: ``Json()`` asks for a ``json``
    leaf, ``PerProcess()`` for a ``per_process`` one, a stateful object for what one saves
    (``json`` or ``bytes``); an array target cannot take an item."""
    saved = entry.kind
    if type(target) is Json:
        ok, asked = saved == "json", "a Json item"
    elif type(target) is PerProcess:
        ok, asked = saved == "per_process", "a PerProcess item"
    elif is_item(target):
        ok, asked = saved in ("json", "bytes"), f"a stateful {type(target).__qualname__}"
    else:
        ok, asked = saved not in ITEM_KINDS or not isinstance(target, (jax.ShapeDtypeStruct, jax.Array)), "an array"
    if not ok:
        what = {"json": "a Json item", "per_process": "a PerProcess item"}.get(saved, f"a {saved} leaf")
        raise TargetMismatchError(f"leaf {entry.path}: saved {what}, the target asks for {asked}")


def did_you_mean(manifest: Manifest, target: Any, missing: set[str]) -> list[str]:
    """For target paths the checkpoint lacks, the nearest saved paths (at most 3), each as
    ``"<saved> (the target's <target>)"``.

    The usual cause is a key of another kind: a linen ``TrainState`` (a dataclass)
    saves ``.params``, a dict target names ``['params']``. Such a path is matched
    key by key whatever the kinds (as ``None`` subtrees are), and the hint names
    the shortest prefix where the two differ. Other paths get the closest saved
    path by spelling, if one is close (tried for the first 3 such paths only: each
    try compares with every saved path).
    """
    hints: list[str] = []
    spelling_tries = 3
    saved = [leaf.path for leaf in manifest.leaves]
    flat = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda x: x is None)[0]
    for keypath, _ in flat:
        path = keystr(keypath)
        if path not in missing:
            continue
        node = find_subtree(manifest.tree, keypath)
        below = leaf_indices(node) if node is not None else []
        if below:
            hint = _renamed_prefix(keypath, manifest.leaves[below[0]].path)
        elif spelling_tries:
            spelling_tries -= 1
            close = difflib.get_close_matches(path, saved, n=1, cutoff=0.8)
            hint = f"{close[0]} (the target's {path})" if close else None
        else:
            hint = None
        if hint is not None and hint not in hints:
            hints.append(hint)
        if len(hints) == 3:
            break
    return hints


def _renamed_prefix(keypath: tuple[KeyEntry, ...], saved: str) -> str | None:
    """The shortest prefix of ``keypath`` that the saved path ``saved`` (a leaf at or below
    it, matched key by key) spells differently, as a hint; None when none differs."""
    ours = theirs = ""
    for entry in keypath:
        name = getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", None)))
        forms = [keystr((DictKey(name),)), keystr((FlattenedIndexKey(name),)) if isinstance(name, int) else ""]
        if isinstance(name, str) and name.isidentifier():
            forms.append(keystr((GetAttrKey(name),)))
        if isinstance(name, int):
            forms.append(keystr((SequenceKey(name),)))
        step = next((f for f in forms if f and _starts_at_key(saved, theirs + f)), None)
        if step is None:
            return None
        ours += keystr((entry,))
        theirs += step
        if ours != theirs:
            return f"{theirs} (the target's {ours})"
    return None


def _starts_at_key(path: str, prefix: str) -> bool:
    """Whether ``prefix`` is ``path`` or a whole-key prefix of it."""
    return path.startswith(prefix) and path[len(prefix) : len(prefix) + 1] in ("", ".", "[")


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
    """A leaf saved in the manifest itself (a Python number, bool or None), as the target asks.

    A 0-d array target (what ``jax.eval_shape`` makes of a Python number) gets the number as
    a 0-d array of the target's dtype, on the target's sharding when it has one.
    """
    if entry.kind == "json":
        return copy.deepcopy(entry.value)  # the caller's to change: not the manifest's own
    if entry.kind == "per_process":
        return UNSET  # read from the store (objckpt.restoring.items)
    if not isinstance(target, (jax.ShapeDtypeStruct, jax.Array)):
        return entry.value
    if entry.kind == "none" or tuple(target.shape) != ():
        shape = list(target.shape)
        raise TargetMismatchError(
            f"leaf {entry.path}: saved a Python {entry.kind}, the target asks for an array {shape}"
        )
    import numpy as np

    value = np.asarray(entry.value, dtype=target.dtype)
    sharding = getattr(target, "sharding", None)
    return jax.device_put(value, sharding) if sharding is not None else jax.numpy.asarray(value)
