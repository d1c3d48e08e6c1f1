"""The terminal progress bar: a ``progress`` callback that draws with tqdm.

The command line passes it for ``verify`` and ``cp``; the library's
``progress=True`` uses it too (:func:`objckpt.progress.callback_for`), only
when stderr is a terminal. It draws nothing of its own: tqdm renders bytes,
throughput and ETA.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

from tqdm import tqdm

from objckpt.progress import Progress


class _Bar(tqdm):  # type: ignore[misc]  # tqdm ships no type hints
    """tqdm without its monitor thread: the reporter already calls at a steady pace."""

    monitor_interval = 0


class TerminalBar:
    """Draws the :class:`~objckpt.progress.Progress` of one operation as a tqdm bar on ``stream``.

    The bar opens at the first call, follows ``done_bytes`` and closes (its
    line ended) at the call with ``finished=True``.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._bar: _Bar | None = None

    def __call__(self, progress: Progress) -> None:
        if self._bar is None:
            self._bar = _Bar(
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


def _width(stream: TextIO) -> dict[str, Any]:
    """tqdm's width options: the terminal's, followed as it resizes; a fixed 100 columns where
    the terminal reports no size (a fresh pseudo-terminal says 0 × 0, and tqdm then draws nothing)."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        columns = 0
    return {"dynamic_ncols": True} if columns else {"ncols": 100, "nrows": 24}
