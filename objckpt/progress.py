"""Progress of an operation, reported to a callback; what ``progress=`` on save, restore, verify and copy means.

The transfer engine's byte counters (:class:`~objckpt.transfer.stats.TransferStats`)
feed a :class:`Reporter` after each request, and the reporter calls the user's
callback with a :class:`Progress` at most every ``interval`` seconds, then once
more, ``finished=True``, when the operation ends. Every call runs on objckpt's
I/O thread (never the caller's), one at a time; the I/O waits for it, so a
callback must be quick (hand the figures to a UI, do not draw or block). An
exception it raises is logged once and never fails the operation.

``progress=True`` hands the figures to a terminal bar (:class:`TerminalBar`, drawn
by tqdm, imported only when a bar is drawn), only when stderr is a terminal; the
command line passes ``True`` unless told ``--no-progress``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from objckpt.transfer import runtime

if TYPE_CHECKING:
    from objckpt.transfer.stats import TransferStats

T = TypeVar("T")
log = logging.getLogger("objckpt")

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

#: Seconds between two calls of a callback, at least (the final call comes whatever the interval).
INTERVAL = 0.1


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``; whole bytes below 1 KiB."""
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


@dataclass(frozen=True)
class Progress:
    """Where one operation stands, as its ``progress`` callback sees it.

    Attributes:
        operation: ``"save"``, ``"restore"``, ``"verify"`` or ``"cp"``.
        url: the checkpoint (a copy's destination).
        done_bytes: bytes moved so far (this process's); never decreases, never
            exceeds ``total_bytes``, and equals it in the final call of an
            operation that succeeded.
        total_bytes: bytes the operation moves in all (this process's share).
        finished: the last call: the operation ended (its outcome is what it
            returns or raises).
    """

    operation: str
    url: str
    done_bytes: int
    total_bytes: int
    finished: bool = False


#: A ``progress`` callback: called with each :class:`Progress`; what it returns is ignored.
ProgressCallback = Callable[[Progress], object]
#: What ``progress=`` takes: ``False``/``None`` (nothing), ``True`` (a terminal bar on stderr
#: when it is a terminal) or a :data:`ProgressCallback`.
ProgressArg = bool | ProgressCallback | None


class Reporter:
    """Calls ``callback`` with the progress of one operation, at most every ``interval`` seconds.

    Args:
        operation, url, total: as in :class:`Progress`.
        current: the bytes done so far (read from the operation's counters).
        callback: what to call.
        watch: the counters that call :meth:`update` when they move, until :meth:`finish`.
        interval: seconds between two calls, at least (the final one excepted); :data:`INTERVAL` by default.
    """

    def __init__(
        self,
        operation: str,
        url: str,
        total: int,
        current: Callable[[], int],
        callback: ProgressCallback,
        *,
        watch: tuple[TransferStats, ...] = (),
        interval: float | None = None,
    ) -> None:
        self._template = Progress(operation, url, 0, max(0, int(total)))
        self._current = current
        self._callback = callback
        self._interval = INTERVAL if interval is None else interval
        self._lock = threading.Lock()
        self._last_call = -math.inf
        self._done = 0
        self._finished = False
        self._failed = False
        self._watched = watch
        for stats in watch:
            stats.watch(self.update)

    def update(self) -> None:
        """A counter moved: call back if ``interval`` has passed since the last call.

        Never waits: a call under way on another thread makes this one a no-op.
        """
        now = time.monotonic()
        if now - self._last_call < self._interval or not self._lock.acquire(blocking=False):
            return
        try:
            before = self._done
            if not self._finished and self._read() != before:
                self._last_call = now
                self._emit(self._done, finished=False)
        finally:
            self._lock.release()

    def finish(self, *, complete: bool) -> None:
        """The final call (idempotent): all of ``total`` when ``complete``, else what the counters say."""
        for stats in self._watched:
            stats.unwatch(self.update)
        with self._lock:
            if self._finished:
                return
            self._finished = True
            done = self._template.total_bytes if complete else self._read()
            self._emit(done, finished=True)

    def _read(self) -> int:
        try:
            done = int(self._current())
        except Exception:  # a counter that fails must not fail the operation
            done = self._done
        self._done = max(self._done, min(done, self._template.total_bytes))
        return self._done

    def _emit(self, done: int, *, finished: bool) -> None:
        try:
            self._callback(replace(self._template, done_bytes=done, finished=finished))
        except Exception:  # the operation goes on; one line says why the figures stopped
            if not self._failed:
                self._failed = True
                log.warning(
                    "objckpt %s %s: the progress callback failed (logged once; the %s goes on)",
                    self._template.operation,
                    self._template.url,
                    self._template.operation,
                    exc_info=True,
                )


