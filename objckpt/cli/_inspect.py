"""``objckpt inspect``: a checkpoint's leaves as a table, its items' documents, or one item whole.

A ``Json`` item's document fits in the table's row when its compact text is short;
a longer one (a training config) is printed pretty under the table, cut with a
marker past :data:`SHOWN_BYTES` (the marker names the ``--item`` that prints it
whole). ``--item NAME`` prints one leaf: a ``Json`` document whole, any other leaf
as its line. NAME is the leaf's path as ``inspect`` shows it (``['opt']['config']``)
or its keys joined by ``/`` (``opt/config``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
from typing import Any

from objckpt.cli._output import dump, table
from objckpt.cli._stores import UsageError, options_from_args
from objckpt.core.metadata import NON_FINITE
from objckpt.progress import human_bytes
from objckpt.tools.inspect import CheckpointInfo, LeafInfo, inspect

#: How much of a ``Json`` document the table's row holds (characters of its compact text).
ROW_CHARS = 200
#: How much of a longer document is printed under the table (bytes of its pretty text).
SHOWN_BYTES = 4 << 10
#: The columns a list or object of plain values may take on one line of a pretty document.
WIDTH = 80
#: How ``inspect`` names a layout other than objckpt's (by ``CheckpointInfo.format``).
_LAYOUT_NAMES = {"orbax": "Orbax"}
#: One key of a leaf path as ``jax.tree_util.keystr`` writes it: ``['name']``, ``[0]``, ``.attr``.
_KEY = re.compile(r"\[(?:'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"|(-?\d+))\]|\.([A-Za-z_]\w*)")


def show(args: argparse.Namespace, url: str) -> int:
    """``inspect URL`` (``url`` the step the user's URL names); the exit status."""
    info = inspect(url, storage_options=options_from_args(args, url))
    if getattr(args, "item", None) is not None:
        return _show_item(args, _find(info, args.item))
    if args.json:
        dump(_info_doc(info))
        return 0
    rows, documents = [], []
    for leaf in info.leaves.values():
        if leaf.kind == "json":
            compact = json.dumps(leaf.value, sort_keys=True)
            size = len(compact.encode())
            if len(compact) > ROW_CHARS:
                documents.append(leaf)
                compact = f"<JSON document, {human_bytes(size)}: below>"
            rows.append([leaf.path, leaf.kind, compact, human_bytes(size), "-"])
        elif leaf.kind == "per_process":
            rows.append([leaf.path, leaf.kind, leaf.item_summary() or "", human_bytes(sum(leaf.value)), "-"])
        elif leaf.shape is None:
            rows.append([leaf.path, leaf.kind, f"= {leaf.value!r}", "-", "-"])
        else:
            dtype = leaf.dtype if leaf.kind in ("array", "ndarray") else leaf.kind
            shape = list(leaf.shape)
            if leaf.key_type is not None:  # a typed PRNG key array: its key type and its own shape
                dtype, shape = leaf.key_type, shape[:-1]
            rows.append([leaf.path, str(dtype), str(shape), human_bytes(leaf.nbytes), _sharding(leaf)])
    foreign = _LAYOUT_NAMES.get(info.format, info.format) if info.format != "objckpt" else None
    print(f"{foreign + ' ' if foreign else ''}checkpoint {info.url}")
    print(table(["LEAF", "DTYPE", "SHAPE", "SIZE", "SAVED SHARDING"], rows, right={3}))
    for leaf in documents:
        print(f"\n{leaf.path} (json):")
        print(_cut(_pretty(leaf.value), args.url, leaf.path))
    if documents:
        print()
    if foreign:  # no objckpt format version, no save_id
        print(
            f"total: {len(info.leaves)} leaves, {human_bytes(info.total_bytes)} ({info.total_bytes} bytes);"
            f" written by {foreign}, created {info.created or 'unknown'}, {info.num_processes} process(es)"
        )
        if info.metadata:
            print(f"metadata: {json.dumps(info.metadata, sort_keys=True, default=str)}")
        return 0
    print(
        f"total: {len(info.leaves)} leaves, {human_bytes(info.total_bytes)} ({info.total_bytes} bytes)"
        f" in {info.num_blobs} blobs{info.stored_summary()}; format v{info.format_version}, created {info.created},"
        f" {info.num_processes} process(es), save_id {info.save_id}"
    )
    if info.bytes_from is not None:  # an incremental checkpoint: where its bytes are stored
        where = [f"{human_bytes(n)} from {name or 'its own blobs'}" for name, n in sorted(info.bytes_from.items())]
        print(f"incremental: {', '.join(where)}")
    print(f"metadata: {json.dumps(info.metadata, sort_keys=True, default=str) if info.metadata else '{}'}")
    return 0


def _pretty(document: Any, indent: int = 0) -> str:
    """A document as people read it: indented by two, keys in saved order, NaN and infinities as
    such; a list or object of plain values that fits in :data:`WIDTH` columns on one line."""
    text = json.dumps(document, ensure_ascii=False)
    if not isinstance(document, (dict, list)) or not document:
        return text
    values = document.values() if isinstance(document, dict) else document
    if indent + len(text) <= WIDTH and not any(isinstance(v, (dict, list)) and v for v in values):
        return text
    pad = " " * (indent + 2)
    if isinstance(document, dict):
        lines = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {_pretty(v, indent + 2)}" for k, v in document.items()]
        return "{\n" + ",\n".join(lines) + "\n" + " " * indent + "}"
    lines = [f"{pad}{_pretty(v, indent + 2)}" for v in document]
    return "[\n" + ",\n".join(lines) + "\n" + " " * indent + "]"


def _cut(text: str, url: str, path: str) -> str:
    """``text``, or its lines within :data:`SHOWN_BYTES` and a marker naming what prints it whole."""
    data = text.encode()
    if len(data) <= SHOWN_BYTES:
        return text
    head = data[:SHOWN_BYTES].decode(errors="ignore")
    head = head[: head.rfind("\n")] if "\n" in head else head
    return (
        f"{head}\n... (cut: {head.count(chr(10)) + 1} of {text.count(chr(10)) + 1} lines shown;"
        f" objckpt inspect {shlex.quote(url)} --item {shlex.quote(_short_name(path))} prints it whole)"
    )


def _keys(path: str) -> list[str] | None:
    """The keys of a leaf path (``['opt']['lr']`` → ``['opt', 'lr']``); None if it is not one."""
    keys, at = [], 0
    for match in _KEY.finditer(path):
        if match.start() != at:
            return None
        keys.append(next(g for g in match.groups() if g is not None))
        at = match.end()
    return keys if at == len(path) and keys else None


def _short_name(path: str) -> str:
    """How ``--item`` may name the leaf: its keys joined by ``/`` when they name it alone, else its path."""
    keys = _keys(path)
    return "/".join(keys) if keys and all(k and "/" not in k for k in keys) else path


def _find(info: CheckpointInfo, name: str) -> LeafInfo:
    """The leaf ``--item NAME`` names (its path, or its keys joined by ``/``).

    Raises:
        UsageError: no leaf, or more than one, goes by that name (the items there named).
    """
    if name in info.leaves:
        return info.leaves[name]
    found = [leaf for path, leaf in info.leaves.items() if "/".join(_keys(path) or [path]) == name.strip("/")]
    if len(found) == 1:
        return found[0]
    items = [p for p, leaf in info.leaves.items() if leaf.kind in ("json", "per_process")]
    listed = ", ".join(_short_name(p) for p in items[:20]) + (", ..." if len(items) > 20 else "")
    why = f"{len(found)} leaves go by the name" if found else "no leaf named"
    raise UsageError(
        f"{info.url} has {why} {name!r} (give its path as inspect shows it); its items: {listed or 'none'}"
    )


def _show_item(args: argparse.Namespace, leaf: LeafInfo) -> int:
    if args.json:
        dump(_leaf_doc(leaf))
    elif leaf.kind == "json":
        print(_pretty(leaf.value))
    else:
        print(leaf)
    return 0


def _sharding(leaf: LeafInfo) -> str:
    s = leaf.sharding
    if leaf.kind == "ndarray":
        return "host (numpy)"
    if not s:
        return "-"
    if "prng_impl" in s:
        return f"PRNG key ({s['prng_impl']})"
    if s.get("type") == "NamedSharding" and _is_mesh(s.get("mesh")) and _is_spec(s.get("spec")):
        mesh = ",".join(f"{k}={v}" for k, v in s["mesh"].items())
        spec = ",".join("None" if p is None else ("+".join(p) if isinstance(p, list) else p) for p in s["spec"])
        return f"mesh({mesh}) spec({spec})"
    if isinstance(s.get("type"), str) and type(s.get("devices")) is int:
        return f"{s['type']} on {s['devices']} device(s)"
    # The description is informational and comes from the manifest as is: anything of
    # another shape is shown as the JSON it is, never interpreted.
    return json.dumps(s, sort_keys=True)


def _is_mesh(mesh: Any) -> bool:
    return isinstance(mesh, dict) and all(type(v) is int for v in mesh.values())


def _is_spec(spec: Any) -> bool:
    def axis(p: Any) -> bool:
        return p is None or isinstance(p, str) or (isinstance(p, list) and all(isinstance(a, str) for a in p))

    return isinstance(spec, list) and all(axis(p) for p in spec)


def _value(v: Any, top: bool = True) -> Any:
    """A leaf's value as strict JSON holds it: a non-finite float leaf as its ``str``, one inside a
    ``Json`` document as the manifest stores it (``"NaN"``, ``"Infinity"``, ``"-Infinity"``)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v) if top else NON_FINITE[repr(v)]
    if isinstance(v, dict):
        return {k: _value(x, False) for k, x in v.items()}
    return [_value(x, False) for x in v] if isinstance(v, list) else v


def _leaf_doc(leaf: LeafInfo) -> dict[str, Any]:
    return {
        "path": leaf.path,
        "kind": leaf.kind,
        "dtype": leaf.dtype,
        "shape": list(leaf.shape) if leaf.shape is not None else None,
        "key_type": leaf.key_type,
        "nbytes": leaf.nbytes,
        "codec": leaf.codec,
        "sharding": leaf.sharding,
        "value": _value(leaf.value),
    }


def _info_doc(info: CheckpointInfo) -> dict[str, Any]:
    return {
        "url": info.url,
        "format": info.format,
        "format_version": info.format_version,
        "created": info.created,
        "save_id": info.save_id,
        "num_processes": info.num_processes,
        "total_bytes": info.total_bytes,
        "stored_bytes": info.stored_bytes,
        "num_blobs": info.num_blobs,
        "metadata": info.metadata,
        "bytes_from": info.bytes_from,
        "leaves": [_leaf_doc(leaf) for leaf in info.leaves.values()],
    }
