"""Peer copy: each process hands its local-tier bytes to one other process, through JAX's runtime.

:func:`exchange_with_peers` gives each process's bytes to a *keeper* in another failure domain
(:func:`default_keeper`), with JAX's own transfer server (``jax.experimental.transfer``, one per
process, started on the first exchange), never a protocol of our own. A process offers each
chunk as device arrays under an id (``await_pull``), one per segment the chunk spans (a file of
a step, sent from where it lies), at most ``_WINDOW`` chunks ahead of its keeper's
acknowledgements, and pulls the chunks of the process it keeps; not a device program, it runs
beside the training step's collectives from a background thread. The coordination service
carries only a few bytes per process (addresses, sizes, the keeper map's checksum,
acknowledgements), and every wait has a timeout, so a process that dies mid-copy ends the
exchange with an error on every process, never a hang (docs/TIERS.md, "The peer copy").
"""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import hashlib
import json
import socket
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from objckpt.core.jax_compat import single_device_sharding
from objckpt.errors import CoordinationError, PeerCopyUnavailableError
from objckpt.multihost import Coordinator, coordinator_host, get_coordinator, operation_tag
from objckpt.transfer.buffers import host_buffer

CHUNK_BYTES = 32 << 20
_MIN_CHUNK = 4096
_WINDOW = 4  # chunks offered ahead of the keeper's acknowledgements
_TRANSPORTS = 4  # sockets per transfer server: one stream does not fill a host's link
_TRANSFER_BYTES = (
    16 << 20
)  # the server's unit of work per socket (measured: 4 x 16 MiB moves ~1 GB/s on loopback, 1 x 256 MiB ~0.45)

_SLOWEST_RATE = 32 << 20  # bytes per second a transfer is given before its last barrier times out

Payload = bytes | bytearray | memoryview | np.ndarray
Payloads = Payload | Sequence[Payload]  # several segments, sent as one payload in order
Sink = Callable[[int, memoryview], None]


@dataclass(frozen=True)
class PeerCopy:
    """What a process received: the bytes of process ``owner``, of which it is the keeper.

    ``data`` holds them (``nbytes`` long) unless a ``sink`` took them chunk by chunk; then
    it is None.
    """

    owner: int
    nbytes: int
    data: np.ndarray | None


