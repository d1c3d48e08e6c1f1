"""A minimal third-party objckpt store: ``dictstore://<space>/<prefix>``.

It exists to prove the plugin path end to end: objckpt never imports this
package; ``from_url("dictstore://...")`` finds it through the
``objckpt.stores`` entry point declared in ``pyproject.toml`` (the tests fake
the installation with a ``.dist-info`` directory on ``sys.path``), and it
passes the same conformance suite as the built-in stores
(``tests/test_dictstore.py``: :class:`objckpt.testing.StoreConformance`).

Objects live in process-wide dicts, one per ``<space>``; a lock makes
create-if-absent atomic across threads and event loops.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from objckpt.errors import ObjectExistsError, ObjectNotFoundError
from objckpt.storage import ObjectInfo, PutMode, Store

_SPACES: dict[str, dict[str, tuple[bytes, float]]] = {}
_LOCK = threading.Lock()


def _check_key(key: str) -> None:
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"invalid key {key!r}")


class DictStore(Store):
    """Objects in a dict; keys under ``prefix`` within one named space."""

    def __init__(self, space: str, prefix: str = "") -> None:
        self._space = space
        self._prefix = prefix.strip("/")
        self.url = f"dictstore://{space}" + (f"/{self._prefix}" if self._prefix else "")
        with _LOCK:
            self._objects = _SPACES.setdefault(space, {})

    def _full(self, key: str) -> str:
        _check_key(key)
        return f"{self._prefix}/{key}" if self._prefix else key

    def _missing(self, key: str) -> ObjectNotFoundError:
        return ObjectNotFoundError(f"{self.url}/{key}: no such object")

    async def get_range(self, key: str, *, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end})")
        with _LOCK:
            entry = self._objects.get(self._full(key))
        if entry is None:
            raise self._missing(key)
        return entry[0][start:end]

    async def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        full = self._full(key)
        payload = bytes(data)  # own the bytes: the caller may reuse its buffer
        with _LOCK:
            if mode == "create" and full in self._objects:
                raise ObjectExistsError(f"{self.url}/{key}: object already exists")
            self._objects[full] = (payload, time.time())

    async def delete(self, key: str) -> None:
        with _LOCK:
            self._objects.pop(self._full(key), None)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = f"{self._prefix}/" if self._prefix else ""
        with _LOCK:
            items = list(self._objects.items())
        out = [
            ObjectInfo(key=name[len(base) :], size=len(data), last_modified=mtime)
            for name, (data, mtime) in items
            if name.startswith(base) and name[len(base) :].startswith(prefix)
        ]
        return sorted(out, key=lambda o: o.key)

    async def head(self, key: str) -> ObjectInfo:
        with _LOCK:
            entry = self._objects.get(self._full(key))
        if entry is None:
            raise self._missing(key)
        return ObjectInfo(key=key, size=len(entry[0]), last_modified=entry[1])

    def child(self, subpath: str) -> DictStore:
        sub = subpath.strip("/")
        _check_key(sub)
        return DictStore(self._space, f"{self._prefix}/{sub}" if self._prefix else sub)


def open_dictstore(url: str, **storage_options: Any) -> DictStore:
    """The ``objckpt.stores`` entry point: ``(url, **storage_options) -> Store``."""
    if storage_options:
        raise TypeError(f"dictstore takes no storage options, got {sorted(storage_options)}")
    rest = url.split("://", 1)[1]
    space, _, prefix = rest.partition("/")
    if not space:
        raise ValueError(f"dictstore URL needs a space name: {url!r}")
    return DictStore(space, prefix)
