"""Coordination between the processes of one job, over JAX's distributed runtime.

Only this module touches ``jax.distributed``'s coordination client (a private
JAX API, so it is isolated here). Everything has a timeout: barriers use the
service's ``wait_at_barrier`` with a deadline and, when it expires, name the
processes that never arrived (each process marks its arrival in the key-value
store first). Device collectives such as ``sync_global_devices`` are never
used for coordination: they cannot time out.

Everything a save or restore sets in the key-value store lives under one
operation tag and is deleted once every process is done with it
(:meth:`Coordinator.release`), so the coordinator does not grow with each save.
Values are small (a few hundred bytes per process): indexes go to the object
store, never through the coordinator.

With a single process every call returns at once.
"""

from __future__ import annotations

import re
import threading
import zlib
from collections import defaultdict

import jax

from objckpt.errors import CoordinationError


class Coordinator:
    """Barriers and small-value exchange between the processes of a job (one process: no-ops)."""

    process_index: int = 0
    process_count: int = 1

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}

    @property
    def is_primary(self) -> bool:
        return self.process_index == 0

    def barrier(self, name: str, *, timeout: float) -> None:
        """Wait until every process reaches ``name``; CoordinationError names stragglers."""

    def publish(self, name: str, value: bytes) -> None:
        """Set this process's ``value`` under ``name`` (see :meth:`collect`)."""
        self._values[f"{name}/{self.process_index}"] = value

    def collect(self, name: str) -> dict[int, bytes]:
        """The values published under ``name`` so far, by process (call after a barrier)."""
        prefix = f"{name}/"
        return {int(k[len(prefix) :]): v for k, v in self._values.items() if k.startswith(prefix)}

    def broadcast(self, name: str, value: bytes | None, *, timeout: float) -> bytes:
        """The primary's ``value``, on every process."""
        assert value is not None
        return value

    def await_value(self, name: str, process: int, *, timeout: float) -> bytes:
        """What ``process`` published under ``name``, once it has (CoordinationError after ``timeout``)."""
        key = f"{name}/{process}"
        if key not in self._values:
            raise CoordinationError(f"process {process} published nothing under {name!r}")
        return self._values[key]

    def release(self, tag: str) -> None:
        """This process is done with every key under ``tag``; the last one to say so deletes them."""
        self._values = {k: v for k, v in self._values.items() if not k.startswith(f"{tag}/")}

    def forget(self, tag: str) -> None:
        """Delete every key under ``tag`` now (after a failure, when some process may never release)."""
        self.release(tag)


class _JaxCoordinator(Coordinator):
    def __init__(self, client: object, process_index: int, process_count: int) -> None:
        super().__init__()
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
            if not missing:  # keys unreadable, or a process marked its arrival and died before waiting
                missing = [p for p in _named_in(str(e), self.process_count) if p != self.process_index]
            who = ", ".join(str(p) for p in missing) if missing else "none named by the coordination service"
            raise CoordinationError(
                f"barrier {name!r} timed out after {timeout:g} s; processes that did not arrive: {who} ({e})"
            ) from None

    def _missing(self, prefix: str) -> list[int] | None:
        """The processes with no arrival key under ``prefix``; None when the keys cannot tell:
        the service refused the call, or this process's own key is gone (a peer that gave up
        first has already deleted the operation's keys, see :meth:`forget`)."""
        try:
            entries = self._client.key_value_dir_get(prefix)  # type: ignore[attr-defined]
        except Exception:
            return None
        arrived = {int(k.rsplit("/", 1)[-1]) for k, _ in entries}
        if self.process_index not in arrived:
            return None
        return [p for p in range(self.process_count) if p not in arrived]

    def publish(self, name: str, value: bytes) -> None:
        self._client.key_value_set_bytes(f"{name}/{self.process_index}", value)  # type: ignore[attr-defined]

    def collect(self, name: str) -> dict[int, bytes]:
        entries = self._client.key_value_dir_get_bytes(f"{name}/")  # type: ignore[attr-defined]
        return {int(k.rsplit("/", 1)[-1]): v for k, v in entries}

    def release(self, tag: str) -> None:
        try:
            count = self._client.key_value_increment(f"{tag}/released", 1)  # type: ignore[attr-defined]
            if count >= self.process_count:
                self._client.key_value_delete(tag)  # type: ignore[attr-defined]  # the key and all under it
        except Exception:  # the service is gone or failing: nothing left to clean
            pass

    def forget(self, tag: str) -> None:
        try:
            self._client.key_value_delete(tag)  # type: ignore[attr-defined]
        except Exception:
            pass

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

    def await_value(self, name: str, process: int, *, timeout: float) -> bytes:
        try:
            return self._client.blocking_key_value_get_bytes(f"{name}/{process}", int(timeout * 1000))  # type: ignore[attr-defined,no-any-return]
        except Exception as e:
            raise CoordinationError(f"no word from process {process} on {name!r} within {timeout:g} s ({e})") from None


def coordinator_host() -> str | None:
    """The host part of ``jax.distributed``'s coordinator address (None: not initialised)."""
    from jax._src import distributed  # private API: isolated to this module

    address = distributed.global_state.coordinator_address
    if not address:
        return None
    host = address.rsplit(":", 1)[0]
    return host.strip("[]")


def _named_in(message: str, count: int) -> list[int]:
    """The processes a coordination-service error names as missing, when the arrival keys
    cannot be read (the service may refuse every call once it has declared a task dead).

    The service's barrier error lists them after "timed out task names:", one per line,
    or as ``/task:N``.
    """
    found: set[int] = set()
    listed = re.search(r"timed out task names:\s*((?:\d+\s*)+)", message)
    if listed:
        found.update(int(n) for n in listed.group(1).split())
    found.update(int(n) for n in re.findall(r"/task:(\d+)", message))
    return sorted(p for p in found if 0 <= p < count)


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


def preemption_service_running() -> bool:
    """Whether JAX's preemption sync service runs in this process: ``jax.distributed.initialize``
    started it (``jax_enable_preemption_service``, on by default) and installed its SIGTERM handler."""
    from jax._src import distributed  # private API: isolated to this module

    return distributed.global_state.preemption_sync_manager is not None
