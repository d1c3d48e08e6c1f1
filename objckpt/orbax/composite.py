"""Orbax Composite checkpoints: a step directory of several named items, read item by item.

An Orbax ``CheckpointManager`` saving ``ocp.args.Composite(...)`` writes one
directory per item under the step and names each item's handler in the step's
``_CHECKPOINT_METADATA`` (``item_handlers``). objckpt reads three kinds:

* a PyTree item (``StandardCheckpointHandler``, ``PyTreeCheckpointHandler``):
  an :class:`~objckpt.orbax.layout.OrbaxItem`, restored as the subtree under
  the item's name;
* a JSON item (``JsonCheckpointHandler``, what ``ocp.args.JsonSave`` writes): one
  JSON file (``metadata`` unless the handler was given another name), restored
  as an :class:`objckpt.Json` item;
* grain's iterator item (``grain...CheckpointHandler``, what
  ``grain.PyGrainCheckpointSave`` writes): one file per process,
  ``process_<i>-of-<n>.json``, holding that process's iterator state; restored
  as an :class:`objckpt.PerProcess` item whose value is the file's bytes
  (what ``DataLoaderIterator.set_state`` takes; a dataset iterator takes
  ``json.loads`` of them, as grain's handler does).

Any other item is kept as :class:`UnreadableItem`: a restore or conversion that
needs it is a :class:`~objckpt.errors.FormatError` naming it and its handler,
while ``partial=True`` restores of the other items still work. The JSON
documents are read when the checkpoint is opened (``inspect`` shows them);
per-process files only when a restore asks for them. The manager's ``metrics``
item is left out, as for a single-item step.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from objckpt.core.items import PER_PROCESS_MAX_BYTES
from objckpt.errors import CheckpointNotFoundError, FormatError, ObjectNotFoundError
from objckpt.orbax.containment import check_local_item
from objckpt.orbax.layout import (
    METADATA_LIMIT,
    PYTREE_HANDLERS,
    OrbaxItem,
    array_processes,
    is_metrics_item,
    item_handlers,
    metadata_files,
    metadata_json,
    parse_item,
    read_item,
)
from objckpt.transfer import runtime

#: The file grain's handler writes for each process.
GRAIN_FILE = re.compile(r"^process_(\d{1,9})-of-(\d{1,9})\.json$")
#: Files Orbax writes in every item directory beside the item's own.
_ORBAX_FILES = ("commit_success.txt", "_CHECKPOINT_METADATA")


@dataclass(frozen=True)
class JsonItem:
    """A JSON item (``JsonCheckpointHandler``): its URL, file name and document."""

    url: str
    filename: str
    value: Any
    nbytes: int


@dataclass(frozen=True)
class PerProcessItem:
    """grain's per-process item: its URL, how many processes wrote it, each one's file and size."""

    url: str
    count: int
    files: tuple[str, ...]  # process i's file, relative to the item
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class UnreadableItem:
    """An item objckpt does not read: its URL, its handler, and why."""

    url: str
    handler: str
    why: str

    def error(self) -> FormatError:
        return FormatError(f"Orbax item {self.url} was written by {self.handler}: {self.why}")


Item = OrbaxItem | JsonItem | PerProcessItem | UnreadableItem


@dataclass(frozen=True)
class OrbaxComposite:
    """An Orbax Composite step: its URL, its items by name (sorted), when Orbax committed it."""

    url: str
    items: dict[str, Item] = field(default_factory=dict)
    created: str = ""

    def unreadable(self, names: Any = None) -> None:
        """Raise the FormatError of the first unreadable item among ``names`` (all items by default)."""
        for name in sorted(self.items if names is None else names):
            item = self.items.get(name)
            if isinstance(item, UnreadableItem):
                raise item.error()

    def per_process_count(self) -> int:
        """How many processes wrote the per-process items (1 when there are none).

        Raises:
            FormatError: two per-process items were written by different numbers of processes.
        """
        counts = {name: item.count for name, item in self.items.items() if isinstance(item, PerProcessItem)}
        if len(set(counts.values())) > 1:
            shown = ", ".join(f"{name}: {count}" for name, count in sorted(counts.items()))
            raise FormatError(
                f"Orbax checkpoint {self.url}: its per-process items disagree on the process count ({shown})"
            )
        return next(iter(counts.values()), 1)


def orbax_checkpoint_at(store: Any, parent: Any = None) -> OrbaxItem | OrbaxComposite | None:
    """What Orbax wrote at ``store``: one item, a Composite step, or None (nothing Orbax wrote)."""
    try:
        return runtime.run_sync(read_checkpoint(store, str(store.url), parent))
    except CheckpointNotFoundError:
        return None


async def read_checkpoint(store: Any, url: str, parent: Any = None) -> OrbaxItem | OrbaxComposite:
    """The Orbax item or Composite step at ``store`` (see :func:`~objckpt.orbax.layout.read_item`):
    a step with several items besides the metrics, none of them ``default``, is a Composite."""
    files = await metadata_files(store)
    if files.get("_METADATA") is None:
        handlers = item_handlers(url, files.get("_CHECKPOINT_METADATA"))
        names = sorted(k for k in handlers if not is_metrics_item(k, handlers[k]))
        if len(names) > 1 and "default" not in handlers:
            return await _read_composite(store, url, {k: handlers[k] for k in names}, files["_CHECKPOINT_METADATA"])
    return await read_item(store, url, parent, files)


async def _read_composite(store: Any, url: str, handlers: dict[str, str], step_meta: bytes | None) -> OrbaxComposite:
    items: dict[str, Item] = {}
    created = ""
    for name, handler in handlers.items():
        item_url = f"{url.rstrip('/')}/{name}"
        check_local_item(url, name)
        child = store.child(name)
        if handler.endswith(PYTREE_HANDLERS):
            pytree = parse_item(
                item_url,
                await metadata_files(child),
                step_metadata=step_meta,
                num_processes=await array_processes(child),
            )
            created = created or pytree.created
            items[name] = pytree
        elif handler.endswith("JsonCheckpointHandler"):
            items[name] = await _json_item(child, item_url, handler)
        elif handler.startswith("grain.") and handler.endswith("CheckpointHandler"):
            items[name] = await _grain_item(child, item_url)
        else:
            items[name] = UnreadableItem(
                item_url,
                handler,
                "objckpt reads an Orbax Composite's PyTree items (StandardSave, PyTreeSave), JSON items"
                " (JsonSave) and grain's iterator items (PyGrainCheckpointSave)",
            )
    return OrbaxComposite(url=url, items=items, created=created)


async def _listing(store: Any, url: str) -> dict[str, int]:
    """The item directory's files (name → size), Orbax's own markers left out."""
    try:
        listed = await store.list("")
    except (ObjectNotFoundError, FileNotFoundError):
        listed = []
    out = {info.key.rsplit("/", 1)[-1]: int(info.size) for info in listed if "/" not in info.key.strip("/")}
    if not out:
        raise FormatError(f"Orbax item {url} is empty (its step's metadata names it)")
    return {k: v for k, v in out.items() if k not in _ORBAX_FILES}


async def _json_item(store: Any, url: str, handler: str) -> JsonItem | UnreadableItem:
    """``JsonCheckpointHandler``'s one file: ``metadata``, or the only file there when it was given another name."""
    files = await _listing(store, url)
    name = "metadata" if "metadata" in files else next(iter(files)) if len(files) == 1 else None
    if name is None:
        return UnreadableItem(url, handler, f"a JSON item should hold one file, it holds {sorted(files) or 'none'}")
    if files[name] > METADATA_LIMIT:
        raise FormatError(f"{url}/{name} is {files[name]} bytes: over the {METADATA_LIMIT}-byte limit for a JSON item")
    data = await _read_listed(store, f"{url}/{name}", name, files[name])
    return JsonItem(url=url, filename=name, value=metadata_json(data, f"{url}/{name}"), nbytes=len(data))