def callback_for(progress: ProgressArg, stream: TextIO | None = None) -> ProgressCallback | None:
    """The callback ``progress=`` asks for: ``True`` is a :class:`TerminalBar`, when ``stream``
    (stderr) is a terminal; ``False``/``None`` is none.

    Raises:
        TypeError: ``progress`` is none of those.
    """
    if progress is None or progress is False:
        return None
    if progress is True:
        stream = stream if stream is not None else sys.stderr
        return TerminalBar(stream) if is_terminal(stream) else None
    if callable(progress):
        return progress
    raise TypeError(f"progress must be a bool, None or a callable taking a Progress, got {type(progress).__name__}")


def is_terminal(stream: TextIO | None) -> bool:
    """Whether ``stream`` is a terminal (a closed or odd stream is not)."""
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class TerminalBar:
    """Draws the :class:`Progress` of one operation as a tqdm bar on ``stream``.

    The bar opens at the first call, follows ``done_bytes`` and closes (its line
    ended) at the call with ``finished=True``. It draws nothing of its own: tqdm
    renders bytes, throughput and ETA; tqdm is imported at the first call.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._bar: Any = None

    def __call__(self, progress: Progress) -> None:
        if self._bar is None:
            self._bar = _bar_class()(
                total=progress.total_bytes,
                initial=progress.done_bytes,
                desc=progress.operation,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self._stream,
                disable=False,  # the caller checked that the stream is a terminal
                **_width(self._stream),
            )
        self._bar.update(progress.done_bytes - self._bar.n)
        if progress.finished:
            self._bar.close()


@functools.cache
def _bar_class() -> type[Any]:
    """tqdm without its monitor thread (the reporter already calls at a steady pace); made at the
    first bar drawn, so nothing else imports tqdm."""
    from tqdm import tqdm

    class _Bar(tqdm):  # type: ignore[misc]  # tqdm ships no type hints
        monitor_interval = 0

    return _Bar


def _width(stream: TextIO) -> dict[str, Any]:
    """tqdm's width options: the terminal's, followed as it resizes; a fixed 100 columns where
    the terminal reports no size (a fresh pseudo-terminal says 0 × 0, and tqdm then draws nothing)."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        columns = 0
    return {"dynamic_ncols": True} if columns else {"ncols": 100, "nrows": 24}


def start(
    progress: ProgressArg, operation: str, url: str, total: int, current: Callable[[], int], *watch: TransferStats
) -> Reporter | None:
    """A reporter fed by the counters ``watch`` (None when ``progress`` asks for nothing); end it
    with :func:`finish` (on the I/O thread), :func:`finish_from_caller` or :func:`closing`."""
    callback = callback_for(progress)
    return None if callback is None else Reporter(operation, url, total, current, callback, watch=watch)


def finish(reporter: Reporter | None, *, complete: bool) -> None:
    """Stop feeding ``reporter`` and make its final call; call it on the I/O thread."""
    if reporter is not None:
        reporter.finish(complete=complete)


def finish_from_caller(reporter: Reporter | None, *, complete: bool) -> None:
    """:func:`finish` from a caller's thread: the final call runs on the I/O thread all the same."""
    if reporter is not None:
        runtime.run_sync(_finish(reporter, complete))


async def _finish(reporter: Reporter, complete: bool) -> None:
    finish(reporter, complete=complete)


@contextlib.contextmanager
def reporting(
    progress: ProgressArg, operation: str, url: str, total: int, current: Callable[[], int], *watch: TransferStats
) -> Iterator[None]:
    """Report the progress of the block's I/O (see :func:`start`); the final call, on the
    I/O thread like the others, comes before the block's caller goes on."""
    reporter = start(progress, operation, url, total, current, *watch)
    complete = False
    try:
        yield
        complete = True
    finally:
        finish_from_caller(reporter, complete=complete)


async def closing(run: Awaitable[T], reporter: Reporter | None) -> T:
    """Await ``run``, then make ``reporter``'s final call: a background operation's future
    completes only after it, so nothing its caller prints next lands inside a bar."""
    complete = False
    try:
        result = await run
        complete = True
        return result
    finally:
        finish(reporter, complete=complete)
