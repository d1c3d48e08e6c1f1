"""The storage contract, checked the same way on every store.

:class:`StoreConformance` is the suite (in the spirit of zarr's
``StoreTests``): a store implementation passes it by providing a ``store``
fixture (and optionally ``secrets``). :class:`TestStores` runs it on memory,
local disk, S3 (SeaweedFS), GCS (fake-gcs-server) and the example
third-party plugin found through the ``objckpt.stores`` entry point.

The second half tests ``from_url`` itself: schemes, plugins, credentials from
the environment, and the errors for what cannot be opened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.metadata
import itertools
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from objckpt.errors import (
    ObjckptError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
    StoreNotAvailableError,
    TransientStoreError,
)
from objckpt.storage import ByteRange, ObjectInfo, Store, from_url, register_store
from objckpt.storage import registry as _registry
from objckpt.storage.error_map import map_error
from objckpt.storage.fsspec_store import FsspecStore
from objckpt.storage.obstore_store import ObstoreStore
from objckpt.storage.registry import BACKEND_ENV, BACKEND_OPTION

T = TypeVar("T")
PLUGIN_DIR = Path(__file__).resolve().parent / "plugin_example"


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def payload(n: int, seed: int = 0) -> bytes:
    """``n`` bytes covering every byte value (no text-only transports here)."""
    return bytes((i * 131 + seed * 7 + (i >> 8)) % 256 for i in range(n))


# --------------------------------------------------------------------- plugin


@pytest.fixture(scope="session")
def dictstore_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Install tests/plugin_example the way pip would, as far as discovery goes.

    A ``.dist-info`` with ``entry_points.txt`` in a directory on ``sys.path``
    is exactly what ``importlib.metadata`` reads for an installed package.
    """
    site = tmp_path_factory.mktemp("site")
    dist = site / "objckpt_dictstore-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: objckpt-dictstore\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[objckpt.stores]\ndictstore = objckpt_dictstore:open_dictstore\n")
    added = [str(site), str(PLUGIN_DIR)]
    sys.path[:0] = added
    importlib.invalidate_caches()  # also clears importlib.metadata's path cache
    try:
        yield
    finally:
        for entry in added:
            sys.path.remove(entry)
        importlib.invalidate_caches()
        _registry._registry.pop("dictstore", None)
        sys.modules.pop("objckpt_dictstore", None)


# ---------------------------------------------------------------- the suite


class StoreConformance:
    """What every :class:`Store` must do. Subclasses provide ``store``."""

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
            await store.put("ba", bytearray(b"xyz"))
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


#: Conformance targets: a conftest store kind, optionally with the adapter forced.
_TARGETS: dict[str, tuple[str, str | None]] = {
    "memory": ("memory", None),
    "local": ("local", None),
    "local-obstore": ("local", "obstore"),
    "s3-obstore": ("s3", "obstore"),
    "s3-fsspec": ("s3", "fsspec"),
    "gcs": ("gcs", None),
    "dictstore": ("dictstore", None),
}


def _target_params() -> list[Any]:
    marks = {"s3": [pytest.mark.s3], "gcs": [pytest.mark.gcs]}
    return [pytest.param(name, id=name, marks=marks.get(kind, [])) for name, (kind, _) in _TARGETS.items()]


class _PluginTarget:
    """Like conftest's StoreTarget, for the example plugin's scheme."""

    secrets: tuple[str, ...] = ()
    storage_options: dict[str, Any] = {}

    def __init__(self, url: str) -> None:
        self.url = url

    def open(self, **extra: Any) -> Store:
        return from_url(self.url, **extra)


class TestStores(StoreConformance):
    """The suite on every store objckpt ships, plus the example plugin."""

    @pytest.fixture(params=_target_params())
    def target(self, request: pytest.FixtureRequest, store_target_factory: Callable[[str], Any]) -> Any:
        kind, backend = _TARGETS[request.param]
        if kind == "dictstore":
            request.getfixturevalue("dictstore_plugin")
            return _PluginTarget(f"dictstore://tests/{time.time_ns()}")
        target = store_target_factory(kind)
        if backend is None:
            return target
        return dataclasses.replace(target, storage_options={**target.storage_options, BACKEND_OPTION: backend})

    def test_adapter_is_the_one_asked_for(self, request: pytest.FixtureRequest, store: Store) -> None:
        backend = _TARGETS[request.node.callspec.params["target"]][1]
        if backend == "obstore":
            assert isinstance(store, ObstoreStore)
        elif backend == "fsspec":
            assert isinstance(store, FsspecStore)

    @pytest.fixture
    def store(self, target: Any) -> Store:
        return target.open()  # type: ignore[no-any-return]

    @pytest.fixture
    def secrets(self, target: Any) -> tuple[str, ...]:
        return tuple(target.secrets)


# ------------------------------------------------------------------- from_url


