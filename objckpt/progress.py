"""A terminal progress bar (bytes, throughput, ETA) that is silent off a terminal.

The bar polls a byte counter (a :class:`~objckpt.transfer.TransferStats` field,
typically) from a daemon thread a few times a second, so the I/O path pays
nothing for it: no callback per request, no lock beyond the counter's own. It
draws on stderr only when stderr is a TTY; logs, pipes and CI output never see
a carriage return. No third-party dependency.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TextIO, TypeVar

T = TypeVar("T")

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``; whole bytes below 1 KiB."""
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def human_seconds(s: float) -> str:
    """``75`` → ``"1:15"``, ``3700`` → ``"1:01:40"``."""
    s = max(0, int(round(s)))
    hours, rest = divmod(s, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class ProgressBar:
    """Draws ``label [#####.....] 12.0 MiB/48.0 MiB  95.3 MiB/s  ETA 0:01``.

    Args:
        label: what is running (``"save"``, ``"cp"``...).
        total: bytes expected; the bar is full when ``current()`` reaches it.
        current: returns the bytes done so far; called from the drawing thread.
        stream: where to draw (a TTY); ``sys.stderr`` by default.
        interval: seconds between redraws.

    Use :func:`progress_bar`, which returns a bar that does nothing when the
    stream is not a terminal.
    """

    def __init__(
        self,
        label: str,
        total: int,
        current: Callable[[], int],
        *,
        stream: TextIO | None = None,
        interval: float = 0.2,
    ) -> None:
        self.label = label
        self.total = max(0, int(total))
        self._current = current
        self._stream = stream if stream is not None else sys.stderr
        self._interval = interval
        self._started = time.monotonic()
        self._samples: deque[tuple[float, int]] = deque(maxlen=int(5 / interval) + 1)  # ~5 s of samples
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"objckpt-progress-{label}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._draw(final=False)

    def _read(self) -> int:
        try:
            return int(self._current())
        except Exception:  # a counter that fails must not kill the operation
            return 0

    def render(self, done: int, now: float, *, final: bool) -> str:
        """The bar's text for ``done`` bytes at time ``now`` (no terminal control)."""
        elapsed = max(now - self._started, 1e-9)
        self._samples.append((now, done))
        if final or len(self._samples) < 2:
            rate = done / elapsed
        else:  # recent throughput, so the ETA follows the current speed
            t0, d0 = self._samples[0]
            rate = (done - d0) / max(now - t0, 1e-9)
        fraction = min(1.0, done / self.total) if self.total else 1.0
        width = 24
        filled = int(fraction * width)
        bar = "#" * filled + "." * (width - filled)
        if final:
            tail = f"in {human_seconds(elapsed)}"
        elif rate > 0 and self.total > done:
            tail = f"ETA {human_seconds((self.total - done) / rate)}"
        else:
            tail = "ETA --:--"
        return (
            f"{self.label} [{bar}] {fraction * 100:5.1f}% {human_bytes(done)}/{human_bytes(self.total)}"
            f"  {human_bytes(rate)}/s  {tail}"
        )

    def _draw(self, *, final: bool) -> None:
        with self._lock:
            if self._closed:
                return
            text = self.render(self._read(), time.monotonic(), final=final)
            columns = _columns(self._stream)
            text = text[: max(columns - 1, 10)]
            try:
                self._stream.write("\r" + text.ljust(max(columns - 1, 10)) + ("\n" if final else ""))
                self._stream.flush()
            except (OSError, ValueError):  # the terminal went away
                self._closed = True
            if final:
                self._closed = True

    def close(self) -> None:
        """Draw the final state and end the line; idempotent, never blocks on the drawing thread
        (a draw in progress finishes first; none follows the final one)."""
        self._stop.set()
        self._draw(final=True)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _columns(stream: TextIO) -> int:
    """Width of the terminal behind ``stream`` (stderr may be a TTY while stdout is a pipe)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or 100
    except (AttributeError, OSError, ValueError):
        return shutil.get_terminal_size((100, 24)).columns


class NullProgress:
    """The bar off a terminal: does nothing."""

    def close(self) -> None:
        pass

    def __enter__(self) -> NullProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


async def closing(run: Awaitable[T], bar: ProgressBar | NullProgress) -> T:
    """Await ``run``, then close ``bar``: a background operation's future completes only after
    its bar's last line is drawn, so nothing its caller prints next lands inside the bar."""
    try:
        return await run
    finally:
        bar.close()


def progress_bar(
    label: str,
    total: int,
    current: Callable[[], int],
    *,
    enabled: bool = True,
    stream: TextIO | None = None,
) -> ProgressBar | NullProgress:
    """A :class:`ProgressBar` when ``enabled`` and the stream (stderr) is a TTY, else a no-op."""
    stream = stream if stream is not None else sys.stderr
    if not enabled or stream is None:
        return NullProgress()
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError, OSError):
        tty = False
    if not tty:
        return NullProgress()
    return ProgressBar(label, total, current, stream=stream)
