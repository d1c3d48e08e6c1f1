"""What an export writes, decided before any byte moves (pure: no I/O).

Tensor names default to a leaf's keys joined with ``.`` (``params.layers.0.w``,
what Hugging Face checkpoints call their weights); ``subtree`` exports the
leaves under one such prefix, named relative to it; ``names`` renames (a
mapping) or renames and drops (a function returning ``None``). Tensors keep
the checkpoint's leaf order and are packed into files of at most
``max_shard_bytes`` (a tensor larger than that gets a file of its own), named
as Hugging Face names them: ``model.safetensors`` alone, or
``model-00001-of-00003.safetensors`` ... with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from objckpt.core.format import ARRAY_KINDS, LeafEntry
from objckpt.errors import FormatError
from objckpt.safetensors.header import DTYPE_TO_ST, METADATA_KEY

#: The one file of an export that fits one shard.
SINGLE_FILE = "model.safetensors"
#: The index of a sharded export.
INDEX_FILE = "model.safetensors.index.json"

Names = Mapping[str, str] | Callable[[str], str | None] | None


@dataclass(frozen=True)
class ExportTensor:
    """One leaf as a tensor of the export.

    Attributes:
        leaf: the leaf's index in the checkpoint's manifest.
        path: the leaf's path (``['params']['w']``).
        name: the tensor's name in the export.
        dtype: the dtype written (objckpt's name: ``bfloat16``).
        shape: the leaf's shape.
    """

    leaf: int
    path: str
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        from objckpt.safetensors.header import numpy_dtype

        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize


def dotted_names(skeleton: dict[str, Any], count: int) -> list[str]:
    """Each leaf's keys joined with ``.``, by leaf index, from a manifest's tree skeleton."""
    names = [""] * count
    stack: list[tuple[dict[str, Any], tuple[str, ...]]] = [(skeleton, ())]
    while stack:
        node, keys = stack.pop()
        kind = node.get("t")
        if kind == "leaf":
            index = node.get("i")
            if isinstance(index, int) and 0 <= index < count:
                names[index] = ".".join(keys)
            continue
        children = node.get("c") or []
        labels = list(range(len(children))) if kind in ("list", "tuple") else list(node.get("k") or [])
        for label, child in zip(labels, children, strict=False):
            stack.append((child, (*keys, str(label))))
    return names


def choose_tensors(
    leaves: list[LeafEntry], default_names: list[str], *, subtree: str | None, names: Names, dtype: str | None
) -> list[ExportTensor]:
    """The tensors an export writes, in leaf order.

    Raises:
        FormatError: a chosen leaf safetensors cannot hold (not an array, or a dtype it
            lacks), two leaves given one name, a name the header reserves, a ``names``
            mapping key that names no leaf, or nothing to export.
    """
    prefix = None if not subtree else subtree.strip(".") + "."
    unused = set(names) if isinstance(names, Mapping) else set()
    chosen: list[ExportTensor] = []
    taken: dict[str, str] = {}
    for i, (leaf, default) in enumerate(zip(leaves, default_names, strict=True)):
        if prefix is not None:
            if not default.startswith(prefix):
                continue
            default = default[len(prefix) :]
        name = _rename(default, names, unused)
        if name is None:
            continue
        if not isinstance(name, str) or not name or name == METADATA_KEY:
            raise FormatError(f"leaf {leaf.path}: tensor name {name!r} is not one a safetensors file can hold")
        if leaf.kind not in ARRAY_KINDS or leaf.kind in ("str", "bytes") or leaf.shape is None:
            raise FormatError(
                f"leaf {leaf.path} ({leaf.kind}) is not an array: safetensors cannot hold it"
                " (export a subtree without it, or drop it with names=)"
            )
        if leaf.prng_impl is not None:
            raise FormatError(f"leaf {leaf.path} holds PRNG keys: safetensors cannot hold them")
        if leaf.dtype not in DTYPE_TO_ST:
            raise FormatError(
                f"leaf {leaf.path}: dtype {leaf.dtype} has no safetensors dtype"
                f" (those are {', '.join(sorted(DTYPE_TO_ST))})"
            )
        if name in taken:
            raise FormatError(f"leaves {taken[name]} and {leaf.path} are both named {name!r}")
        taken[name] = leaf.path
        out_dtype = _out_dtype(leaf, dtype)
        chosen.append(ExportTensor(i, leaf.path, name, out_dtype, tuple(leaf.shape)))
    if unused:
        raise FormatError(f"names= renames {', '.join(sorted(unused))}, which name no exported leaf")
    if not chosen:
        raise FormatError("nothing to export: no leaf" + (f" under {subtree!r}" if subtree else ""))
    return chosen


def _rename(default: str, names: Names, unused: set[str]) -> str | None:
    if names is None:
        return default
    if isinstance(names, Mapping):
        unused.discard(default)
        return names.get(default, default)
    return names(default)


def _out_dtype(leaf: LeafEntry, dtype: str | None) -> str:
    """The dtype a leaf is written in: ``dtype`` for a floating leaf when given, else its own."""
    assert leaf.dtype is not None
    if dtype is None or not _is_float(leaf.dtype):
        return leaf.dtype
    if dtype not in DTYPE_TO_ST or not _is_float(dtype):
        raise FormatError(f"dtype={dtype!r} is not a floating safetensors dtype")
    return dtype


def _is_float(name: str) -> bool:
    return name.startswith(("float", "bfloat"))


def plan_shards(tensors: list[ExportTensor], max_shard_bytes: int) -> list[list[ExportTensor]]:
    """The tensors cut into files of at most ``max_shard_bytes`` of tensor data, in order."""
    shards: list[list[ExportTensor]] = []
    size = 0
    for t in tensors:
        if not shards or size + t.nbytes > max_shard_bytes:
            if not shards or shards[-1]:
                shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return [s for s in shards if s]


def file_names(count: int) -> list[str]:
    """The files of an export of ``count`` shards, as Hugging Face names them."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def index_document(shards: list[list[ExportTensor]], files: list[str]) -> bytes:
    """``model.safetensors.index.json``: ``metadata.total_size`` and each tensor's file."""
    weight_map = {t.name: f for shard, f in zip(shards, files, strict=True) for t in shard}
    total = sum(t.nbytes for shard in shards for t in shard)
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2) + "\n").encode()


def nested(values: Mapping[str, Any], *, strip: str = "") -> dict[str, Any]:
    """Tensors by ``.``-joined name as nested dicts; flat by name where one name is another's prefix."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        keys = name[len(strip) :].split(".")
        node = out
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                return {name[len(strip) :]: v for name, v in values.items()}
            node = child
        if keys[-1] in node:
            return {name[len(strip) :]: v for name, v in values.items()}
        node[keys[-1]] = value
    return out
