"""The storage contract every backend implements.

objckpt needs only a handful of verbs from an object store, all async so one
event-loop thread can keep hundreds of requests in flight. Keys are always
relative to the store's root (the checkpoint or manager URL) and use ``/``.

One convention for a missing object everywhere: :class:`ObjectNotFoundError`
(a ``FileNotFoundError``). A failed create-if-absent raises
:class:`ObjectExistsError` (a ``FileExistsError``). Failures worth retrying
(HTTP 429/5xx, connection resets, timeouts) raise :class:`TransientStoreError`
so the transfer engine can decide by type, never by error text.
"""

from __future__ import annotations

import abc
import asyncio
import builtins
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from objckpt.errors import ObjectExistsError, ObjectNotFoundError  # noqa: F401  (re-exported)
from objckpt.storage.streaming import STREAM_PIECE, ReadSink, feed

PutMode = Literal["overwrite", "create"]
"""How :meth:`Store.put` writes: ``"overwrite"`` replaces any object there; ``"create"`` is
create-if-absent, an :class:`~objckpt.errors.ObjectExistsError` when one is (the commit)."""

#: Seconds allowed for any single store call (one request, or one listing) by default.
DEFAULT_REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True, order=True)
class ByteRange:
    """Bytes ``[start, end)`` of one object; ``end`` is exclusive.

    Attributes:
        start: the first byte's offset.
        end: the offset just past the last byte.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"invalid byte range [{self.start}, {self.end})")

    @property
    def length(self) -> int:
        """``end - start``."""
        return self.end - self.start


@dataclass(frozen=True)
class ObjectInfo:
    """What ``head`` and ``list`` say about one object.

    Attributes:
        key: the object's key, relative to the store's root.
        size: its size in bytes.
        last_modified: seconds since the epoch, when the store knows.
    """

    key: str
    size: int
    last_modified: float | None = None  # seconds since the epoch, when the store knows


class Store(abc.ABC):
    """An object store rooted at one URL: verbs, and the capabilities a caller may rely on.

    Subclasses implement the abstract verbs; the others have defaults built on
    them (``get_ranges`` issues the ranges concurrently). The class attributes
    below say what a store can do; each is a fact about the store, which
    callers branch on, never a tuning value. ``url`` must never contain
    credentials: it appears in error messages and logs. Hints that only some
    stores give (where their responses land in memory:
    :class:`objckpt.restoring.aligned_reads.AlignedResponses`) are optional protocols of
    their own, not part of this contract.

    Attributes:
        url: the store's root URL, without credentials.
    """

    url: str
    #: False for stores that cannot make create-if-absent atomic; commit refuses them.
    supports_create: bool = True
    #: True when a ranged read is assembled straight into the buffer it returns
    #: (no second, transient copy of the body inside the client), so a read whose
    #: buffer becomes a restored array costs no memory beyond that array.
    reads_in_place: bool = False
    #: True when :meth:`put_parts` sends the parts as they are (no join into
    #: one buffer), so a save can upload array bytes straight from the arrays.
    puts_parts: bool = False
    #: True when :meth:`get_range_streamed` hands the body to its sink as it
    #: arrives, in small pieces of one reused buffer (no buffer for the whole
    #: body), so restore can check and scatter bytes while they are still in cache.
    streams_reads: bool = False
    #: True when a write is CPU work on this host (a local file system: a memcpy per
    #: byte into the page cache), so a save runs its writes within ``Options.save_threads``.
    writes_on_host: bool = False

    @abc.abstractmethod
    async def get_range(self, key: str, *, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key``; fewer only if the object is shorter."""

    async def get_range_buffer(self, key: str, *, start: int, end: int) -> memoryview:
        """Like :meth:`get_range`, but the bytes may stay in the store's own buffer.

        For bulk reads consumed through a ``memoryview`` (checksummed, then
        copied into their destination): a store whose library hands back its
        own buffer (obstore) returns a read-only view of it instead of copying
        it into a new ``bytes``. Same semantics and errors as ``get_range``.
        """
        return memoryview(await self.get_range(key, start=start, end=end))

    async def get_range_streamed(self, key: str, *, start: int, end: int, sink: ReadSink) -> int:
        """Hand bytes ``[start, end)`` of ``key`` to ``sink``, in order, in pieces it sizes.

        Calls ``sink.begin()`` first (again on every retry), then for each
        piece ``sink.receive(offset, data)`` with ``len(data) ==
        sink.next_size(offset, limit)``; ``data`` is only valid during the call.
        Returns how many bytes were handed over: fewer only if the object is
        shorter. Same errors as :meth:`get_range`, plus whatever the sink
        raises; once it returns or raises, the sink is not called any more.
        The default reads the whole range, then hands it over; stores with
        :attr:`streams_reads` hand over each piece as it arrives.
        """
        data = await self.get_range_buffer(key, start=start, end=end)
        return feed(sink, data, length=end - start, limit=STREAM_PIECE)

    async def get(self, key: str) -> bytes:
        """The whole object."""
        info = await self.head(key)
        if info.size == 0:
            return b""
        return await self.get_range(key, start=0, end=info.size)

    async def get_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes]:
        """Several ranges of one object, concurrently, in the order given."""
        return list(await asyncio.gather(*(self.get_range(key, start=r.start, end=r.end) for r in ranges)))

    @abc.abstractmethod
    async def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        """Write a whole object. ``mode="create"`` is atomic create-if-absent."""

    async def put_parts(self, key: str, parts: Sequence[memoryview], *, mode: PutMode = "overwrite") -> None:
        """Write one object made of ``parts`` in order; same semantics and errors as :meth:`put`.

        The default joins the parts into one buffer (a copy); stores whose
        client can send a body of several buffers override it and set
        :attr:`puts_parts`. The caller keeps the parts unchanged until it returns.
        """
        await self.put(key, b"".join(parts), mode=mode)

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove an object; a missing object is not an error."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursive), keys relative to the root."""

    async def list_names(self, prefix: str = "") -> builtins.list[str]:
        """The names one level under ``prefix`` (``""`` or ending in ``/``), sorted: the first path
        component below it of every key, once (a manager root's steps, not their objects). The
        default lists recursively; stores that can list one level override it."""
        return sorted({o.key[len(prefix) :].partition("/")[0] for o in await self.list(prefix)})

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo:
        """Size (and time, when known) of one object."""

    @abc.abstractmethod
    def child(self, subpath: str) -> Store:
        """A store rooted at ``<url>/<subpath>`` sharing this one's connections."""

    def parent(self) -> Store | None:
        """A store rooted one path component above this one (sharing its connections), or None
        where there is none (a bucket's root) or the store cannot make one. Incremental checkpoints
        read their bases' blobs through it (:mod:`objckpt.core.format.bases`)."""
        return None

    async def close(self) -> None:  # noqa: B027  (optional hook)
        """Release connections; optional."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
