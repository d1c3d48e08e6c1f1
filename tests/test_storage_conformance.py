"""The storage contract, checked the same way on every store.

The suite is :class:`objckpt.testing.StoreConformance` (in the spirit of
zarr's ``StoreTests``), shipped in the package so that third-party stores run
it too. :class:`TestStores` runs it on every store objckpt ships: memory,
local disk, S3 (SeaweedFS) and GCS (fake-gcs-server), through each adapter
that serves them. The example third-party plugin runs it from its own tests
(``tests/plugin_example/tests``), found through the ``objckpt.stores`` entry
point, in a pytest of its own.

The second half tests ``from_url`` itself: schemes, plugins, credentials from
the environment, and the errors for what cannot be opened.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from objckpt.errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
    StoreNotAvailableError,
    TransientStoreError,
)
from objckpt.storage import Store, from_url, register_store
from objckpt.storage import registry as _registry
from objckpt.storage.errors import map_error
from objckpt.storage.fsspec.s3 import S3FsspecStore
from objckpt.storage.fsspec.store import FsspecStore
from objckpt.storage.obstore.store import ObstoreStore
from objckpt.storage.opening import BACKEND_ENV, BACKEND_OPTION
from objckpt.testing import StoreConformance
from objckpt.testing.store import payload, run

PLUGIN_DIR = Path(__file__).resolve().parent / "plugin_example"


# --------------------------------------------------------------------- plugin


def _fake_install(site: Path) -> list[str]:
    """Install tests/plugin_example the way pip would, as far as discovery goes: the
    ``sys.path`` entries that make it importable and its entry point visible.

    A ``.dist-info`` with ``entry_points.txt`` in a directory on ``sys.path``
    is exactly what ``importlib.metadata`` reads for an installed package.
    """
    dist = site / "objckpt_dictstore-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: objckpt-dictstore\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[objckpt.stores]\ndictstore = objckpt_dictstore:open_dictstore\n")
    return [str(site), str(PLUGIN_DIR)]


@pytest.fixture(scope="session")
def dictstore_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The example plugin, installed into this process (:func:`_fake_install`)."""
    added = _fake_install(tmp_path_factory.mktemp("site"))
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


# ------------------------------------------------------------ our stores


#: Conformance targets: a conftest store kind, optionally with the adapter forced.
_TARGETS: dict[str, tuple[str, str | None]] = {
    "memory": ("memory", None),
    "local": ("local", None),
    "local-obstore": ("local", "obstore"),
    "s3-obstore": ("s3", "obstore"),
    "s3-fsspec": ("s3", "fsspec"),
    "gcs": ("gcs", None),
    # The real cloud path: HTTPS with a private CA, and credentials from metadata services.
    "s3-obstore-https": ("s3-https", "obstore"),
    "s3-fsspec-https": ("s3-https", "fsspec"),
    "gcs-https": ("gcs-https", None),
    "s3-obstore-imds": ("s3-imds", "obstore"),
    "s3-fsspec-imds": ("s3-imds", "fsspec"),
    "gcs-metadata": ("gcs-metadata", None),
}


def _target_params() -> list[Any]:
    marks = {"s3": [pytest.mark.s3], "gcs": [pytest.mark.gcs]}
    return [
        pytest.param(name, id=name, marks=marks.get(kind.split("-")[0], [])) for name, (kind, _) in _TARGETS.items()
    ]


class TestStores(StoreConformance):
    """The suite on every store objckpt ships, through each adapter that serves it."""

    @pytest.fixture(params=_target_params())
    def target(self, request: pytest.FixtureRequest, store_target_factory: Callable[[str], Any]) -> Any:
        kind, backend = _TARGETS[request.param]
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

    def test_the_cloud_path_is_the_one_taken(self, request: pytest.FixtureRequest, store: Store, target: Any) -> None:
        """HTTPS targets go through the TLS front; metadata targets sign with what the metadata service issued."""
        if target.kind not in ("s3-https", "gcs-https", "s3-imds", "gcs-metadata"):
            pytest.skip("the lab's path (plain HTTP, static or no credentials)")
        data = payload(300_000, seed=3)
        before = self._traffic(request, target.kind)
        run(store.put("path/probe", data))
        assert run(store.get_range("path/probe", start=10, end=20)) == data[10:20]
        chunks: list[bytes] = []
        run(store.get_range_streamed("path/probe", start=0, end=len(data), sink=_collect(chunks)))
        assert b"".join(chunks) == data
        assert self._traffic(request, target.kind) > before, f"{target.kind}: no traffic on its own path"
        if target.kind == "gcs-metadata":
            proxy = request.getfixturevalue("gcs_bearer_proxy")
            assert proxy.stats.refused == 0 and proxy.stats.bearer_tokens

    @staticmethod
    def _traffic(request: pytest.FixtureRequest, kind: str) -> int:
        """How much the path of ``kind`` has seen: TLS handshakes, credential fetches, bearer-checked requests."""
        if kind.endswith("-https"):
            return int(request.getfixturevalue(f"{kind.split('-')[0]}_tls").stats.connections)
        if kind == "s3-imds":
            return len(request.getfixturevalue("aws_metadata").issued)
        if kind == "gcs-metadata":
            return sum(request.getfixturevalue("gcs_bearer_proxy").stats.bearer_tokens.values())
        raise AssertionError(kind)

    @pytest.fixture
    def store(self, target: Any) -> Store:
        return target.open()  # type: ignore[no-any-return]

    @pytest.fixture
    def secrets(self, target: Any) -> tuple[str, ...]:
        return tuple(target.secrets)


class _collect:  # noqa: N801  (reads as a call at its use)
    """A read sink that keeps what it is given, in pieces of up to 64 KiB."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def begin(self) -> None:
        self.chunks.clear()

    def next_size(self, offset: int, limit: int) -> int:
        return min(limit, 64 << 10)

    def receive(self, offset: int, data: memoryview) -> None:
        self.chunks.append(bytes(data))


# ------------------------------------------------------------------- from_url


def test_plugin_found_through_entry_point(dictstore_plugin: None) -> None:
    store = from_url("dictstore://space/root")
    assert type(store).__module__ == "objckpt_dictstore"
    eps = importlib.metadata.entry_points(group="objckpt.stores", name="dictstore")
    assert [ep.value for ep in eps] == ["objckpt_dictstore:open_dictstore"]


def test_plugin_runs_the_conformance_suite_from_its_own_tests(tmp_path: Path) -> None:
    """The example plugin's three-line test module runs the whole suite on its scheme, in a
    pytest of its own (its own root and configuration, none of objckpt's test fixtures),
    as the plugin's repository would once it is installed."""
    paths = [*_fake_install(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-c", "pyproject.toml", "--rootdir=."],
        cwd=PLUGIN_DIR,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    suite = [name for name in dir(StoreConformance) if name.startswith("test_")]
    assert len(suite) >= 15
    # The plugin declares none of the optional capabilities: their three checks skip, the rest pass.
    assert f"{len(suite) - 3} passed, 3 skipped" in result.stdout, result.stdout[-2000:]
    for flag in ("streams_reads", "reads_in_place", "puts_parts"):
        assert f"does not declare {flag}" in result.stdout, result.stdout[-2000:]


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
    register_store("mine-lazy", "objckpt.storage.factories:open_memory")
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
    assert type(store) is {"obstore": ObstoreStore, "fsspec": S3FsspecStore}[backend]
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
