"""An Orbax Composite step, opened: restore, inspect and verify it item by item.

A Composite restores into a dict keyed by item name, as objckpt's own
checkpoints of ``{"state": ..., "config": objckpt.Json(...), "data":
objckpt.PerProcess(...)}`` do: a PyTree item's subtree through
:func:`~objckpt.orbax.restore.restore_orbax` (any target, any mesh), a JSON item's
document, a grain item's file of this process. Targets mean what they mean
natively: ``objckpt.Json()`` / ``objckpt.PerProcess()`` (or ``None``) stand for
what was saved, ``objckpt.PerProcess(all=True)`` asks for every process's value in
process order, a :class:`objckpt.Stateful` object (or one inside the marker) gets
``load_state_dict``; a per-process item restored on another number of processes
than wrote it is a :class:`~objckpt.errors.TargetMismatchError` naming the item
and both counts. With ``partial=True`` a target naming only some items reads
nothing of the others (no array bytes for ``{"config": objckpt.Json()}``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from objckpt.core.items import Json, PerProcess, is_item, load_into
from objckpt.errors import TargetMismatchError
from objckpt.layouts.base import CheckpointInfo, LeafInfo, VerifyProblem, VerifyReport
from objckpt.options import Options
from objckpt.orbax.composite import (
    JsonItem,
    OrbaxComposite,
    PerProcessItem,
    UnreadableItem,
    read_process_values,
)
from objckpt.orbax.layout import OrbaxItem
from objckpt.progress import ProgressArg
from objckpt.transfer import runtime
from objckpt.transfer.retries import opened_store
from objckpt.transfer.stats import TransferStats

#: The layout's name, as its readers report it (``CheckpointInfo.format``, ``VerifyReport.format``).
FORMAT = "orbax"


class OrbaxCompositeReader:
    """One Orbax Composite step: what ``inspect``, ``verify`` and ``restore`` do with it."""

    format = FORMAT
    version = 0

    def __init__(self, composite: OrbaxComposite, storage_options: dict[str, Any] | None, options: Options) -> None:
        self.composite = composite
        self.storage_options = storage_options
        self.options = options

    @property
    def url(self) -> str:
        """The step's URL."""
        return self.composite.url

    def restore(self, target: Any, *, partial: bool, options: Options, stats: TransferStats, cast: str) -> Any:
        """The items' dict, or the ``target``'s part of it (arguments as :func:`objckpt.restore`'s)."""
        started = time.perf_counter()
        composite = self.composite
        chosen = _select(composite, target, partial)
        composite.unreadable(chosen)
        out: dict[str, Any] = {}
        for name, wanted in chosen.items():
            item = composite.items[name]
            if isinstance(item, OrbaxItem):
                from objckpt.orbax.restore import restore_orbax

                out[name] = restore_orbax(
                    item,
                    wanted,
                    storage_options=self.storage_options,
                    partial=partial,
                    options=options,
                    stats=stats,
                    cast=cast,
                )
            elif isinstance(item, JsonItem):
                import copy

                out[name] = load_into(wanted, copy.deepcopy(item.value))
            elif isinstance(item, PerProcessItem):
                out[name] = load_into(wanted, self._per_process(name, item, wanted, options, stats))
        stats.seconds = time.perf_counter() - started
        return out

    def _per_process(
        self, name: str, item: PerProcessItem, target: Any, options: Options, stats: TransferStats
    ) -> bytes | list[bytes]:
        import jax  # here, not at import: objckpt's CLI reads checkpoints without JAX

        every = type(target) is PerProcess and target.all
        if not every and jax.process_count() != item.count:
            raise TargetMismatchError(
                f"item {name!r} ({item.url}): a per-process item saved by {item.count} processes, restored on"
                f" {jax.process_count()}; ask for every process's value with objckpt.PerProcess(all=True) and"
                " re-split it"
            )
        processes = list(range(item.count)) if every else [jax.process_index()]
        with opened_store(item.url, self.storage_options, options, stats) as store:
            values = runtime.run_sync(read_process_values(store, item, processes))
        return values if every else values[0]

    def info(self) -> CheckpointInfo:
        """Every item's leaves under its name: a PyTree's arrays (from their zarr headers),
        a JSON item's document, a grain item's file sizes by process."""
        import jax  # here, not at import: objckpt's CLI reads checkpoints without JAX

        tree: dict[str, Any] = {}
        leaves: dict[str, LeafInfo] = {}
        total = 0
        processes = 1
        for name, item in self.composite.items.items():
            prefix = f"[{name!r}]"
            if isinstance(item, OrbaxItem):
                from objckpt.orbax.inspect import inspect_orbax

                sub = inspect_orbax(item, self.storage_options, self.options)
                renamed = {path: dataclasses.replace(info, path=prefix + path) for path, info in sub.leaves.items()}
                tree[name] = jax.tree.map(renamed.__getitem__, _paths(sub.tree), is_leaf=lambda x: isinstance(x, str))
                leaves.update({info.path: info for info in renamed.values()})
                total += sub.total_bytes
                processes = max(processes, sub.num_processes)
                continue
            if isinstance(item, JsonItem):
                info = LeafInfo(prefix, "json", None, None, 0, None, item.value)
            elif isinstance(item, PerProcessItem):
                info = LeafInfo(prefix, "per_process", None, None, 0, None, list(item.sizes))
                processes = max(processes, item.count)
            else:
                info = LeafInfo(prefix, "unreadable", None, None, 0, None, item.handler)
            tree[name] = info
            leaves[prefix] = info
        return CheckpointInfo(
            url=self.composite.url,
            tree=tree,
            leaves=leaves,
            total_bytes=total,
            num_blobs=0,
            format_version=0,
            created=self.composite.created,
            save_id="",
            num_processes=processes,
            metadata={},
            format=FORMAT,
        )

    def verify(self, options: Options, stats: TransferStats, progress: ProgressArg) -> VerifyReport:
        """Every PyTree item's chunks read and decoded, every grain file read; an unreadable item is a problem."""
        from objckpt.orbax.verify import CHECKS, verify_orbax

        started = time.perf_counter()
        report = VerifyReport(
            url=self.composite.url, format=FORMAT, checks=CHECKS + "; JSON and per-process files read"
        )
        for name, item in self.composite.items.items():
            if isinstance(item, OrbaxItem):
                sub = verify_orbax(item, self.storage_options, options, stats, progress)
                report.problems.extend(sub.problems)
                report.arrays += sub.arrays
            elif isinstance(item, PerProcessItem):
                try:
                    with opened_store(item.url, self.storage_options, options, stats) as store:
                        runtime.run_sync(read_process_values(store, item, list(range(item.count))))
                except Exception as exc:  # noqa: BLE001 (every failure is a problem to report)
                    report.problems.append(VerifyProblem("unreadable", name, f"item {item.url}: {exc}"))
            elif isinstance(item, UnreadableItem):
                report.problems.append(VerifyProblem("unreadable", name, str(item.error())))
        report.bytes_read, report.requests, report.retries = stats.bytes_read, stats.requests, stats.retries
        report.seconds = time.perf_counter() - started
        return report


