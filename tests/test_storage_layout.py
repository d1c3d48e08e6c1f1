"""``objckpt.storage`` by backend: what each package may import, and the one streamed-read path.

The contract and the shared pieces sit at the top of ``objckpt/storage/``; each backend
(``fsspec/``, ``obstore/``, ``http/``, ``auth/``, ``copy/``) is a package of its own,
imported only when a URL needs it. The fsspec and obstore stores choose between their
range reader and the contract's fallback in one place, :class:`StreamingStore`.
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from objckpt.errors import TransientStoreError
from objckpt.storage import Store
from objckpt.storage.fsspec.factory import for_filesystem
from objckpt.storage.fsspec.store import FsspecStore
from objckpt.storage.http.reader import StreamingStore
from objckpt.storage.obstore.store import ObstoreStore, open_local_path
from objckpt.storage.streaming import ReadSink
from objckpt.testing.reads import RecordingSink


def test_the_public_names_stay_at_the_top() -> None:
    import objckpt.storage as storage

    assert storage.__all__ == ["ByteRange", "ObjectInfo", "PutMode", "Store", "from_url", "register_store"]
    assert all(getattr(storage, name) is not None for name in storage.__all__)


def test_opening_a_local_or_memory_store_imports_no_cloud_client(tmp_path: Path) -> None:
    """Backends load only when a URL needs them: a local and a memory store need no
    cloud client, HTTP stack or credential library."""
    code = (
        "import sys\n"
        "from objckpt.storage import from_url\n"
        f"from_url({str(tmp_path)!r}); from_url('memory://layout')\n"
        "heavy = ('s3fs', 'gcsfs', 'aiohttp', 'google.auth', 'botocore', 'obstore', 'objckpt.storage.fsspec.gcs',\n"
        "         'objckpt.storage.http.gcs_upload', 'objckpt.storage.obstore.store', 'objckpt.storage.copy.server')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_fsspec_package_leaves_the_library_alone() -> None:
    """``objckpt.storage.fsspec`` is objckpt's package; ``import fsspec`` inside it is still the library."""
    import objckpt.storage.fsspec.store as store_module

    assert store_module.AbstractFileSystem is fsspec.AbstractFileSystem
    assert fsspec.__name__ == "fsspec" and "objckpt" not in (fsspec.__file__ or "")


def test_the_range_reader_fallback_is_written_once() -> None:
    for cls in (FsspecStore, ObstoreStore):
        assert issubclass(cls, StreamingStore)
        assert cls.get_range_streamed is StreamingStore.get_range_streamed, cls
    assert FsspecStore.close is StreamingStore.close
    # obstore's store also lets its checksum client's threads go, after the reader's close
    assert "await super().close()" in inspect.getsource(ObstoreStore.close)


class _Reader:
    """A stand-in range reader: hands the pieces of ``body`` over, optionally after a stall."""

    def __init__(self, body: bytes, *, stall: float = 0.0) -> None:
        self.body = body
        self.stall = stall
        self.calls: list[tuple[str, int, int]] = []
        self.closed = False

    async def read_streamed(self, path: str, start: int, length: int, sink: ReadSink, what: str) -> int:
        self.calls.append((path, start, length))
        await asyncio.sleep(self.stall)
        data = memoryview(self.body)[start : start + length]
        sink.begin()
        offset = 0
        while offset < len(data):
            n = sink.next_size(offset, len(data) - offset)
            sink.receive(offset, data[offset : offset + n])
            offset += n
        return offset

    def close(self) -> None:
        self.closed = True


def _store(kind: str, tmp_path: Path, reader: Any, *, timeout: float = 30.0) -> Store:
    if kind == "fsspec":
        fs = MemoryFileSystem(skip_instance_cache=True)
        store: Store = for_filesystem(fs, f"/layout-{tmp_path.name}", request_timeout=timeout, range_reader=reader)
        return store
    native = open_local_path(str(tmp_path / "root"), f"file://{tmp_path}/root", request_timeout=timeout)
    native._use_range_reader(reader)
    return native


@pytest.mark.parametrize("kind", ["fsspec", "obstore"])
def test_a_store_streams_through_its_reader_and_falls_back_without_one(kind: str, tmp_path: Path) -> None:
    body = bytes(range(256)) * 40
    reader = _Reader(body)
    store = _store(kind, tmp_path, reader)
    assert store.streams_reads

    async def go() -> None:
        await store.put("k", body)
        sink = RecordingSink(1000)
        assert await store.get_range_streamed("k", start=100, end=5100, sink=sink) == 5000
        assert sink.body == body[100:5100]
        assert len(reader.calls) == 1 and reader.calls[0][1:] == (100, 5000)
        assert reader.calls[0][0].endswith("k")
        empty = RecordingSink()
        assert await store.get_range_streamed("k", start=7, end=7, sink=empty) == 0  # the fallback
        assert len(reader.calls) == 1
        with pytest.raises(ValueError):
            await store.get_range_streamed("../k", start=0, end=10, sink=RecordingSink())
        with pytest.raises(ValueError):
            await store.get_range_streamed("k", start=-1, end=10, sink=RecordingSink())
        await store.close()
        assert reader.closed

    asyncio.run(go())

    plain = _store(kind, tmp_path / "plain", None)
    assert not plain.streams_reads

    async def without_reader() -> None:
        await plain.put("k", body)
        sink = RecordingSink(999)
        assert await plain.get_range_streamed("k", start=0, end=len(body), sink=sink) == len(body)
        assert sink.body == body

    asyncio.run(without_reader())


@pytest.mark.parametrize("kind", ["fsspec", "obstore"])
def test_a_stalled_reader_is_a_transient_error_naming_the_object(kind: str, tmp_path: Path) -> None:
    store = _store(kind, tmp_path, _Reader(b"x" * 100, stall=5.0), timeout=0.2)

    async def go() -> None:
        with pytest.raises(TransientStoreError, match=r"k bytes \[0, 10\) timed out after 0.2 s"):
            await store.get_range_streamed("k", start=0, end=10, sink=RecordingSink())

    asyncio.run(go())
