"""One background event-loop thread for all of objckpt's I/O.

Every store call and transfer runs on this loop, so hundreds of requests can be
in flight from a single thread, and the caller's thread stays free for the
device→host copies. Sync entry points submit coroutines here and wait.

The thread is a daemon: a process that is done (or killed by a test) never waits
on it, and correctness never depends on it finishing (the manifest commits last).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from objckpt._memory import tune_malloc

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pause_lock = threading.Lock()
_pauses = 0  # calls inside collection_paused() now
_resume = False  # whether the collector was on when the first of them began


def get_loop() -> asyncio.AbstractEventLoop:
    """The shared I/O loop, started on first use."""
    global _loop, _thread
    with _lock:
        if _loop is None or not _loop.is_running():
            tune_malloc()
            loop = asyncio.new_event_loop()
            started = threading.Event()

            def _run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(started.set)
                loop.run_forever()

            thread = threading.Thread(target=_run, name="objckpt-io", daemon=True)
            thread.start()
            started.wait()
            _loop, _thread = loop, thread
        return _loop


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on the I/O loop; returns a thread-safe future."""
    return asyncio.run_coroutine_threadsafe(coro, get_loop())


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the I/O loop and wait for its result from a normal thread."""
    if _thread is not None and threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("objckpt's sync API was called from its own I/O thread")
    future = submit(coro)
    try:
        return future.result(timeout)
    except BaseException:
        future.cancel()
        raise


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Defer Python's cyclic garbage collector while the call runs.

    A restore makes many short-lived objects (boxes, pieces, slabs) that
    reference counting frees on its own, but their number trips full
    collections, and a full collection walks the caller's whole heap (JAX alone
    is hundreds of thousands of objects): measured 0.14 s for one, a sixth of
    a small model's restore, landing at random in one run or another. Cycles
    made meanwhile are collected as usual once the last call inside ends.
    Calls on several threads share one pause; a collector the caller turned
    off stays off.
    """
    global _pauses, _resume
    with _pause_lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()