async def _grain_item(store: Any, url: str) -> PerProcessItem:
    """grain's ``process_<i>-of-<n>.json`` files: every process of one count, each once.

    Raises:
        FormatError: no such file, files of two counts, a process's file missing, or one too large.
    """
    files = await _listing(store, url)
    found: dict[int, dict[int, str]] = {}
    for name in files:
        match = GRAIN_FILE.match(name)
        if match:
            found.setdefault(int(match[2]), {})[int(match[1])] = name
    if len(found) != 1:
        what = f"files of {len(found)} process counts ({', '.join(map(str, sorted(found)))})" if found else "none"
        raise FormatError(f"Orbax item {url}: grain writes one process_<i>-of-<n>.json per process; found {what}")
    count, by_process = next(iter(found.items()))
    beyond = sorted(p for p in by_process if p >= count)
    if count == 0 or beyond:
        name = by_process[beyond[0]] if beyond else next(iter(by_process.values()))
        raise FormatError(f"Orbax item {url}/{name}: a process index out of range 0..{count - 1}")
    if len(by_process) != count:  # the count is bounded by the files listed, not trusted to loop over
        missing = list(itertools.islice((p for p in range(count) if p not in by_process), 5))
        shown = ", ".join(map(str, missing)) + (", ..." if count - len(by_process) > len(missing) else "")
        raise FormatError(
            f"Orbax item {url}: grain's files of {count} processes lack process {shown}"
            f" ({len(by_process)} of them there, e.g. {by_process[min(by_process)]})"
        )
    names = tuple(by_process[p] for p in range(count))
    sizes = tuple(files[n] for n in names)
    for name, size in zip(names, sizes, strict=True):
        if size > PER_PROCESS_MAX_BYTES:
            raise FormatError(f"Orbax item {url}/{name} is {size} bytes, over the {PER_PROCESS_MAX_BYTES}-byte cap")
    return PerProcessItem(url=url, count=count, files=names, sizes=sizes)


async def read_process_values(store: Any, item: PerProcessItem, processes: list[int]) -> list[bytes]:
    """The files of ``processes`` of ``item`` (``store`` at the item), in that order.

    Raises:
        FormatError: a file's size changed since it was listed (the checkpoint changed under us).
    """
    return [await _read_listed(store, f"{item.url}/{item.files[p]}", item.files[p], item.sizes[p]) for p in processes]


async def _read_listed(store: Any, url: str, key: str, size: int) -> bytes:
    """The object ``key`` listed as ``size`` bytes, reading at most one byte more.

    Raises:
        FormatError: its size is not the listed one (the checkpoint changed under us).
    """
    data = bytes(await store.get_range(key, start=0, end=size + 1))
    if len(data) != size:
        shown = f"over {size}" if len(data) > size else str(len(data))
        raise FormatError(f"Orbax item {url}: {shown} bytes, listed as {size}")
    return data