def test_plugin_found_through_entry_point(dictstore_plugin: None) -> None:
    store = from_url("dictstore://space/root")
    assert type(store).__module__ == "objckpt_dictstore"
    eps = importlib.metadata.entry_points(group="objckpt.stores", name="dictstore")
    assert [ep.value for ep in eps] == ["objckpt_dictstore:open_dictstore"]


def test_unknown_scheme_is_not_available() -> None:
    with pytest.raises(StoreNotAvailableError, match="nosuchscheme") as info:
        from_url("nosuchscheme://bucket/x")
    assert isinstance(info.value, ImportError)


def test_missing_package_names_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)  # makes `import obstore` fail
    monkeypatch.setitem(sys.modules, "s3fs", None)  # and `import s3fs`
    with pytest.raises(StoreNotAvailableError, match="pip install s3fs"):
        from_url("s3://bucket/x")
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    with pytest.raises(StoreNotAvailableError, match="pip install gcsfs"):
        from_url("gs://bucket/x")


def test_relative_path_is_refused() -> None:
    with pytest.raises(ValueError, match="relative/ckpt"):
        from_url("relative/ckpt")
    with pytest.raises(ValueError):
        from_url("file://relative/ckpt")
    with pytest.raises(ValueError):
        from_url("")


def test_local_path_forms(tmp_path: Path) -> None:
    for url in (str(tmp_path / "a"), f"file://{tmp_path}/a", tmp_path / "a"):
        store = from_url(url)
        assert isinstance(store, FsspecStore)
        run(store.put("k", b"v"))
        assert (tmp_path / "a" / "k").read_bytes() == b"v"
    assert not [p for p in (tmp_path / "a").iterdir() if p.name != "k"], "temp files left behind"


def test_register_store_and_lazy_path() -> None:
    calls: list[str] = []

    def factory(url: str, **options: Any) -> Store:
        calls.append(url)
        return from_url("memory://registered/" + url.split("://", 1)[1], **options)

    register_store("mine", factory)
    register_store("mine-lazy", "objckpt.storage.registry:open_memory")
    try:
        store = from_url("MINE://x/y")
        assert calls == ["MINE://x/y"] and isinstance(store, Store)
        assert from_url("mine-lazy://z").url == "mine-lazy://z"
        with pytest.raises(ValueError):
            register_store("bad scheme", factory)
    finally:
        _registry._registry.pop("mine", None)
        _registry._registry.pop("mine-lazy", None)


def test_other_fsspec_protocols_use_generic_store() -> None:
    # A chained URL: fsspec knows it, objckpt has no dedicated strategy for it.
    store = from_url(f"simplecache::memory://generic/{time.time_ns()}")
    assert isinstance(store, FsspecStore)
    run(store.put("a/k", b"v"))
    assert run(store.get("a/k")) == b"v"
    assert [o.key for o in run(store.list())] == ["a/k"]
    # Its pipe_file(mode="create") would be check-then-write: refused, not faked.
    assert not store.supports_create
    with pytest.raises(StoreError, match="create-if-absent"):
        run(store.put("k2", b"x", mode="create"))


def test_request_timeout_raises_transient(store_target_factory: Callable[[str], Any]) -> None:
    store = store_target_factory("memory").open(request_timeout=0.05)
    assert isinstance(store, FsspecStore)
    original = store.fs.cat_file

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)
        return original(*args, **kwargs)

    store.fs.cat_file = slow  # type: ignore[method-assign]
    try:
        with pytest.raises(TransientStoreError, match="timed out"):
            run(store.get("k"))
    finally:
        del store.fs.cat_file


def test_error_mapping_by_status_not_text() -> None:
    class FakeClientError(Exception):
        def __init__(self, status: int) -> None:
            super().__init__("message text says nothing useful")
            self.response = {"ResponseMetadata": {"HTTPStatusCode": status}}

    def s3fs_style(status: int) -> OSError:
        err = OSError(22, "At least one of the pre-conditions you specified did not hold")
        err.__cause__ = FakeClientError(status)
        return err

    what = "put s3://b/k"
    assert isinstance(map_error(s3fs_style(412), what, create=True), ObjectExistsError)
    assert type(map_error(s3fs_style(412), what)) is StoreError
    for status in (429, 500, 502, 503, 504):
        assert isinstance(map_error(s3fs_style(status), what), TransientStoreError)
    assert isinstance(map_error(s3fs_style(404), what), ObjectNotFoundError)
    denied = map_error(s3fs_style(403), what)
    assert isinstance(denied, PermissionError) and isinstance(denied, StoreError)
    assert isinstance(map_error(ConnectionResetError(104, "reset"), what), TransientStoreError)
    assert isinstance(map_error(TimeoutError(), what), TransientStoreError)
    assert type(map_error(ValueError("bad"), what)) is StoreError


# ------------------------------------------------------------- credentials


S3_BACKENDS = pytest.mark.parametrize("backend", ["obstore", "fsspec"])


