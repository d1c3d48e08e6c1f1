"""Ordered, bounded, lazy parallel runs: :func:`run_in_order`.

The sub-range reads of one long read (a restore's aligned or streamed reads, verify's
whole-blob reads) start in order, a few at a time, and stop at the first short one,
so a blob shorter than its manifest declares costs only the reads that find it out.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
Item = TypeVar("Item")


async def run_in_order(
    items: Iterable[Item],
    fn: Callable[[Item], Awaitable[T]],
    *,
    parallel: int,
    last: Callable[[Item, T], bool],
) -> list[T]:
    """``fn`` over ``items`` with at most ``parallel`` running at once, started in order
    and drawn from ``items`` lazily; their results in order.

    Stops drawing once ``last(item, result)`` is true of a finished one (what was
    already started still runs to its end, and is returned). Why lazily: the
    sub-ranges of a read are derived from a length the manifest declares, and a
    hostile one declares petabytes; only the sub-ranges actually read exist
    (the first one that comes back short, from a blob shorter than declared,
    ends it). The first error cancels the rest, waits for them, and is raised.
    """
    source = iter(items)
    running: deque[tuple[Item, asyncio.Future[T]]] = deque()
    results: list[T] = []
    ended = False
    try:
        while True:
            while not ended and len(running) < parallel:
                item = next(source, _END)
                if item is _END:
                    ended = True
                    break
                running.append((item, asyncio.ensure_future(fn(item))))
            if not running:
                return results
            item, future = running[0]
            await _first_done_or_failed(future, [f for _, f in running])
            running.popleft()
            result = future.result()
            results.append(result)
            ended = ended or last(item, result)
    finally:
        futures = [future for _, future in running]
        for future in futures:
            future.cancel()  # nothing for those already done
        if futures:
            await asyncio.gather(*futures, return_exceptions=True)


async def _first_done_or_failed(head: asyncio.Future[Any], futures: list[asyncio.Future[Any]]) -> None:
    """Wait until ``head`` is done, raising at once the error of any of ``futures`` that fails first."""
    while True:
        for future in futures:
            if future.done() and not future.cancelled() and (error := future.exception()) is not None:
                raise error
        if head.done():
            return
        await asyncio.wait([f for f in futures if not f.done()], return_when=asyncio.FIRST_COMPLETED)


_END: Any = object()
