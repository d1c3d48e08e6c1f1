"""Coordination between the processes of one job, over JAX's distributed runtime.

Only this module touches ``jax.distributed``'s coordination client (a private
JAX API, so it is isolated here). Everything has a timeout: barriers use the
service's ``wait_at_barrier`` with a deadline and, when it expires, name the
processes that never arrived (each process marks its arrival in the key-value
store first). Device collectives such as ``sync_global_devices`` are never
used for coordination: they cannot time out.

With a single process every call returns at once.
"""

from __future__ import annotations

import threading
import zlib
from collections import defaultdict

import jax

from objckpt.errors import CoordinationError


class Coordinator:
    """Barriers and small-value exchange between the processes of a job."""

    process_index: int = 0
    process_count: int = 1

    @property
    def is_primary(self) -> bool:
        return self.process_index == 0

    def barrier(self, name: str, *, timeout: float) -> None:
        """Wait until every process reaches ``name``; CoordinationError names stragglers."""

    def all_gather(self, name: str, value: bytes, *, timeout: float) -> list[bytes]:
        """Every process's ``value``, by process index."""
        return [value]

    def broadcast(self, name: str, value: bytes | None, *, timeout: float) -> bytes:
        """The primary's ``value``, on every process."""
        assert value is not None
        return value


class _JaxCoordinator(Coordinator):
    def __init__(self, client: object, process_index: int, process_count: int) -> None:
        self._client = client
        self.process_index = process_index
        self.process_count = process_count

    def barrier(self, name: str, *, timeout: float) -> None:
        client = self._client
        client.key_value_set(f"{name}/arrived/{self.process_index}", "1")  # type: ignore[attr-defined]
        try:
            client.wait_at_barrier(name, int(timeout * 1000))  # type: ignore[attr-defined]
        except Exception as e:  # the service raises XlaRuntimeError(DEADLINE_EXCEEDED, ...)
            missing = self._missing(f"{name}/arrived/")
            who = ", ".join(str(p) for p in missing) if missing else "unknown"
            raise CoordinationError(
                f"barrier {name!r} timed out after {timeout:g} s; processes that did not arrive: {who} ({e})"
            ) from None

    def _missing(self, prefix: str) -> list[int]:
        try:
            entries = self._client.key_value_dir_get(prefix)  # type: ignore[attr-defined]
        except Exception:
            return []
        arrived = {int(k.rsplit("/", 1)[-1]) for k, _ in entries}
        return [p for p in range(self.process_count) if p not in arrived]

    def all_gather(self, name: str, value: bytes, *, timeout: float) -> list[bytes]:
        client = self._client
        client.key_value_set_bytes(f"{name}/{self.process_index}", value)  # type: ignore[attr-defined]
        self.barrier(f"{name}/barrier", timeout=timeout)
        return [
            client.blocking_key_value_get_bytes(f"{name}/{p}", int(timeout * 1000))  # type: ignore[attr-defined]
            for p in range(self.process_count)
        ]

    def broadcast(self, name: str, value: bytes | None, *, timeout: float) -> bytes:
        client = self._client
        if self.is_primary:
            assert value is not None
            client.key_value_set_bytes(name, value)  # type: ignore[attr-defined]
            return value
        try:
            return client.blocking_key_value_get_bytes(name, int(timeout * 1000))  # type: ignore[attr-defined,no-any-return]
        except Exception as e:
            raise CoordinationError(
                f"no word from the primary process on {name!r} within {timeout:g} s ({e})"
            ) from None


def get_coordinator() -> Coordinator:
    """The coordinator for this job: JAX's service when several processes run."""
    count = jax.process_count()
    if count == 1:
        return Coordinator()
    from jax._src import distributed  # private API: isolated to this module

    client = distributed.global_state.client
    if client is None:
        raise CoordinationError("several JAX processes but no jax.distributed client")
    return _JaxCoordinator(client, jax.process_index(), count)


_counter_lock = threading.Lock()
_counters: dict[str, int] = defaultdict(int)


def operation_tag(kind: str, url: str) -> str:
    """A name every process derives alike for its n-th ``kind`` operation on ``url``.

    Uses crc32 (not ``hash()``, which differs between processes) and a
    per-process counter: processes call save in the same order, so the n-th
    save of a URL gets the same tag everywhere without any messaging.
    """
    base = f"{kind}:{url}"
    with _counter_lock:
        _counters[base] += 1
        n = _counters[base]
    return f"objckpt/{kind}/{zlib.crc32(url.encode()):08x}/{n}"
