"""What one operation did, counted while it runs: requests, retries, bytes, objects.

Every store request of a save, restore, copy or verify adds to its operation's
:class:`TransferStats` (the transfer engine, the retry loop, the readers); a progress
reporter watches the counters, and the API hands them back when the operation ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TransferStats:
    """Counters of one operation, safe to read from any thread.

    Attributes:
        requests: store requests issued.
        retries: how many of them were retries.
        throttled: answers asking to slow down (429, 503 SlowDown), each retried.
        checksum_retries: re-reads after a checksum mismatch or a manifest that did not parse.
        bytes_written: bytes written to the store.
        bytes_read: bytes read from the store.
        objects_written: objects written to the store.
        device_bytes_moved: bytes a restore moved between devices, received by this process's
            devices: leaves read on the saved grid and resharded to their targets there.
        seconds: wall time of the whole operation, set when it ends.
        bytes_by_location: bytes read from each location, by URL, when a restore reads from
            several (replicas).
    """

    requests: int = 0
    retries: int = 0
    throttled: int = 0  # answers asking to slow down (429, 503 SlowDown), each retried
    checksum_retries: int = 0  # re-reads after a checksum mismatch or a manifest that did not parse
    bytes_written: int = 0
    bytes_read: int = 0
    objects_written: int = 0
    #: bytes a restore moved between devices, received by this process's devices: leaves read on the
    #: saved grid and resharded to their targets there (objckpt.restoring.reshard)
    device_bytes_moved: int = 0
    seconds: float = 0.0  # wall time of the whole operation, set when it ends
    #: bytes read from each location, by URL, when a restore reads from several (replicas)
    bytes_by_location: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _listeners: list[Callable[[], None]] = field(default_factory=list, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Add to counters by name (``add(requests=1, bytes_read=n)``), then tell the watchers."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)
            listeners = tuple(self._listeners) if self._listeners else ()
        for listener in listeners:
            listener()

    def add_location_bytes(self, url: str, n: int) -> None:
        """Count ``n`` bytes read from the location ``url`` (``bytes_by_location``)."""
        with self._lock:
            self.bytes_by_location[url] = self.bytes_by_location.get(url, 0) + n

    def watch(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after each change of the counters, on the thread that made it and
        outside their lock: what feeds a progress reporter (:mod:`objckpt.progress`)."""
        with self._lock:
            self._listeners.append(listener)

    def unwatch(self, listener: Callable[[], None]) -> None:
        """Stop calling ``listener`` (one that is not watching is ignored)."""
        with self._lock, contextlib.suppress(ValueError):
            self._listeners.remove(listener)
