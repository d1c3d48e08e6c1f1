"""One background event-loop thread for all of objckpt's I/O.

Every store call and transfer runs on this loop, so hundreds of requests can be
in flight from a single thread, and the caller's thread stays free for the
device→host copies. Sync entry points submit coroutines here and wait; a
loop whose thread ends (a ``MemoryError`` it could not hand to a task) fails
every future it was given, so no caller waits forever, and the next call
starts a new loop.

The thread is a daemon: a process that is done (or killed by a test) never waits
on it, and correctness never depends on it finishing (the manifest commits last).

Native clients (obstore's Rust runtime) complete their futures from their own
threads, through ``call_soon_threadsafe``, and take the GIL to do it. On Python
≤ 3.13 a foreign thread that takes the GIL once the interpreter is finalizing is
ended with ``pthread_exit``, which aborts a Rust thread (SIGABRT, exit -6): a
process that printed its result and returned 0 dies instead, when a Rust thread
is still inside the wake-up write of a call whose result the main thread
already got. So at exit (an ``atexit``
hook runs before finalization) the loop's tasks are cancelled and settled, and
calls from other threads still inside ``call_soon_threadsafe`` are waited for.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import contextvars
import gc
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from objckpt.errors import ObjckptError

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pause_lock = threading.Lock()
_pauses = 0  # calls inside collection_paused() now
_resume = False  # whether the collector was on when the first of them began
#: One entry per ``call_soon_threadsafe`` under way (deque append/pop are atomic under the GIL).
_wakeups_in_flight: collections.deque[None] = collections.deque()
#: How long the exit hook waits at most for tasks and other threads' calls to settle.
EXIT_GRACE_S = 2.0


class _IOLoop(asyncio.SelectorEventLoop):
    """The I/O loop, counting the calls other threads make into it, so exit can wait for them,
    and holding the futures :func:`submit` gave out, so a loop whose thread ends fails them."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted: set[concurrent.futures.Future[Any]] = set()
        self.ended: BaseException | None = None  # why its thread ended, once it has

    def call_soon_threadsafe(  # type: ignore[override]  # same call, the generic spelled plainly
        self, callback: Callable[..., object], *args: Any, context: contextvars.Context | None = None
    ) -> asyncio.Handle:
        _wakeups_in_flight.append(None)
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        finally:
            _wakeups_in_flight.pop()


#: The sets a worker thread started here joins (:func:`threads_joining`).
_JOINING: contextvars.ContextVar[tuple[set[concurrent.futures.Future[Any]], ...]] = contextvars.ContextVar(
    "objckpt_threads_joining", default=()
)


class JoiningExecutor(concurrent.futures.ThreadPoolExecutor):
    """The I/O loop's default executor (``asyncio.to_thread``): a call submitted where
    :func:`threads_joining` is in effect is in its set until its thread returns, whatever
    became of the task that awaited it (a cancelled request's write to a local disk runs on)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        future = super().submit(fn, *args, **kwargs)
        for held in _JOINING.get():
            held.add(future)
            future.add_done_callback(held.discard)
        return future


@contextlib.contextmanager
def threads_joining(held: set[concurrent.futures.Future[Any]]) -> Iterator[None]:
    """Inside the block, and in the tasks made in it, each call the I/O loop runs on a worker
    thread is in ``held`` until that thread returns."""
    token = _JOINING.set((*_JOINING.get(), held))
    try:
        yield
    finally:
        _JOINING.reset(token)


def get_loop() -> asyncio.AbstractEventLoop:
    """The shared I/O loop, started on first use."""
    global _loop, _thread
    with _lock:
        if _loop is None or not _loop.is_running():
            loop = _IOLoop()
            started = threading.Event()

            def _run() -> None:
                asyncio.set_event_loop(loop)
                loop.set_default_executor(JoiningExecutor(thread_name_prefix="objckpt-io-thread"))
                loop.call_soon(started.set)
                try:
                    loop.run_forever()  # nothing stops it: it ends only by an error
                except BaseException as e:  # e.g. a MemoryError the loop could not hand to a task
                    loop.ended = e
                    for future in list(loop.submitted):
                        _fail(future, e)
                    raise

            thread = threading.Thread(target=_run, name="objckpt-io", daemon=True)
            thread.start()
            started.wait()
            if _loop is None:
                atexit.register(_settle_at_exit)
            _loop, _thread = loop, thread
        return _loop


async def _cancel_other_tasks(timeout: float) -> int:
    """Cancel every task on the loop but this one; wait up to ``timeout`` for them to finish."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    return len(tasks)


def _settle_at_exit() -> None:
    """Before Python finalizes, leave no other thread about to take the GIL on the loop's behalf.

    Work still running at exit is abandoned either way (nothing is committed
    without its manifest); cancelling it here lets its own clean-up run and its
    native futures settle while Python can still take their callbacks.
    """
    loop, thread = _loop, _thread
    if loop is None or thread is None or not loop.is_running() or threading.current_thread() is thread:
        return
    deadline = time.monotonic() + EXIT_GRACE_S
    cancelled = 0
    with contextlib.suppress(Exception):
        future = asyncio.run_coroutine_threadsafe(_cancel_other_tasks(EXIT_GRACE_S / 2), loop)
        cancelled = future.result(EXIT_GRACE_S)
    while _wakeups_in_flight and time.monotonic() < deadline:
        time.sleep(0.001)
    if cancelled:  # a cancelled native future still takes the GIL once, on its own thread, to see it
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on the I/O loop; returns a thread-safe future, failed with an
    :class:`~objckpt.errors.ObjckptError` if the loop's thread ends before it is done."""
    loop = get_loop()
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    assert isinstance(loop, _IOLoop)
    loop.submitted.add(future)
    future.add_done_callback(loop.submitted.discard)
    if loop.ended is not None:  # it ended while this was being submitted
        _fail(future, loop.ended)
    return future


def _fail(future: concurrent.futures.Future[Any], cause: BaseException) -> None:
    error = ObjckptError(f"objckpt's I/O thread ended ({type(cause).__name__}: {cause}) before this call was done")
    error.__cause__ = cause
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_exception(error)


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
def collection_paused(enabled: bool = True) -> Iterator[None]:
    """Defer Python's cyclic garbage collector while the block runs, if ``enabled``
    (``Options.pause_gc``; a no-op otherwise, since the collector is process-wide).

    A restore makes many short-lived objects (boxes, pieces, slabs) that
    reference counting frees on its own, but their number trips full
    collections, and a full collection walks the caller's whole heap (JAX alone
    is hundreds of thousands of objects). Cycles made meanwhile are collected
    as usual once the last block inside ends. Blocks on several threads share
    one pause; a collector the caller turned off stays off.
    """
    if not enabled:
        yield
        return
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
