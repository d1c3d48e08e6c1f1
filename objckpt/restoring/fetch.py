"""Planned reads → checked bytes in the leaves' host buffers: a restore's data path.

:func:`plan` turns the pieces each leaf's plan reads into coalesced ranged reads;
:func:`fetch` runs them through the operation's :class:`~objckpt.transfer.engine.TransferEngine`
as a sliding window under the memory budget, each landing as its mode says
(:func:`~objckpt.restoring.modes.landing_mode`, decided once per read): streamed
into its boxes as it arrives (:mod:`objckpt.restoring.scatter`), or read whole and
landed (:meth:`~objckpt.restoring.landing.Landing.land`), a piece whose bytes
arrive aligned becoming its box's buffer without a copy. Every piece is checked
against its crc32c (and its SHA-256, when the checkpoint has digests) before it
counts; a mismatch is read again, and with replicas, damage that persists is read
at the next location.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

import numpy as np

from objckpt.core.format import Manifest
from objckpt.core.format.rows import LeafPieces, Rows
from objckpt.core.plan import ReadRequest
from objckpt.core.plan_rows import plan_row_reads
from objckpt.errors import IntegrityError
from objckpt.options import Options
from objckpt.restoring.aligned_reads import ResponseAlignment, read_aligned
from objckpt.restoring.landing import Landing
from objckpt.restoring.leaf_plan import LeafPlan
from objckpt.restoring.locations import failover_of
from objckpt.restoring.modes import Mode, landing_mode
from objckpt.restoring.scatter import stream_read
from objckpt.transfer.engine import AsyncByteBudget
from objckpt.transfer.handle import Handle
from objckpt.transfer.retries import reread_on_mismatch


def plan(manifest: Manifest, plans: Mapping[int, LeafPlan], options: Options, *, streamed: bool) -> list[ReadRequest]:
    """The coalesced reads for ``plans`` (pure); ``streamed``: the store streams copied reads.

    Every version's pieces are rows of one :class:`Rows` by now (:meth:`Manifest.in_columns`),
    planned with numpy in one pass over every wanted row (:func:`objckpt.core.plan_rows.plan_row_reads`):
    which rows are wanted, and which of them are kept (each one exactly the box it fills).
    """
    rows = _rows_of(manifest)
    if rows is None:
        return []
    wanted = np.zeros(len(rows), dtype=bool)
    kept = np.zeros(len(rows), dtype=bool)
    whole_ids: dict[int, np.ndarray] = {}  # per piece-box meeting (shared by a layer stack): the box ids kept
    for p in plans.values():
        pieces = p.pieces
        if not pieces:
            continue
        if not isinstance(pieces, LeafPieces) or pieces.rows is not rows:
            raise TypeError(f"leaf {p.entry.path}'s pieces are not rows of its manifest's (Manifest.in_columns)")
        wanted[pieces.at] = True
        if p.places_boxes and not p.casts:
            key = id(p.box_pieces)
            ids = whole_ids.get(key)
            if ids is None:
                ids = whole_ids[key] = rows.boxes.ids_of(box for box, n in p.box_pieces.items() if n == 1)
            kept[pieces.at[np.isin(pieces.box_ids, ids)]] = True
    return plan_row_reads(
        rows,
        wanted,
        coalesce_gap=options.coalesce_gap,
        max_read_size=options.copied_read_limit(streamed=streamed),
        kept=kept,
        max_kept_read_size=options.read_chunk,
    )


def _rows_of(manifest: Manifest) -> Rows | None:
    """The one :class:`Rows` every piece of ``manifest`` is a row of (None: it has no pieces)."""
    found = {id(leaf.pieces.rows): leaf.pieces.rows for leaf in manifest.leaves if isinstance(leaf.pieces, LeafPieces)}
    if any(leaf.pieces and not isinstance(leaf.pieces, LeafPieces) for leaf in manifest.leaves) or len(found) > 1:
        raise TypeError("a restore plans from a manifest whose pieces are rows of one Rows (Manifest.in_columns)")
    return next(iter(found.values()), None)


async def fetch(handle: Handle, requests: list[ReadRequest], landing: Landing) -> None:
    """Run ``requests`` with ``handle``'s engine, landing each in ``landing``; every leaf is finished after."""
    store, engine, options = handle.bulk, handle.engine, handle.options
    plans = landing.plans
    for i in landing.start():
        await asyncio.to_thread(landing.finish_unread, i)

    # Reads start early to land aligned only where an aligned piece can become a device
    # array without a copy: leaves placed on the CPU backend (LeafPlan.on_host).
    on_cpu = any(p.places_boxes and p.on_host for p in plans.values())
    alignment = ResponseAlignment.of(store) if on_cpu else ResponseAlignment(None)
    # An adopted read is not memory above the restored arrays on the CPU backend (the
    # client fills its buffer in place and it becomes the array), so only copied reads,
    # and adopted ones bound for an accelerator, count against the window;
    # max_concurrency still bounds the requests in flight. Streamed reads are
    # scattered as they arrive and hold a few MiB each, not their length: a window
    # of their own bounds them (Options.streamed_window: enough bytes to cover each
    # read's wait for its first byte, few enough threads scattering at once to keep
    # them from contending for the GIL).
    traits = {"streams_reads": handle.traits.streams_reads, "reads_in_place": handle.traits.reads_in_place}
    modes = {id(r): landing_mode(r, plans, **traits) for r in requests}
    window = min(options.read_window, options.memory_budget)
    streaming = AsyncByteBudget(options.streamed_window)
    url = store.url

    def check_length(request: ReadRequest, got: int) -> None:
        if got != request.length:
            paths = sorted({plans[p.leaf].entry.path for p in request.parts})
            raise IntegrityError(
                f"blob {url}/{request.blob} is truncated: asked bytes [{request.start}, {request.end}),"
                f" got {got} (leaves {', '.join(paths)})"
            )

    parallel = options.max_concurrency  # sub-range GETs of one long read at once

    async def read_streamed(request: ReadRequest) -> None:
        got = await stream_read(engine, request, landing, url, options.read_chunk, parallel=parallel)
        check_length(request, got)

    async def read_and_land(request: ReadRequest) -> None:
        data = await read_aligned(engine, request, options.read_chunk, alignment, parallel=parallel)
        check_length(request, len(data))
        await asyncio.to_thread(landing.land, request, data, url)

    failover = failover_of(store)

    async def checked(read: Callable[[], Awaitable[None]]) -> None:
        # A checksum mismatch reads the request again (bits flipped in flight); both
        # ways of landing it rewrite the same bytes and count it done only once checked.
        # Damage that persists is at rest: with replicas, the next location reads it.
        async def here() -> None:
            await reread_on_mismatch(read, reads=options.retry.checksum_reads, stats=engine.stats)

        await (here() if failover is None else failover.elsewhere_if_damaged(here))

    async def one(request: ReadRequest) -> None:
        mode = modes[id(request)]
        request = request.built()  # its parts, built once for the read (LazyParts builds them on demand)
        if mode is Mode.STREAMED:
            held = await streaming.acquire(request.length)
            try:
                await checked(lambda: read_streamed(request))
            finally:
                await streaming.release(held)
            await asyncio.to_thread(landing.count, request)
            return
        await checked(lambda: read_and_land(request))

    # An adopted read bound for an accelerator is memory above the restored arrays too: its
    # buffer lives until device_put has copied it to the device.
    to_devices = not all(p.on_host for p in plans.values())

    def held(request: ReadRequest) -> int:  # bytes of a read that holds a buffer of its length
        mode = modes[id(request)]
        if mode is Mode.ADOPTED and to_devices:
            return 0 if all(plans[p.leaf].on_host for p in request.parts) else request.length
        return request.length if mode is Mode.COPIED else 0

    await engine.for_each(requests, one, window_bytes=window, size=held)
