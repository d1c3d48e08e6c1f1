"""The store contract as a pytest suite every store passes, plugins included.

Subclass :class:`StoreConformance` in a test module and say which store to
test; pytest runs every ``test_*`` method below against it. The suite talks
to the store only through the :class:`~objckpt.storage.Store` verbs, so it
holds for any backend: round trips, ranges (exclusive end, short at the end),
atomic create-if-absent under contention, overwrite, delete, recursive
listing by string prefix, ``head``, the one missing-object error,
:meth:`~objckpt.storage.Store.child` roots, key validation, URLs and
messages free of credentials, and (:class:`~objckpt.testing.reads.ReadConformance`)
the buffer and streamed reads restore uses and the capabilities the store declares.

Needs ``pytest`` (imported here, never by ``import objckpt``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from objckpt.errors import ObjckptError, ObjectExistsError, ObjectNotFoundError
from objckpt.storage import ByteRange, ObjectInfo, Store, from_url
from objckpt.testing.helpers import payload, run
from objckpt.testing.reads import ReadConformance

__all__ = ["StoreConformance", "payload"]


class StoreConformance(ReadConformance):
    """What every :class:`Store` must do.

    A subclass names the store under test in one of three ways, simplest first:

    * ``url`` (and ``storage_options``): each test gets a fresh, empty root
      ``<url>/<random>`` from :func:`objckpt.storage.from_url`, so a scheme
      registered through ``objckpt.stores`` needs nothing else;
    * :meth:`make_store`, overridden to return a fresh, empty store;
    * the ``store`` fixture, overridden where building a store needs other
      fixtures (a server, a temporary directory).

    Override the ``secrets`` fixture to list credential strings that must
    never show in the store's URL, repr or error messages.
    """

    #: Root URL under which each test opens a fresh store (see :meth:`make_store`).
    url: ClassVar[str | None] = None
    #: Storage options passed to ``from_url`` with :attr:`url`.
    storage_options: ClassVar[Mapping[str, Any]] = {}

    def make_store(self) -> Store:
        """A fresh, empty store: by default a random root under :attr:`url`."""
        if not self.url:
            raise NotImplementedError(
                f"{type(self).__name__}: set `url`, or override make_store() or the `store` fixture"
            )
        return from_url(f"{self.url.rstrip('/')}/{uuid.uuid4().hex}", **self.storage_options)

    @pytest.fixture
    def store(self) -> Store:
        """The store under test, fresh and empty for each test."""
        return self.make_store()

    @pytest.fixture
    def secrets(self) -> tuple[str, ...]:
        """Strings that must never show in URLs, reprs or error messages."""
        return ()

    # -- round trips -----------------------------------------------------------

    def test_put_get_round_trip(self, store: Store) -> None:
        data = payload(70_000)

        async def go() -> None:
            await store.put("a/blob", data)
            assert await store.get("a/blob") == data
            await store.put("mv", memoryview(data)[10:20])
            assert await store.get("mv") == data[10:20]
            await store.put("ba", bytearray(b"xyz"))  # type: ignore[arg-type]  # any bytes-like works
            assert await store.get("ba") == b"xyz"

        run(go())

    def test_put_parts_writes_them_in_order(self, store: Store) -> None:
        data = payload(70_000)
        parts = [memoryview(data)[:100], memoryview(b""), memoryview(data)[100:69_000], memoryview(data)[69_000:]]

        async def go() -> None:
            await store.put_parts("parts", parts)
            assert await store.get("parts") == data
            await store.put_parts("one", [memoryview(data)[:7]])
            assert await store.get("one") == data[:7]
            await store.put_parts("new", parts, mode="create")
            with pytest.raises(ObjectExistsError):
                await store.put_parts("new", parts, mode="create")

        run(go())

    def test_put_owns_its_bytes(self, store: Store) -> None:
        buf = bytearray(b"original")

        async def go() -> None:
            await store.put("k", memoryview(buf))
            buf[:] = b"changed!"
            assert await store.get("k") == b"original"

        run(go())

    def test_get_range(self, store: Store) -> None:
        data = payload(1000)

        async def go() -> None:
            await store.put("r", data)
            assert await store.get_range("r", start=0, end=10) == data[:10]
            assert await store.get_range("r", start=10, end=11) == data[10:11]  # end exclusive
            assert await store.get_range("r", start=500, end=1000) == data[500:]
            assert await store.get_range("r", start=990, end=5000) == data[990:]  # short at the end
            assert await store.get_range("r", start=1000, end=1010) == b""
            assert await store.get_range("r", start=3000, end=3010) == b""
            assert await store.get_range("r", start=7, end=7) == b""
            with pytest.raises(ValueError):
                await store.get_range("r", start=5, end=4)

        run(go())

    def test_empty_object(self, store: Store) -> None:
        async def go() -> None:
            await store.put("empty", b"")
            assert await store.get("empty") == b""
            assert await store.get_range("empty", start=0, end=10) == b""  # a 416 on S3
            assert await store.get_range("empty", start=0, end=0) == b""
            assert (await store.head("empty")).size == 0
            assert [o.key for o in await store.list()] == ["empty"]

        run(go())

    def test_get_ranges_keeps_order(self, store: Store) -> None:
        data = payload(4096, seed=3)
        ranges = [ByteRange(3000, 4096), ByteRange(0, 1), ByteRange(100, 2000), ByteRange(50, 150), ByteRange(9, 9)]

        async def go() -> None:
            await store.put("g", data)
            got = await store.get_ranges("g", ranges)
            assert got == [data[r.start : r.end] for r in ranges]

        run(go())

    # -- create / overwrite / delete ---------------------------------------------

    def test_create_if_absent(self, store: Store) -> None:
        assert store.supports_create

        async def go() -> None:
            await store.put("m/manifest.json", b"first", mode="create")
            with pytest.raises(ObjectExistsError) as info:
                await store.put("m/manifest.json", b"second", mode="create")
            assert isinstance(info.value, FileExistsError)
            assert isinstance(info.value, ObjckptError)
            assert await store.get("m/manifest.json") == b"first"

        run(go())

    def test_concurrent_creates_exactly_one_wins(self, store: Store) -> None:
        contenders = 8

        async def go() -> None:
            results = await asyncio.gather(
                *(store.put("race", b"writer-%d" % i, mode="create") for i in range(contenders)),
                return_exceptions=True,
            )
            winners = [i for i, r in enumerate(results) if r is None]
            losers = [r for r in results if r is not None]
            assert len(winners) == 1, results
            assert all(isinstance(r, ObjectExistsError) for r in losers), losers
            assert await store.get("race") == b"writer-%d" % winners[0]

        run(go())

    def test_overwrite(self, store: Store) -> None:
        async def go() -> None:
            await store.put("o", b"one")
            await store.put("o", b"two, longer")
            assert await store.get("o") == b"two, longer"
            await store.put("o", b"3", mode="overwrite")
            assert await store.get("o") == b"3"
            await store.put("c", b"created", mode="create")
            await store.put("c", b"replaced")  # overwrite ignores create's guard
            assert await store.get("c") == b"replaced"

        run(go())

    def test_delete(self, store: Store) -> None:
        async def go() -> None:
            await store.put("d/x", b"1")
            await store.put("d/y", b"2")
            await store.delete("d/x")
            with pytest.raises(ObjectNotFoundError):
                await store.get("d/x")
            assert [o.key for o in await store.list()] == ["d/y"]
            await store.delete("d/x")  # missing: fine
            await store.delete("never/was")
            await store.put("d/x", b"again", mode="create")  # a deleted key can be created
            assert await store.get("d/x") == b"again"

        run(go())

    # -- list / head -----------------------------------------------------------

    def test_list(self, store: Store) -> None:
        keys = ["a", "b/c", "b/d/e", "bc", "x/y/z"]

        async def go() -> None:
            before = time.time()
            for i, key in enumerate(keys):
                await store.put(key, b"." * (i + 1))
            everything = await store.list()
            assert [o.key for o in everything] == keys
            assert [o.size for o in everything] == [1, 2, 3, 4, 5]
            for info in everything:
                assert isinstance(info, ObjectInfo)
                if info.last_modified is not None:
                    assert before - 120 < info.last_modified < time.time() + 120
            assert [o.key for o in await store.list("b")] == ["b/c", "b/d/e", "bc"]
            assert [o.key for o in await store.list("b/")] == ["b/c", "b/d/e"]
            assert [o.key for o in await store.list("b/d")] == ["b/d/e"]
            assert [o.key for o in await store.list("x/y/z")] == ["x/y/z"]
            assert await store.list("nothing") == []
            assert await store.list("nothing/") == []

        run(go())

    def test_list_empty_root(self, store: Store) -> None:
        assert run(store.list()) == []
        assert run(store.child("not/there").list()) == []

    def test_head(self, store: Store) -> None:
        async def go() -> None:
            await store.put("h/obj", payload(1234))
            info = await store.head("h/obj")
            assert info.key == "h/obj" and info.size == 1234
            assert info.last_modified is None or abs(info.last_modified - time.time()) < 120
            with pytest.raises(ObjectNotFoundError):
                await store.head("h")  # a prefix is not an object

        run(go())

    def test_missing_key(self, store: Store) -> None:
        async def go() -> None:
            for call in (
                store.get("missing/k"),
                store.get_range("missing/k", start=0, end=10),
                store.get_range("missing/k", start=0, end=0),
                store.head("missing/k"),
            ):
                with pytest.raises(ObjectNotFoundError) as info:
                    await call
                assert isinstance(info.value, FileNotFoundError)
                assert "missing/k" in str(info.value)

        run(go())

    # -- structure ---------------------------------------------------------------

    def test_child(self, store: Store) -> None:
        async def go() -> None:
            child = store.child("step_1")
            assert child.url == store.url.rstrip("/") + "/step_1"
            await child.put("blobs/0", b"zero")
            await child.put("manifest.json", b"{}", mode="create")
            assert await store.get("step_1/blobs/0") == b"zero"
            assert [o.key for o in await child.list()] == ["blobs/0", "manifest.json"]
            assert [o.key for o in await store.list()] == ["step_1/blobs/0", "step_1/manifest.json"]
            grandchild = child.child("blobs/")
            assert await grandchild.get("0") == b"zero"
            assert [o.key for o in await grandchild.list()] == ["0"]
            with pytest.raises(ObjectExistsError):
                await child.put("manifest.json", b"{}", mode="create")
            await grandchild.delete("0")
            assert [o.key for o in await store.list()] == ["step_1/manifest.json"]

        run(go())

    def test_url_and_repr_hide_secrets(self, store: Store, secrets: tuple[str, ...]) -> None:
        text = [store.url, repr(store), str(store), repr(store.child("c"))]
        try:
            run(store.get("no/such/key"))
        except ObjectNotFoundError as exc:
            text.append(str(exc))
            assert store.url in str(exc)
        assert "storage_options" not in repr(store)
        for secret in secrets:
            assert not any(secret in t for t in text), "a credential leaked"

    def test_invalid_keys(self, store: Store) -> None:
        async def go() -> None:
            for bad in ("", "/abs", "../up", "a/../../b", "a//b", "a/./b", "trailing/"):
                with pytest.raises(ValueError):
                    await store.put(bad, b"x")
                with pytest.raises(ValueError):
                    await store.get(bad)

        run(go())
