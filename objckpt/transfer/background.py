"""Work a save leaves running beside training, on a thread of its own that yields the CPU to it.

A local-tier save returns once its snapshot is taken; writing the step and sending it to
the process's keeper run after, while training goes on. On a host whose cores the training
processes already use, that work took CPU from the step: with peer copies on, bench_tiers'
steps ran 1.3-1.8 % slower (docs/PERFORMANCE.md, "Recovery tier"). :func:`in_background`
runs such work on a new thread whose Linux nice value is raised by ``Options.background_nice``
first: the scheduler then runs the training process's threads before it whenever both are
ready, and it takes what they leave. Threads it starts inherit its nice value (the peer
copy's pulls, and the transfer server JAX starts on its first exchange), so the whole job
yields. Only threads objckpt starts for this work are touched, never the caller's: on Linux
the nice value belongs to one thread; elsewhere nothing is changed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger("objckpt")

#: The highest nice value (the lowest priority) Linux gives a thread.
NICEST = 19


def yield_cpu(increment: int) -> bool:
    """Raise this thread's nice value by ``increment`` (at most to :data:`NICEST`); whether it did.

    Linux only: there ``setpriority(PRIO_PROCESS, tid)`` changes one thread. Elsewhere the same
    call would change a process, so nothing is done.
    """
    if increment <= 0 or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(NICEST, now + increment))
    except OSError as e:  # a sandbox that refuses it: the work runs at the caller's priority
        log.debug("objckpt: could not lower background thread %d's priority: %s", tid, e)
        return False
    return True


def in_background(fn: Callable[[], T], *, name: str, nice: int) -> concurrent.futures.Future[T]:
    """``fn()`` on a new daemon thread named ``name`` whose nice value is raised by ``nice``
    first; its future (the result, or the error ``fn`` raised)."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        yield_cpu(nice)
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