def default_keeper(process: int, count: int) -> int:
    """The process that keeps ``process``'s copy: half the job away, ``(p + P // 2) % P``.

    Processes are usually numbered host by host and rack by rack, so the farthest index is
    the likeliest to be in another failure domain.
    """
    return (process + count // 2) % count


def keeper_map(count: int, keeper_of: Callable[[int, int], int] | None = None) -> list[int]:
    """``keeper_of`` for every process, checked: each process keeps exactly one other's copy.

    Raises:
        ValueError: a keeper out of range, a process keeping its own copy, or two copies
            kept by one process (naming them).
    """
    rule = keeper_of or default_keeper
    keepers = [int(rule(p, count)) for p in range(count)]
    for p, k in enumerate(keepers):
        if not 0 <= k < count:
            raise ValueError(f"peer copy: keeper_of({p}, {count}) = {k} is not a process of this job (0..{count - 1})")
        if k == p and count > 1:
            raise ValueError(f"peer copy: keeper_of({p}, {count}) = {p}: a process cannot keep its own copy")
    owners: dict[int, list[int]] = {}
    for p, k in enumerate(keepers):
        owners.setdefault(k, []).append(p)
    doubled = {k: ps for k, ps in owners.items() if len(ps) > 1}
    if doubled:
        k, ps = min(doubled.items())
        raise ValueError(
            f"peer copy: process {k} would keep the copies of processes {ps}; each process keeps exactly one"
        )
    return keepers


def peer_copy_unavailable() -> str | None:
    """Why this process cannot take part in a peer copy, or None when it can.

    One process: nothing to exchange with. Otherwise JAX's transfer server must start on this
    process's devices (``jax.experimental.transfer``; absent from old JAX releases).
    """
    if jax.process_count() == 1:
        return "a single process has no peer"
    try:
        _server()
    except Exception as e:  # an old JAX, or a backend without a transfer server
        return f"JAX's transfer server does not start here ({type(e).__name__}: {e})"
    return None


def exchange_with_peers(
    payload: Payloads,
    *,
    timeout: float,
    keeper_of: Callable[[int, int], int] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    sink: Sink | None = None,
    name: str = "peer_copy",
) -> PeerCopy:
    """Send this process's ``payload`` to its keeper; receive the payload of the process it keeps.

    Every process of the job calls this together (same ``name``, ``keeper_of``), from one
    thread at a time (any thread: the transfer is not a device program).

    Args:
        payload: this process's bytes (any size, empty included): bytes, a memoryview, or a
            contiguous numpy array (a ``np.memmap`` of a file is read a chunk at a time), or a
            list of them, sent one after the other as one payload (no copy to join them).
        timeout: seconds each agreement barrier, pull, offer or acknowledgement waits for a
            process that makes no progress; the last barrier, which waits for the slowest
            transfer to end, adds the largest payload's time at ``_SLOWEST_RATE``.
        keeper_of: ``keeper_of(p, P)`` is the process that keeps process ``p``'s copy; a
            permutation with no fixed point. Default :func:`default_keeper`.
        chunk_bytes: the bytes offered per transfer (device and host memory stay within a
            few chunks beyond the payloads).
        sink: if given, called as ``sink(offset, chunk)`` in offset order with the received
            bytes instead of collecting them; ``chunk`` is valid during the call only.
        name: names the barriers (with a per-process count, like every objckpt operation).

    Returns:
        The owner's bytes (``data``), or ``data=None`` when a ``sink`` took them.

    Raises:
        PeerCopyUnavailableError: some process cannot take part (one process only, no
            transfer server); every process raises it, naming them.
        CoordinationError: a barrier timed out (naming who did not arrive), the processes
            disagree on the keeper map, or a process failed (naming it and its error).
        ValueError: ``keeper_of`` is not a permutation without fixed points.
    """
    if chunk_bytes < _MIN_CHUNK:
        raise ValueError(f"peer copy: chunk_bytes must be at least {_MIN_CHUNK}, got {chunk_bytes}")
    unavailable = peer_copy_unavailable()
    count, here = jax.process_count(), jax.process_index()
    if count == 1:
        raise PeerCopyUnavailableError(f"peer copy: {unavailable}")
    keepers = keeper_map(count, keeper_of)
    owner = keepers.index(here)
    data = _Segments(payload)
    keys = _Keys(get_coordinator(), operation_tag("peer_copy", name))
    try:
        address = _server().address() if unavailable is None else None
        infos = keys.agree(
            "sizes",
            timeout,
            size=data.size,
            cuts=data.cuts,
            unavailable=unavailable,
            keepers=keepers,
            address=address,
        )
        off: dict[str, list[int]] = {}
        for p, i in sorted(infos.items()):
            if i["unavailable"]:
                off.setdefault(i["unavailable"], []).append(p)
        if off:
            raise PeerCopyUnavailableError(
                "peer copy: " + "; ".join(f"processes {ps}: {why}" for why, ps in off.items())
            )
        differ = sorted(p for p, i in infos.items() if i["keepers"] != infos[here]["keepers"])
        if differ:
            raise CoordinationError(
                f"peer copy {name!r}: processes {differ} use another keeper map than process {here}"
            )
        nbytes = infos[owner]["size"]
        received: np.ndarray | None = None
        error: str | None = None
        try:  # not zero-filled: every byte is written as it arrives (pages fault in then, not here)
            received = None if sink is not None else host_buffer(nbytes, zeroed=False)
        except (MemoryError, OSError) as e:
            error = f"{type(e).__name__}: {e}"
        _check(keys.agree("ready", timeout, error=error), name)
        into = _Receiver(nbytes, received, sink, infos[owner]["cuts"])
        link = _Link(keys, here, owner, keepers[here], infos[owner]["address"], chunk_bytes, timeout)
        try:
            link.run(data, into)
        except BaseException:  # the others may never reach the next barrier: nobody is left to release
            keys.forget()
            raise
        biggest = max(int(i["size"]) for i in infos.values())
        _check(keys.agree("done", timeout + biggest / _SLOWEST_RATE, error=into.error), name)
    finally:  # every outcome decided at a barrier is the same on every process: each one releases
        keys.release()
    return PeerCopy(owner=owner, nbytes=nbytes, data=received)


def _as_bytes(payload: Payload) -> np.ndarray:
    """The payload as a flat uint8 array over the same memory (no copy)."""
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            raise ValueError("peer copy: a numpy payload must be C-contiguous")
        return payload.reshape(-1).view(np.uint8)
    return np.frombuffer(payload, dtype=np.uint8)


class _Segments:
    """A payload made of one or more buffers, read by offset as if it were one."""

    def __init__(self, payload: Payloads) -> None:
        parts: Sequence[Payload] = payload if isinstance(payload, (list, tuple)) else [payload]  # type: ignore[list-item]
        self.parts = [_as_bytes(p) for p in parts]
        self.starts = np.cumsum([0] + [p.size for p in self.parts]).tolist()
        self.size = int(self.starts[-1])

    @property
    def cuts(self) -> list[int]:
        """Where one segment ends and the next begins: no part of a chunk crosses one (:func:`_chunks`)."""
        return [start for start, part in zip(self.starts[1:-1], self.parts[1:]) if part.size]

    def read(self, offset: int, size: int) -> np.ndarray:
        """``size`` bytes from ``offset``: a view when they lie in one segment, else joined."""
        pieces = []
        for part, start in zip(self.parts, self.starts):
            lo, hi = max(offset, start), min(offset + size, start + part.size)
            if lo < hi:
                pieces.append(part[lo - start : hi - start])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class _Keys:
    """One exchange's keys in the coordination service: agreement steps, then released once
    (or forgotten at once when a process may never come to release them)."""

    def __init__(self, coordinator: Coordinator, tag: str) -> None:
        self.coordinator = coordinator
        self.tag = tag
        self.closed = False

    def agree(self, step: str, timeout: float, **mine: Any) -> dict[int, dict[str, Any]]:
        """Every process's ``mine``, once all have published theirs (a barrier with ``timeout``)."""
        if "keepers" in mine:
            mine["keepers"] = zlib.crc32(json.dumps(mine["keepers"]).encode())
        self.coordinator.publish(f"{self.tag}/{step}", json.dumps(mine).encode())
        try:
            self.coordinator.barrier(f"{self.tag}/{step}-barrier", timeout=timeout)  # not under the values
        except CoordinationError:
            self.forget()
            raise
        return {p: json.loads(v) for p, v in self.coordinator.collect(f"{self.tag}/{step}").items()}

    def release(self) -> None:
        if not self.closed:
            self.closed = True
            self.coordinator.release(self.tag)

    def forget(self) -> None:
        if not self.closed:
            self.closed = True
            self.coordinator.forget(self.tag)


def _check(infos: dict[int, dict[str, Any]], name: str) -> None:
    failed = {p: i["error"] for p, i in infos.items() if i.get("error")}
    if failed:
        raise CoordinationError(
            f"peer copy {name!r} failed: " + "; ".join(f"process {p}: {e}" for p, e in sorted(failed.items()))
        )


class _Receiver:
    """Takes the received chunks: into the buffer, or to the sink until it fails (then drops them)."""

    def __init__(self, nbytes: int, buffer: np.ndarray | None, sink: Sink | None, cuts: Sequence[int] = ()) -> None:
        self.nbytes = nbytes
        self.cuts = [int(c) for c in cuts]  # where the sender's segments meet (its chunks' parts end there)
        self.buffer = buffer
        self.sink = sink
        self.error: str | None = None

    def take(self, offset: int, chunk: np.ndarray) -> None:
        n = max(0, min(chunk.size, self.nbytes - offset))
        if n == 0 or self.error is not None:
            return
        if self.buffer is not None:
            np.copyto(self.buffer[offset : offset + n], chunk[:n])  # releases the GIL: pulls go on beside it
            return
        view = chunk[:n].data
        assert self.sink is not None
        try:
            self.sink(offset, view)
        except Exception as e:  # kept, not raised: the keeper goes on taking (and acknowledging) chunks
            self.error = f"{type(e).__name__}: {e}"[:1000]


@functools.cache
def _server() -> Any:
    """This process's transfer server, started once on its first local device's client."""
    from jax.experimental import transfer

    host = _this_host()
    client = jax.local_devices()[0].client
    return transfer.start_transfer_server(
        client, f"{host}:0", [f"{host}:0"] * _TRANSPORTS, transfer_size=_TRANSFER_BYTES
    )


def _this_host() -> str:
    """The address other hosts reach this one at: the interface that faces the coordinator."""
    coordinator = coordinator_host()
    if coordinator is None or coordinator in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1" if coordinator != "::1" else "[::1]"
    family = socket.AF_INET6 if ":" in coordinator else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing
        probe.connect((coordinator, 9))
        host = str(probe.getsockname()[0])
    return f"[{host}]" if family == socket.AF_INET6 else host


class _Link:
    """One exchange's transfers for this process: its chunks offered to its keeper, a window
    at a time, and its owner's chunks pulled, each acknowledged once taken."""

    def __init__(
        self, keys: _Keys, here: int, owner: int, keeper: int, owner_address: str, chunk_bytes: int, timeout: float
    ) -> None:
        self.keys = keys
        self.here, self.owner, self.keeper = here, owner, keeper
        self.owner_address = owner_address
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self.device = jax.local_devices()[0]

    def _id(self, sender: int, k: int) -> int:
        """The transfer id of ``sender``'s chunk ``k`` in this exchange (the same on both ends)."""
        digest = hashlib.blake2b(f"{self.keys.tag}/{sender}/{k}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def _deadline(self) -> datetime.datetime:
        return datetime.datetime.now() + datetime.timedelta(seconds=self.timeout)

    def run(self, data: _Segments, into: _Receiver) -> None:
        """Offer ``data`` to the keeper (a helper thread) while pulling the owner's ``into.nbytes``
        (this thread, ``_WINDOW`` pulls in flight). Chunk k is offered once the keeper has taken chunk
        k - ``_WINDOW``; each chunk pulled is acknowledged once taken."""
        with concurrent.futures.ThreadPoolExecutor(1 + _WINDOW, thread_name_prefix="objckpt-peer") as pool:
            offering = pool.submit(self._offer, data)
            try:
                self._pull(into, pool)
            finally:
                offering.result()

    def _offer(self, data: _Segments) -> None:
        server = _server()
        mine = _chunks(data.size, self.chunk_bytes, data.cuts)
        for k, parts in enumerate(mine):
            if k >= _WINDOW:
                self._await_ack(k - _WINDOW)
            arrays = jax.device_put([data.read(offset, size) for offset, size in parts], self.device)
            server.await_pull(self._id(self.here, k), arrays, timeout=self._deadline())
        for k in range(max(0, len(mine) - _WINDOW), len(mine)):  # the keeper has taken every chunk
            self._await_ack(k)

    def _pull(self, into: _Receiver, pool: concurrent.futures.Executor) -> None:
        theirs = _chunks(into.nbytes, self.chunk_bytes, into.cuts)
        if not theirs:
            return
        connection = _server().connect(self.owner_address)
        sharding = single_device_sharding(self.device)

        def pull(k: int) -> list[jax.Array]:
            specs = [jax.ShapeDtypeStruct((size,), np.uint8, sharding=sharding) for _, size in theirs[k]]
            return connection.pull(self._id(self.owner, k), specs, timeout=self._deadline())  # type: ignore[no-any-return]

        inflight = {k: pool.submit(pull, k) for k in range(min(_WINDOW, len(theirs)))}
        for k, parts in enumerate(theirs):
            got = inflight.pop(k).result()
            for (offset, _), array in zip(parts, got, strict=True):
                into.take(offset, np.asarray(array))
            del got
            self.keys.coordinator.publish(f"{self.keys.tag}/ack{k}", b"1")
            if k + _WINDOW < len(theirs):  # waits in the pool until the owner offers it (after this ack)
                inflight[k + _WINDOW] = pool.submit(pull, k + _WINDOW)

    def _await_ack(self, k: int) -> None:
        self.keys.coordinator.await_value(f"{self.keys.tag}/ack{k}", self.keeper, timeout=self.timeout)


def _chunks(nbytes: int, chunk_bytes: int, cuts: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Every chunk of a payload of ``nbytes`` (full ones, then the rest) as its parts, (offset,
    size) each, cut where a segment ends.

    A chunk goes as one array per part (``await_pull`` and ``pull`` take lists), so a chunk
    over the end of one file and the start of the next is sent from both as they lie, never
    joined into a copy first. Both ends compute the same parts from the sender's ``cuts``.
    """
    inside = sorted({c for c in cuts if 0 < c < nbytes})
    out = []
    for offset in range(0, nbytes, chunk_bytes):
        end = min(offset + chunk_bytes, nbytes)
        bounds = [offset, *(c for c in inside if offset < c < end), end]
        out.append([(a, b - a) for a, b in zip(bounds, bounds[1:])])
    return out
