"""How many threads an operation's CPU-heavy work runs on at once.

A save beside a training loop competes with it for the host's cores: its crc32c and
SHA-256 passes, its compression, and its writes into a local file system (a memcpy into
the page cache per byte) each run on a worker thread, and the event loop's default
executor would run as many of them at once as it has threads (the host's cores plus
four). On a TPU host that starved the training step's own threads, dispatch and
completion, and the step ran 1.6-2.3x its time alone while the upload ran
(docs/PERFORMANCE.md, "The accelerator path"). :class:`CpuSlots` bounds that work to
``Options.save_threads`` threads at a time (:func:`save_threads_for` picks the default);
requests that only wait on the network do not take a slot.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def available_cpus() -> int:
    """The cores this process may run on (its affinity mask, else the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_save_threads() -> int:
    """A quarter of the cores, at least two: for work that nothing runs beside."""
    return max(2, available_cpus() // 4)


def save_threads_for(*, hold_uploads: bool) -> int:
    """``Options.save_threads`` when it is None: one thread for an async save, whose upload runs
    beside training, else :func:`default_save_threads` (a synchronous save blocks the caller
    until it ends, so sooner is better).

    One, because on a TPU host (13 cores, 4 GiB to ``file://``) a second thread was what slowed
    the step: a thread that sleeps 1 ms woke 1.1 ms late at the 99th percentile with one save
    thread and 19-62 ms late with two or more, and the step ran 1.00x its time alone with one,
    1.04-1.28x with two, 1.2-1.4x with three and 1.7-1.9x with 17 (the executor's count before).
    The upload took 3.1 s on tmpfs and 4.0-5.4 s on disk with one thread, against 2.2-3.1 s and
    2.8-3.1 s with three (``benchmarks/bench_save_threads.py``).
    """
    return 1 if hold_uploads else default_save_threads()


class CpuSlots:
    """At most ``n`` pieces of CPU-heavy work at once (build it on the loop it runs on)."""

    def __init__(self, n: int) -> None:
        if n <= 0:
            raise ValueError(f"CpuSlots needs a positive count, got {n!r}")
        self.n = n
        self._slots = asyncio.Semaphore(n)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a worker thread, once a slot is free."""
        async with self._slots:
            return await asyncio.to_thread(fn, *args)

    async def hold(self, work: Awaitable[T]) -> T:
        """Await ``work`` (which runs its CPU work on a worker thread) holding a slot."""
        async with self._slots:
            return await work