def _paths(tree: Any) -> Any:
    """``tree`` with each :class:`LeafInfo` replaced by its path."""
    import jax  # here, not at import: objckpt's CLI reads checkpoints without JAX

    return jax.tree.map(lambda info: info.path, tree, is_leaf=lambda x: isinstance(x, LeafInfo))


def _select(composite: OrbaxComposite, target: Any, partial: bool) -> dict[str, Any]:
    """The items to restore, each with its target (None: what was saved).

    Raises:
        TargetMismatchError: the target is no dict keyed by item name, names an item the step
            lacks, leaves one out without ``partial``, or asks an item for another kind.
    """
    names = sorted(composite.items)
    if target is None:
        return dict.fromkeys(names)
    if not isinstance(target, dict):
        raise TargetMismatchError(
            f"the Orbax Composite checkpoint {composite.url} restores into a dict keyed by item name"
            f" ({', '.join(names)}); the target is a {type(target).__name__}"
        )
    missing = [f"[{k!r}]" for k in target if k not in composite.items]
    unnamed = [f"[{k!r}]" for k in names if k not in target]
    from objckpt.core.tree import check_names  # imports JAX: not at import (the CLI reads without it)

    check_names(missing, unnamed, partial=partial, what=f"the Orbax Composite checkpoint {composite.url}")
    for name, wanted in target.items():
        _check_kind(name, composite.items[name], wanted)
    return {name: target[name] for name in names if name in target}


def _check_kind(name: str, item: Any, target: Any) -> None:
    """Refuse a target asking an item for what it is not (a PyTree item for a ``Json()``, ...)."""
    if target is None or isinstance(item, UnreadableItem):
        return
    if isinstance(item, OrbaxItem):
        ok, saved = not is_item(target), "a PyTree item"
    elif isinstance(item, JsonItem):
        ok, saved = type(target) is Json or (is_item(target) and type(target) is not PerProcess), "a JSON item"
    else:
        ok, saved = type(target) is PerProcess, "a per-process item"
    if not ok:
        asked = type(target).__name__ if is_item(target) else f"a {type(target).__name__} subtree"
        raise TargetMismatchError(f"item {name!r}: saved {saved}, the target asks for {asked}")
