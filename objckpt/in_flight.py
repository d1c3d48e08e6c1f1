"""Saves of this process whose commit has not ended yet, by URL.

``save_async`` counts a save here while its upload and commit run; restore asks
when it finds no manifest, so that reading back a ``save_async`` before its
``result()`` says so instead of only "no checkpoint". It sits below both
:mod:`objckpt.saving` and :mod:`objckpt.restoring`, which never import each other.
"""

from __future__ import annotations

import concurrent.futures
import threading

_in_flight: dict[str, int] = {}
_lock = threading.Lock()


def _url_key(url: str) -> str:
    """One spelling per location: ``file:///a/b/`` and ``/a/b`` are the same checkpoint."""
    url = url.rstrip("/") or url
    return url.removeprefix("file://") if url.startswith("file:///") else url


def track(url: str, future: concurrent.futures.Future[None]) -> None:
    """Count a save to ``url`` as running until ``future`` ends (however it ends)."""
    key = _url_key(url)
    with _lock:
        _in_flight[key] = _in_flight.get(key, 0) + 1

    def ended(_: concurrent.futures.Future[None]) -> None:
        with _lock:
            left = _in_flight.pop(key, 1) - 1
            if left:
                _in_flight[key] = left

    future.add_done_callback(ended)


def save_in_flight(url: str) -> bool:
    """Whether a save to ``url`` started in this process has not committed (or failed) yet."""
    with _lock:
        return _url_key(url) in _in_flight
