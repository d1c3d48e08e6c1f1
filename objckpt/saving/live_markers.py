"""Live-save markers: what keeps ``gc``, ``rm`` and retention off a save in flight.

Each process of a save writes ``_live/<save_id>-p<process>`` under the
checkpoint prefix before its first blob, rewrites it every tenth of the lease
while the save runs, and deletes it once the commit's outcome is known. Code
that deletes objects of a checkpoint prefix lists them first and only *then*
looks for markers (:func:`live_markers`): every blob in its listing was written
after its save's marker, so a save still running has a marker there, younger
than the lease. A marker older than the lease belongs to a save that died
(SIGKILL runs no cleanup) and protects nothing, so a crash delays orphan
collection by at most the lease. A marker is never listed in a manifest.

A save whose marker went unrefreshed for most of the lease (the store refused
the rewrites) no longer counts on it: it fails instead of committing
(:meth:`LiveMarker.lapsed`).

Only keys of the marker pattern under ``_live/`` count (any other object there,
a README say, protects nothing), and a marker the store dates more than one
refresh interval ahead of the deleter's clock counts as expired: a store clock
that far ahead breaks the lease's assumption anyway, and a marker dated years
ahead (a ``touch``, a store with a wrong clock) would otherwise protect its
prefix for ever. A marker left by the save that committed the checkpoint
(killed after its commit, before it deleted the marker) still protects it for
the lease, since that save may be retrying its commit, and deleters say that
is what holds them (:func:`explain`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

from objckpt.errors import ObjectNotFoundError
from objckpt.layouts.manifest_io import read_manifest
from objckpt.storage import ObjectInfo, Store
from objckpt.transfer.engine import missing_bucket

log = logging.getLogger("objckpt")

#: Where markers live, relative to a checkpoint prefix (never a blob key: blob
#: directories are two hex digits).
LIVE_DIR = "_live"

#: The marker is rewritten this many times per lease while the save runs.
REFRESHES_PER_LEASE = 10

_MARKER = re.compile(rf"(^|/){LIVE_DIR}/[0-9a-f]+-p[0-9]+$")
_OWN_MARKER = re.compile(rf"{LIVE_DIR}/([0-9a-f]+)-p[0-9]+")


def marker_key(save_id: str, process_index: int) -> str:
    """The marker of one process of one save, relative to the checkpoint prefix."""
    return f"{LIVE_DIR}/{save_id}-p{process_index}"


def is_marker(key: str) -> bool:
    """True when ``key`` (relative to a checkpoint or to a root above it) is a live-save marker."""
    return _MARKER.search(key) is not None


def marker_save_id(key: str) -> str | None:
    """The ``save_id`` of the marker at ``key`` (relative to its checkpoint prefix); None if no marker."""
    match = _OWN_MARKER.fullmatch(key)
    return match.group(1) if match else None


def is_live(marker: ObjectInfo, *, lease: float, now: float) -> bool:
    """True when ``marker`` still protects its prefix at ``now`` (the deleter's clock).

    Younger than ``lease`` and dated at most one refresh interval ahead of
    ``now`` (the clock difference the lease allows); no time at all counts as
    live (the safe side).
    """
    if marker.last_modified is None:
        return True
    age = now - marker.last_modified
    return -lease / REFRESHES_PER_LEASE <= age < lease


async def live_markers(store: Store, *, lease: float) -> list[ObjectInfo]:
    """The markers under the checkpoint prefix ``store`` that are live (:func:`is_live`).

    Only keys of the marker pattern (``_live/<save_id>-p<process>``) count. Call
    it *after* listing the objects it is to protect.
    """
    now = time.time()
    found = await store.list(f"{LIVE_DIR}/")
    return [m for m in found if marker_save_id(m.key) is not None and is_live(m, lease=lease, now=now)]


def _age(marker: ObjectInfo) -> str:
    if marker.last_modified is None:
        return ""
    age = time.time() - marker.last_modified
    if age < 0:
        return f", dated {-age:.0f} s ahead of this clock"
    return f", written {age:.0f} s ago"


def describe(markers: list[ObjectInfo]) -> str:
    """One phrase naming the first marker and its age, for error messages and logs."""
    first = markers[0]
    more = f" and {len(markers) - 1} more" if len(markers) > 1 else ""
    return f"live-save marker {first.key}{_age(first)}{more}"


def explain(url: str, markers: list[ObjectInfo], *, lease: float, committed_save_id: str | None = None) -> str:
    """What holds deleters off the checkpoint at ``url``: the sentence for errors and logs.

    ``markers`` are its live markers, ``committed_save_id`` the ``save_id`` of
    its manifest (None without one). Markers of that save belong to a save that
    has committed: it was interrupted after its commit (a SIGKILL runs no
    cleanup), or, while its marker is younger than two refresh intervals, may
    be finishing. Any other marker is a save writing there now, or, once it is
    older than two refresh intervals (a running save rewrites it every one), may
    be a dead writer's: the sentence then says what removes it.
    """
    own = [m for m in markers if committed_save_id is not None and marker_save_id(m.key) == committed_save_id]
    others = [m for m in markers if m not in own]
    first = (others or own)[0]
    age = None if first.last_modified is None else time.time() - first.last_modified
    stale = age is not None and age > 2 * lease / REFRESHES_PER_LEASE
    more = f" (and {len(others or own) - 1} more)" if len(others or own) > 1 else ""
    if others and stale:
        return (
            f"live-save marker {first.key}{more} is {age:.0f} s old, not rewritten since (a running save rewrites"
            f" it every {lease / REFRESHES_PER_LEASE:g} s): it may be a dead writer's, and holds deleters off {url}"
            f" until it is older than the lease ({lease:g} s); if no save to {url} is running,"
            f" `objckpt rm --force {url}` deletes it now"
        )
    if others:
        return f"a save is writing to {url} ({describe(others)}, lease {lease:g} s)"
    if stale:
        state = (
            f"was interrupted after its commit and left its live-save marker {first.key}{more}"
            f" ({age:.0f} s old, not rewritten since)"
        )
    else:
        state = (
            f"has not deleted its live-save marker {first.key}{more}{_age(first)}: it was interrupted after"
            " its commit, or is finishing"
        )
    return (
        f"the save that committed {url} (save_id {committed_save_id}) {state}; the marker holds deleters off"
        f" until it is older than the lease ({lease:g} s)"
    )


async def committed_save_id(store: Store, *, size_limit: int) -> str | None:
    """The ``save_id`` of the manifest at ``store``, for :func:`explain`; None when none can be read."""
    try:
        return (await read_manifest(store, size_limit=size_limit, reads=1)).save_id
    except Exception:  # only names what holds a deleter: an unreadable manifest names nothing
        return None


class LiveMarker:
    """One process's marker for one save: written, kept fresh, then deleted.

    Runs on the I/O loop. The refresh finishes a rewrite in flight before it
    stops, so the delete in :meth:`end` is never overtaken by a late rewrite.
    """

    def __init__(self, store: Store, key: str, *, lease: float) -> None:
        self.store = store
        self.key = key
        self.lease = lease
        self.interval = lease / REFRESHES_PER_LEASE
        self._written_at: float | None = None  # monotonic start of the last successful write
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def begin(self) -> None:
        """Write the marker (before any blob) and start refreshing it."""
        await self._write()
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._refresh())

    async def _write(self) -> None:
        started = time.monotonic()
        body = json.dumps({"key": self.key, "lease_seconds": self.lease, "written": time.time()}).encode()
        try:
            await self.store.put(self.key, body)
        except ObjectNotFoundError as e:
            raise missing_bucket(self.store.url, self.key, e) from e
        self._written_at = started

    async def _refresh(self) -> None:
        assert self._stop is not None
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
                return
            except TimeoutError:
                pass
            try:
                await self._write()
            except Exception as e:  # the next round tries again; lapsed() tells the commit
                log.warning("objckpt could not refresh %s/%s: %s", self.store.url, self.key, e)

    def lapsed(self) -> bool:
        """True when the marker may have aged past the lease in a deleter's eyes.

        One refresh interval of margin covers the clock difference between the
        store, which stamps the marker, and a deleter, which ages it.
        """
        if self._written_at is None:
            return True
        return time.monotonic() - self._written_at > self.lease - self.interval

    def lapse_error(self) -> str:
        """Why a lapsed marker stops the save, for the error message."""
        return (
            f"live-save marker {self.store.url}/{self.key} was not rewritten for over"
            f" {self.lease - self.interval:g} s (lease {self.lease:g} s), so gc, rm or retention"
            " may have deleted blobs of this save"
        )

    async def end(self) -> None:
        """Stop refreshing and delete the marker; best effort (a leftover marker expires)."""
        if self._stop is not None and self._task is not None:
            self._stop.set()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self.store.delete(self.key)
        except Exception as e:
            log.warning(
                "objckpt could not delete %s/%s (it expires after %g s): %s", self.store.url, self.key, self.lease, e
            )


class MarkerGroup:
    """A save's markers in several prefixes, kept and ended together: its own, and one in each
    base an incremental save references (:mod:`objckpt.saving.incremental`), so that deleters
    keep off the base as they keep off the save. The same calls as :class:`LiveMarker`."""

    def __init__(self, markers: list[LiveMarker]) -> None:
        self.markers = markers

    async def begin(self) -> None:
        for marker in self.markers:
            await marker.begin()

    def lapsed(self) -> bool:
        return any(m.lapsed() for m in self.markers)

    def lapse_error(self) -> str:
        return next((m.lapse_error() for m in self.markers if m.lapsed()), self.markers[0].lapse_error())

    async def end(self) -> None:
        for marker in self.markers:
            await marker.end()
