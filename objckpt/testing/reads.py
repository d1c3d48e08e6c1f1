"""The read paths restore takes, and the capabilities a store declares, as conformance tests.

Restore does not read through ``get_range`` alone: it reads into a store's own
buffer (:meth:`~objckpt.storage.Store.get_range_buffer`, adopted as an array
where the store says :attr:`~objckpt.storage.Store.reads_in_place`) or hands
the body to a sink piece by piece
(:meth:`~objckpt.storage.Store.get_range_streamed`, streamed as it arrives
where the store says :attr:`~objckpt.storage.Store.streams_reads`).
:class:`ReadConformance` checks both paths with the same ranges as
``get_range`` (short at the end, past the end, missing), a sink that sizes
its pieces, a sink that raises (the error surfaces, nothing hangs, no later
read sees stale bytes), a read retried with the same sink, and that each
capability flag a store declares holds. :class:`~objckpt.testing.StoreConformance`
includes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import pytest

from objckpt.errors import ObjectExistsError, ObjectNotFoundError, StoreError
from objckpt.storage import Store
from objckpt.storage.streaming import STREAM_PIECE
from objckpt.testing.helpers import payload, run

T = TypeVar("T")

#: Seconds any one read in these tests may take before it counts as hung.
READ_DEADLINE_S = 120.0


def big_payload(n: int, seed: int = 0) -> bytes:
    """``n`` bytes of :func:`payload` repeated (fast for sizes of several MiB)."""
    unit = payload(65_521, seed)  # a prime: pieces never line up with the pattern
    return (unit * (n // len(unit) + 1))[:n]


async def _within_deadline(call: Awaitable[T]) -> T:
    return await asyncio.wait_for(call, READ_DEADLINE_S)


class RecordingSink:
    """A read sink that assembles the body and records every call, in pieces of ``piece`` bytes."""

    def __init__(self, piece: int = 64 << 10) -> None:
        self.piece = piece
        self.body = bytearray()
        self.begins = 0
        self.pieces: list[tuple[int, int]] = []  # (offset, length) of each receive
        self.limits: list[int] = []
        self.buffers: list[int] = []  # bytes of the buffer behind each piece handed over
        self._asked = 0

    def begin(self) -> None:
        self.begins += 1
        self.body.clear()
        self.pieces.clear()

    def next_size(self, offset: int, limit: int) -> int:
        assert offset == len(self.body), f"asked for the piece at {offset}, {len(self.body)} bytes received"
        self.limits.append(limit)
        self._asked = min(limit, self.piece)
        return self._asked

    def receive(self, offset: int, data: memoryview) -> None:
        assert offset == len(self.body), f"a piece at {offset}, {len(self.body)} bytes received"
        assert len(data) == self._asked, f"handed {len(data)} bytes, asked for {self._asked}"
        self.pieces.append((offset, len(data)))
        self.buffers.append(memoryview(data.obj).nbytes if data.obj is not None else len(data))
        self.body += data


class SinkFailed(Exception):
    """What :class:`FailingSink` raises: nothing a store would raise itself."""


class FailingSink(RecordingSink):
    """A :class:`RecordingSink` that raises :class:`SinkFailed` on its ``fail_at``-th piece
    of each of its first ``attempts`` attempts, and records whether it was called after."""

    def __init__(self, piece: int = 64 << 10, *, fail_at: int = 2, attempts: int = 1) -> None:
        super().__init__(piece)
        self.fail_at = fail_at
        self.attempts = attempts
        self.failed = 0
        self.calls_after_failure = 0
        self._failing = False
        self._raised = False

    def begin(self) -> None:
        super().begin()
        self._failing = self.failed < self.attempts

    def next_size(self, offset: int, limit: int) -> int:
        self._count_late_call()
        return super().next_size(offset, limit)

    def receive(self, offset: int, data: memoryview) -> None:
        self._count_late_call()
        super().receive(offset, data)
        if self._failing and len(self.pieces) == self.fail_at:
            self.failed += 1
            self._failing = False
            self._raised = True
            raise SinkFailed(f"the sink refused the piece at {offset}")

    def _count_late_call(self) -> None:
        if self._raised:
            self.calls_after_failure += 1

    def reset_after_failure(self) -> None:
        """The caller saw the failure: calls from here on belong to a new attempt."""
        self._raised = False


class ReadConformance:
    """Buffer and streamed reads, and the declared capabilities (part of ``StoreConformance``).

    Uses the ``store`` fixture of the class it is mixed into.
    """

    # -- reads into the store's buffer ---------------------------------------------

    def test_get_range_buffer(self, store: Store) -> None:
        data = payload(1000, seed=5)

        async def go() -> None:
            await store.put("buf", data)
            for start, end in ((0, 10), (10, 11), (500, 1000), (990, 5000), (1000, 1010), (3000, 3010), (7, 7)):
                view = await _within_deadline(store.get_range_buffer("buf", start=start, end=end))
                assert isinstance(view, memoryview)
                assert view.ndim == 1 and view.itemsize == 1 and view.contiguous
                assert bytes(view) == data[start:end], (start, end)
            with pytest.raises(ObjectNotFoundError):
                await store.get_range_buffer("no/such/key", start=0, end=10)
            with pytest.raises(ValueError):
                await store.get_range_buffer("buf", start=5, end=4)

        run(go())

    def test_buffer_reads_stay_valid_after_later_reads(self, store: Store) -> None:
        """Restore keeps a read's buffer (it may become the array) while it reads on."""
        data = big_payload(3 << 20, seed=1)

        async def go() -> None:
            await store.put("held", data)
            first = await store.get_range_buffer("held", start=0, end=1 << 20)
            later = await asyncio.gather(
                *(store.get_range_buffer("held", start=s, end=s + (1 << 20)) for s in (1 << 20, 2 << 20, 0))
            )
            assert bytes(first) == data[: 1 << 20]
            assert [bytes(v) for v in later] == [data[1 << 20 : 2 << 20], data[2 << 20 :], data[: 1 << 20]]

        run(go())

    # -- streamed reads --------------------------------------------------------

    def test_get_range_streamed(self, store: Store) -> None:
        data = big_payload((5 << 20) + 4321, seed=2)

        async def go() -> None:
            await store.put("s", data)
            for start, end, piece in (
                (0, len(data), 1 << 20),
                (123, 3 << 20, 3001),  # pieces the sink sizes (rows of a box), not the store's
                (len(data) - 100, len(data) + 1000, 50),  # short at the end
                (10, 11, 7),
            ):
                sink = RecordingSink(piece)
                got = await _within_deadline(store.get_range_streamed("s", start=start, end=end, sink=sink))
                assert got == len(data[start:end]) == len(sink.body), (start, end)
                assert sink.body == data[start:end], (start, end)
                assert sink.begins == 1
                assert all(0 < n <= piece for _, n in sink.pieces)
            for start in (len(data), len(data) + 10):  # at or past the end: nothing
                sink = RecordingSink()
                assert await store.get_range_streamed("s", start=start, end=start + 10, sink=sink) == 0
                assert sink.body == b""
            sink = RecordingSink()
            assert await store.get_range_streamed("s", start=5, end=5, sink=sink) == 0
            with pytest.raises(ObjectNotFoundError):
                await store.get_range_streamed("no/such/key", start=0, end=10, sink=RecordingSink())

        run(go())

    def test_a_sink_that_raises(self, store: Store) -> None:
        """The sink's error surfaces as itself, the sink hears nothing after it, nothing hangs,
        and reads after it (on connections the failed one may have left mid-body) are intact."""
        data = big_payload((5 << 20) + 17, seed=3)
        other = big_payload(3 << 20, seed=4)

        async def go() -> None:
            await store.put("fail", data)
            await store.put("other", other)
            for _ in range(3):
                sink = FailingSink(1 << 20, fail_at=2)
                with pytest.raises(SinkFailed):
                    await _within_deadline(store.get_range_streamed("fail", start=0, end=len(data), sink=sink))
                await asyncio.sleep(0.05)  # a store that kept calling the sink would do so by now
                assert sink.calls_after_failure == 0
            for _ in range(3):
                good = RecordingSink(1 << 20)
                got = await _within_deadline(store.get_range_streamed("other", start=0, end=len(other), sink=good))
                assert got == len(other) and good.body == other
                assert (
                    bytes(await _within_deadline(store.get_range_buffer("fail", start=7, end=1 << 20)))
                    == data[7 : 1 << 20]
                )
                assert await _within_deadline(store.get_range("other", start=100, end=200)) == other[100:200]

        run(go())

    def test_a_read_retried_with_the_same_sink(self, store: Store) -> None:
        """A caller retries a failed read with the same sink: each attempt begins it afresh,
        from offset 0, so nothing of the failed attempt is left in the body."""
        data = big_payload((3 << 20) + 999, seed=6)

        async def go() -> None:
            await store.put("retry", data)
            sink = FailingSink(1 << 20, fail_at=2, attempts=2)
            for attempt in range(3):
                try:
                    got = await _within_deadline(store.get_range_streamed("retry", start=9, end=len(data), sink=sink))
                except SinkFailed:
                    sink.reset_after_failure()
                    continue
                assert attempt == 2
                break
            assert sink.begins == 3 and sink.failed == 2
            assert got == len(data) - 9 and sink.body == data[9:]
            assert sink.pieces[0][0] == 0

        run(go())

    # -- declared capabilities ------------------------------------------------------

    def test_supports_create_is_true(self, store: Store) -> None:
        async def go() -> None:
            if store.supports_create:
                await store.put("flag/create", b"one", mode="create")
                with pytest.raises(ObjectExistsError):
                    await store.put("flag/create", b"two", mode="create")
                assert await store.get("flag/create") == b"one"
            else:  # refused outright, never a check-then-write that a racer can slip past
                with pytest.raises(StoreError):
                    await store.put("flag/create", b"one", mode="create")

        run(go())

    def test_streams_reads_is_true(self, store: Store) -> None:
        """A store that streams hands a body larger than one piece over in pieces of a
        buffer smaller than the body (it never holds the whole body)."""
        if not store.streams_reads:
            pytest.skip(f"{type(store).__name__} does not declare streams_reads")
        data = big_payload(3 * STREAM_PIECE + 5, seed=7)

        async def go() -> None:
            await store.put("flag/stream", data)
            sink = RecordingSink(piece=len(data))  # take as much as the store offers
            got = await _within_deadline(store.get_range_streamed("flag/stream", start=0, end=len(data), sink=sink))
            assert got == len(data) and sink.body == data
            assert len(sink.pieces) > 1, "the whole body in one piece"
            assert max(sink.limits) < len(data), "offered the whole body at once"
            assert max(sink.buffers) < len(data), "pieces cut from a buffer that holds the whole body"

        run(go())

    def test_reads_in_place_is_true(self, store: Store) -> None:
        """A store that reads in place returns its own buffer, sized for the read, a new
        one per read (restore adopts it as an array): not a view into a larger or shared one."""
        if not store.reads_in_place:
            pytest.skip(f"{type(store).__name__} does not declare reads_in_place")
        assert type(store).get_range_buffer is not Store.get_range_buffer, "the default copies out of get_range"
        data = big_payload(2 << 20, seed=8)

        async def go() -> None:
            await store.put("flag/in_place", data)
            a = await store.get_range_buffer("flag/in_place", start=0, end=1 << 20)
            b = await store.get_range_buffer("flag/in_place", start=1 << 20, end=2 << 20)
            for view in (a, b):
                assert view.obj is not None and memoryview(view.obj).nbytes == 1 << 20
            assert a.obj is not b.obj
            assert bytes(a) + bytes(b) == data

        run(go())

    def test_puts_parts_is_true(self, store: Store) -> None:
        """A store that puts parts sends them as they are: it has its own ``put_parts``
        (the contract's default joins them into one buffer first)."""
        if not store.puts_parts:
            pytest.skip(f"{type(store).__name__} does not declare puts_parts")
        assert type(store).put_parts is not Store.put_parts, "declares puts_parts but joins them (the default)"
        data = big_payload(3 << 20, seed=9)
        parts = [memoryview(data)[i : i + (700 << 10)] for i in range(0, len(data), 700 << 10)]

        async def go() -> None:
            await store.put_parts("flag/parts", parts)
            assert await store.get("flag/parts") == data

        run(go())
