"""Convert an Orbax Composite step into one native objckpt checkpoint.

The step becomes one tree keyed by item name: the PyTree item's arrays,
scalars and strings under its name (converted slab by slab as a single item
is: :mod:`objckpt.orbax.convert`), each JSON item as a ``json`` leaf (the
document inline in the root manifest), each grain item as a ``per_process`` leaf
holding every process's file. A native ``per_process`` leaf lists one value per
saving process, each inside a blob that process wrote (the root's
``num_processes`` of them); so for an item that N processes wrote, the converting
process writes process 0's value with the arrays and, for each other process, one
small blob with that process's values and an index object naming it, as that
process would have (:attr:`objckpt.saving.writer.Source.other_parts`). The commit then lists N processes: a restore of the
converted checkpoint on N processes gives each its own value, on another count
the same :class:`~objckpt.errors.TargetMismatchError` as a native save.

One PyTree item per step is converted (several: each converts on its own,
``<step>/<item>``); an item objckpt cannot read is a
:class:`~objckpt.errors.FormatError` naming it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from objckpt.core.format import LeafEntry
from objckpt.core.items import json_document
from objckpt.core.plan import OwnedPiece
from objckpt.errors import CoordinationError, FormatError
from objckpt.multihost import Coordinator
from objckpt.orbax.composite import JsonItem, OrbaxComposite, PerProcessItem, read_process_values
from objckpt.orbax.layout import OrbaxItem
from objckpt.transfer import runtime
from objckpt.transfer.retries import opened_store


@dataclass
class CompositeParts:
    """What a Composite step adds to the conversion of its PyTree item: the other items, by name."""

    url: str
    under: str | None  # the PyTree item's name; None when the step has none
    documents: dict[str, Any] = field(default_factory=dict)  # JSON items
    values: dict[str, list[bytes]] = field(default_factory=dict)  # grain items: each process's file
    count: int = 1  # processes that wrote the per-process items

    def tree(self, pytree: Any) -> dict[str, Any]:
        """The converted tree's skeleton: the PyTree item under its name, the other items as leaves."""
        out: dict[str, Any] = dict.fromkeys([*self.documents, *self.values])
        if self.under is not None:
            out[self.under] = pytree
        return out

    def prefix(self) -> str:
        """The PyTree item's leaves' path prefix in the converted tree."""
        return "" if self.under is None else f"[{self.under!r}]"

    def entry(self, path: str) -> LeafEntry:
        """The leaf entry of the item at ``path`` (``['<name>']``), as process 0 saves it."""
        name = path[2:-2]
        if name in self.documents:
            return LeafEntry(path, "json", value=json_document(self.documents[name], path)[0])
        return LeafEntry(path, "per_process", value={"encoding": "bytes", "length": len(self.values[name][0])})

    def pieces(self, flat: list[Any], process: int) -> list[OwnedPiece]:
        """``process``'s per-process values as pieces (an empty value has none)."""
        out = []
        for i, leaf in enumerate(flat):
            data = self.values.get(leaf.path[2:-2]) if leaf.path.startswith("['") else None
            if data is not None and data[process]:
                raw = np.frombuffer(data[process], dtype=np.uint8)
                out.append(OwnedPiece(i, (0,), (raw.size,), 1, source=(raw, (0,))))
        return out

    def other_parts(
        self, flat: list[Any], entries: list[LeafEntry]
    ) -> Iterator[tuple[int, list[LeafEntry], list[OwnedPiece]]]:
        """For each process but 0 of the per-process items: its leaf table (its own values'
        lengths) and its values as pieces, for the writing corridor to write as that process's
        own save would (:attr:`objckpt.saving.writer.Source.other_parts`)."""
        for process in range(1, self.count):
            own = [
                replace(e, value={"encoding": "bytes", "length": len(self.values[e.path[2:-2]][process])})
                if e.kind == "per_process"
                else e
                for e in entries
            ]
            yield process, own, self.pieces(flat, process)

    def identity(self) -> str:
        """What, beside the PyTree item, makes the save id (a rerun on the same source gets the same)."""
        digest = hashlib.sha256(self.url.encode())
        for name, doc in sorted(self.documents.items()):
            digest.update(f"\n{name}={json_document(doc, name)[1]!r}".encode())
        for name, values in sorted(self.values.items()):
            digest.update(f"\n{name}:".encode() + b"\0".join(values))
        return digest.hexdigest()


def composite_parts(
    composite: OrbaxComposite, storage_options: dict[str, Any] | None, options: Any
) -> tuple[OrbaxItem, CompositeParts]:
    """The PyTree item to convert (an empty one when the step has none) and the rest of the step.

    Raises:
        FormatError: an item objckpt cannot read, several PyTree items, or per-process
            items of different process counts.
    """
    composite.unreadable()
    pytrees = sorted(n for n, item in composite.items.items() if isinstance(item, OrbaxItem))
    if len(pytrees) > 1:
        raise FormatError(
            f"Orbax Composite checkpoint {composite.url} holds several PyTree items ({', '.join(pytrees)}): convert"
            " converts one per step; convert each (<step>/<item>) or restore the step and save it"
        )
    parts = CompositeParts(url=composite.url, under=pytrees[0] if pytrees else None)
    parts.count = composite.per_process_count()
    for name, item in composite.items.items():
        if isinstance(item, JsonItem):
            parts.documents[name] = item.value
        elif isinstance(item, PerProcessItem):
            with opened_store(item.url, storage_options, options) as store:
                parts.values[name] = runtime.run_sync(read_process_values(store, item, list(range(item.count))))
    if pytrees:
        pytree = composite.items[pytrees[0]]
        assert isinstance(pytree, OrbaxItem)
        return pytree, parts
    empty = OrbaxItem(url=composite.url, leaves=[], use_ocdbt=False, use_zarr3=False, created=composite.created)
    return empty, parts


def check_one_process(parts: CompositeParts, current: Coordinator) -> int:
    """The processes the converted checkpoint lists when they are those that wrote the
    per-process items (0: the job's), once sure that one process converts.

    Raises:
        CoordinationError: the conversion runs in several processes while the items have several.
    """
    if parts.count != 1 and current.process_count != 1:
        raise CoordinationError(
            f"converting {parts.url} (per-process items of {parts.count} processes) runs in one process,"
            f" not {current.process_count}"
        )
    return parts.count if parts.count > 1 else 0
