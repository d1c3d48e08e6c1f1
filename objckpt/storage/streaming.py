"""The contract between a store that streams a ranged read and whoever consumes it.

Why streaming: a restore onto another sharding copies every byte it reads
into target boxes made of short runs (a row cut in two is 1–4 KiB). Copying
them out of a whole response buffer reads that buffer back from DRAM; copying
each few MiB right after it arrives reads it from cache, at about half the
CPU (docs/PERFORMANCE.md). Nor does the read need a buffer the size of its body.

The sink sizes each piece (:meth:`ReadSink.next_size`) so that its pieces
end where its own units do (whole rows of a box); the store receives exactly
that many bytes into a buffer it reuses and hands them over.

A store that fills a caller's buffer (a local file, read with ``readinto``) first
asks the sink where the piece belongs (:func:`destination_of`): a sink whose
piece lands in one contiguous run of its own memory (whole rows of one box) names
that run, the store reads the bytes straight there and hands over that same view,
and the sink only checks them. One host copy of each byte, not two: on an
accelerator host the second copy, into memory freshly faulted in, was what held a
restore above its read + ``device_put`` floor (docs/PERFORMANCE.md).
"""

from __future__ import annotations

from typing import Protocol

#: Bytes a streaming store receives at a time (at most): small enough to stay
#: in cache between arriving and being consumed, large enough that the Python
#: work per piece stays small next to moving its bytes.
STREAM_PIECE = 2 << 20


class ReadSink(Protocol):
    """Consumes one ranged read's body in order (``Store.get_range_streamed``)."""

    def begin(self) -> None:
        """A new attempt starts at byte 0 (forget any partial state of an earlier one)."""

    def next_size(self, offset: int, limit: int) -> int:
        """How many bytes to hand over next from ``offset`` (into the range): 1..``limit``.

        ``limit`` is at most what is left of the range, and at most the store's buffer.
        """

    def receive(self, offset: int, data: memoryview) -> None:
        """The bytes at ``offset``; ``data`` is only valid during the call."""


def destination_of(sink: ReadSink, offset: int, size: int) -> memoryview | None:
    """Where ``sink`` wants the ``size`` bytes at ``offset`` written, when it names a place.

    A sink may define ``destination(offset, size)``: a writable, contiguous view of
    exactly ``size`` bytes where that piece belongs, or None. A store that received
    the piece there passes that very view to ``receive``, which then only checks it.
    Sinks without the method (and pieces with no single place) get None: the store
    receives into its own buffer and the sink copies.
    """
    method = getattr(sink, "destination", None)
    if method is None:
        return None
    view = method(offset, size)
    if view is not None and (view.readonly or view.nbytes != size or not view.c_contiguous):
        raise ValueError(f"a sink named a destination unfit for {size} bytes at offset {offset}")
    return view


def feed(sink: ReadSink, data: memoryview | bytes, *, length: int, limit: int) -> int:
    """Hand the body of a ``length``-byte range, already in memory, to ``sink`` (the
    non-streaming fallback).

    Returns how many bytes were handed over; a body that ends inside a piece
    the sink asked for (the object was shorter) stops before that piece.
    """
    view = memoryview(data)
    sink.begin()
    offset = 0
    while offset < len(view):
        n = piece_size(sink, offset, min(limit, length - offset))
        if n > len(view) - offset:
            break
        sink.receive(offset, view[offset : offset + n])
        offset += n
    return offset


def piece_size(sink: ReadSink, offset: int, limit: int) -> int:
    """``sink.next_size``, checked: a sink asking for nothing (or too much) is a bug, not a loop."""
    n = sink.next_size(offset, limit)
    if not 0 < n <= limit:
        raise ValueError(f"read sink asked for {n} bytes at offset {offset} (limit {limit})")
    return n
