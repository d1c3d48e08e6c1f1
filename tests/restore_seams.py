"""Restore driven through its seams, for tests of its internals.

:func:`restore_with` runs restore's own steps (plan each leaf, plan the reads,
fetch them into a :class:`~objckpt.restoring.landing.Landing`, or the test's
subclass of it) on a store object the test passes in, with the landing's
:class:`HostMemory` and :class:`Devices` and the plans' ``whole_leaf_bytes``
as the test chooses: no module attribute is patched. :class:`StreamingStore` is a store wrapper that
streams reads in small pieces and records them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from objckpt.core.format import ARRAY_KINDS, Manifest
from objckpt.layouts.manifest_io import read_indexes, read_manifest
from objckpt.options import Options
from objckpt.restoring.fetch import fetch, plan
from objckpt.restoring.landing import Devices, HostMemory, Landing
from objckpt.restoring.leaf_plan import WHOLE_LEAF_BYTES, LeafPlan, plan_leaf
from objckpt.storage.streaming import ReadSink, feed
from objckpt.transfer import runtime
from objckpt.transfer.buffers import tune_malloc
from objckpt.transfer.handle import Handle
from objckpt.transfer.stats import TransferStats


class StreamingStore:
    """``inner`` (an open store), made to stream its reads ``piece`` bytes at a time.

    Every streamed read is recorded in :attr:`calls` as (key, start, end); ``before``,
    when given, is awaited first with (store, key, start, end, sink) and may
    raise (a connection dropped mid-body).
    """

    streams_reads = True
    reads_in_place = False

    def __init__(
        self,
        inner: Any,
        *,
        piece: int = 1024,
        before: Callable[[Any, str, int, int, ReadSink], Awaitable[None]] | None = None,
    ) -> None:
        self.inner = inner
        self.piece = piece
        self.before = before
        self.calls: list[tuple[str, int, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get_range_streamed(self, key: str, *, start: int, end: int, sink: ReadSink) -> int:
        self.calls.append((key, start, end))
        if self.before is not None:
            await self.before(self, key, start, end, sink)
        data = await self.inner.get_range_buffer(key, start=start, end=end)
        return feed(sink, data, length=end - start, limit=self.piece)


def restore_with(
    store: Any,
    target: dict[str, Any],
    *,
    options: Options | None = None,
    stats: TransferStats | None = None,
    memory: HostMemory | None = None,
    devices: Devices | None = None,
    whole_leaf_bytes: int = WHOLE_LEAF_BYTES,
    landing: Callable[..., Landing] = Landing,
    replan: Callable[[LeafPlan], LeafPlan] | None = None,
) -> dict[str, Any]:
    """The leaves ``target`` names (by path, as ``manifest.leaves`` spells them), restored from ``store``.

    ``replan``, when given, turns each leaf's plan into the one used (a test's plan).
    """
    options = options or Options()
    stats = stats if stats is not None else TransferStats()
    if options.tune_malloc:
        tune_malloc()
    manifest = _as_a_restore_reads(store)
    index = {leaf.path: i for i, leaf in enumerate(manifest.leaves)}
    plans = {
        index[path]: plan_leaf(manifest.leaves[index[path]], t, whole_leaf_bytes=whole_leaf_bytes)
        for path, t in target.items()
        if manifest.leaves[index[path]].kind in ARRAY_KINDS
    }
    if replan is not None:
        plans = {i: replan(p) for i, p in plans.items()}
    landed = landing(plans, memory=memory, devices=devices)
    landed.reserve_arena()
    requests = plan(manifest, plans, options, streamed=store.streams_reads)
    runtime.run_sync(fetch(Handle.of(store, options, stats), requests, landed))
    return {manifest.leaves[i].path: value for i, value in landed.results()}


def _as_a_restore_reads(store: Any, size_limit: int = 1 << 30) -> Manifest:
    """The root and every index object, read as a restore reads them: rows in columns, boxes interned."""

    async def read() -> Manifest:
        manifest = await read_manifest(store, size_limit=size_limit)
        every = range(len(manifest.indexes))
        return (await read_indexes(store, manifest, every, size_limit=size_limit, columnar=True)).in_columns()

    return runtime.run_sync(read())


def paths(tree: dict[str, Any]) -> dict[str, Any]:
    """A flat dict's entries keyed by leaf path as the manifest spells them (``['name']``)."""
    return {f"['{k}']": v for k, v in tree.items()}