@pytest.mark.s3
@S3_BACKENDS
def test_s3_credentials_from_environment(
    backend: str, s3_service: Any, monkeypatch: pytest.MonkeyPatch, store_target_factory: Callable[[str], Any]
) -> None:
    target = store_target_factory("s3")
    for name, value in s3_service.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(BACKEND_ENV, backend)
    store = from_url(target.url)  # no storage options at all
    assert type(store) is {"obstore": ObstoreStore, "fsspec": FsspecStore}[backend]
    run(store.put("env", b"from env"))
    assert run(target.open().get("env")) == b"from env"
    assert s3_service.secret_key not in repr(store)


@pytest.mark.s3
@S3_BACKENDS
def test_s3_wrong_credentials_are_permission_errors(backend: str, s3_service: Any) -> None:
    store = from_url(
        s3_service.url("x"),
        key=s3_service.access_key,
        secret="not-the-secret",
        endpoint_url=s3_service.endpoint_url,
        objckpt_backend=backend,
    )
    for call in (store.get("k"), store.get_range("k", start=0, end=4), store.put("k", b"v")):
        with pytest.raises(PermissionError) as info:
            run(call)
        assert isinstance(info.value, StoreError)
        assert "not-the-secret" not in str(info.value)


@pytest.mark.s3
def test_s3_default_adapter(s3_store: Any) -> None:
    """s3:// goes native when obstore is installed and the options translate."""
    assert isinstance(s3_store.open(), ObstoreStore)
    untranslatable = s3_store.open(s3_additional_kwargs={"ACL": "private"})
    assert isinstance(untranslatable, FsspecStore)  # an s3fs-only option: s3fs serves the URL
    run(untranslatable.put("k", b"v"))
    assert run(s3_store.open().get("k")) == b"v"


@pytest.mark.s3
def test_obstore_large_put_goes_multipart(s3_store: Any) -> None:
    store = s3_store.open()
    assert isinstance(store, ObstoreStore)
    store.multipart_threshold = 6 * 1024 * 1024  # parts are >= 5 MiB; keep the test small
    data = payload(12 * 1024 * 1024 + 17)
    run(store.put("big", memoryview(data)))
    assert run(store.get("big")) == data
    with pytest.raises(ObjectExistsError):  # create stays one request, and atomic, at any size
        run(store.put("big", data, mode="create"))


@pytest.mark.s3
def test_obstore_large_put_of_parts_goes_multipart(s3_store: Any) -> None:
    store = s3_store.open()
    assert isinstance(store, ObstoreStore) and store.puts_parts
    store.multipart_threshold = 6 * 1024 * 1024
    data = payload(12 * 1024 * 1024 + 17)
    cuts = [0, 64, 5 * 1024 * 1024, 5 * 1024 * 1024 + 3, len(data)]
    run(store.put_parts("big", [memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)]))
    assert run(store.get("big")) == data


def test_obstore_put_takes_any_contiguous_buffer(tmp_path: Path) -> None:
    import numpy as np

    store = from_url(str(tmp_path / "s"), objckpt_backend="obstore")
    floats = np.arange(1000, dtype=np.float32)
    run(store.put("f32", floats))  # type: ignore[arg-type]
    assert run(store.get("f32")) == floats.tobytes()
    run(store.put("2d", memoryview(np.ones((4, 5), dtype=np.int16))))
    assert run(store.get("2d")) == np.ones((4, 5), dtype=np.int16).tobytes()
    run(store.put("strided", memoryview(floats)[::2]))
    assert run(store.get("strided")) == floats[::2].tobytes()
    view = run(store.get_range_buffer("f32", start=4, end=12))
    assert isinstance(view, memoryview) and view.tobytes() == floats.tobytes()[4:12]


def test_obstore_request_timeout_raises_transient() -> None:
    """A server that accepts and never answers: both timeouts end the call."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        store = from_url(
            "s3://stalled/x",
            key="k",
            secret="s",
            endpoint_url=f"http://127.0.0.1:{port}",
            request_timeout=0.5,
            objckpt_backend="obstore",
        )
        started = time.monotonic()
        with pytest.raises(TransientStoreError):
            run(store.get_range("k", start=0, end=10))
        assert time.monotonic() - started < 5
    finally:
        listener.close()


@pytest.mark.gcs
def test_gcs_emulator_from_environment(
    gcs_service: Any, monkeypatch: pytest.MonkeyPatch, store_target_factory: Callable[[str], Any]
) -> None:
    target = store_target_factory("gcs")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_service.endpoint_url.removeprefix("http://"))
    store = from_url(target.url)
    run(store.put("env", b"from env"))
    assert run(target.open().get("env")) == b"from env"


def test_url_credentials_are_stripped() -> None:
    from objckpt.storage.urls import redact_url

    assert redact_url("s3://AKID:SECRET@bucket/x?sig=abc") == "s3://bucket/x"
    assert redact_url("/plain/path") == "/plain/path"
