"""Peer copy: each process hands its local-tier bytes to one other process, over JAX's devices.

The local tier keeps every process's own shards on its own host; losing that host's disk
would lose them. :func:`exchange_with_peers` gives each process's bytes to a *keeper* in
another failure domain (by default process ``(p + P // 2) % P``), so a restart that lost
one host still restores from the local tiers, the missing host's bytes coming from its
keeper.

The bytes move with JAX's own runtime, never a protocol of our own: one device per
process forms a mesh, and a jitted ``shard_map`` of ``jax.lax.ppermute`` sends each
process's chunk to its keeper (ICI/DCN on accelerators, JAX's CPU collectives, gloo or
MPI, on CPU). The coordination service carries only a few bytes per process: the sizes,
whether this process can take part, and a checksum of the keeper map, agreed at a barrier
with a timeout that names the processes that did not arrive. Its key-value store is never
used for the payload: it is built for small messages.

Every process sends the same number of chunks of the same shapes (payloads are padded to
the largest, in chunks of ``chunk_bytes``; the last one rounded up to a power of two so
few shapes are ever compiled), so the collectives line up. At most two chunks are in
flight (one being copied to the host while the next one moves), so device and host
memory beyond the payloads stay within about four chunks.

A collective has no timeout, so everything that can fail is decided before the first
one: availability, sizes, the keeper map and the receive buffer are agreed at barriers,
and a ``sink`` that fails mid-way stops being called but its process keeps taking part,
reporting the failure at the closing barrier. A process that dies inside a transfer is
detected by JAX's heartbeat, as for any collective.

The transfers are device programs like a training step's, so every process must issue them
in the same order relative to its other collectives: call :func:`exchange_with_peers` at the
same point of every process's program (between steps, or from one background thread while
no other thread launches collectives). Two processes that launch a step's collective and a
peer-copy chunk in opposite orders wait on each other for ever.

objckpt never turns JAX's CPU collectives on (``jax_cpu_collectives_implementation`` is the
user's setting): without them, on CPU with several processes, :func:`peer_copy_unavailable`
says why and :func:`exchange_with_peers` raises :class:`~objckpt.errors.PeerCopyUnavailableError`,
so a manager can turn its peer copy off.
"""

from __future__ import annotations

import functools
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from objckpt.errors import CoordinationError, PeerCopyUnavailableError
from objckpt.multihost import Coordinator, get_coordinator, operation_tag

CHUNK_BYTES = 64 << 20
_MIN_TAIL = 4096
_AXIS = "peers"

Payload = bytes | bytearray | memoryview | np.ndarray
Sink = Callable[[int, memoryview], None]


@dataclass(frozen=True)
class PeerCopy:
    """What a process received: the bytes of process ``owner``, of which it is the keeper.

    ``data`` holds them (``nbytes`` long) unless a ``sink`` took them chunk by chunk; then
    it is None.
    """

    owner: int
    nbytes: int
    data: bytearray | None


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

    One process: nothing to exchange with. CPU devices need JAX's cross-process CPU
    collectives (``jax_cpu_collectives_implementation``, the user's setting).
    """
    if jax.process_count() == 1:
        return "a single process has no peer"
    if jax.default_backend() == "cpu" and not getattr(jax.config, "jax_cpu_collectives_implementation", None):
        return (
            "JAX's CPU collectives are off (jax_cpu_collectives_implementation is unset): CPU devices of "
            "several processes cannot exchange bytes; set it (e.g. 'gloo') before jax.distributed.initialize"
        )
    return None


def exchange_with_peers(
    payload: Payload,
    *,
    timeout: float,
    keeper_of: Callable[[int, int], int] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    sink: Sink | None = None,
    name: str = "peer_copy",
) -> PeerCopy:
    """Send this process's ``payload`` to its keeper; receive the payload of the process it keeps.

    Every process of the job calls this together (same ``name``, ``keeper_of``, ``chunk_bytes``),
    at the same point of its program relative to other collectives (see the module docstring).

    Args:
        payload: this process's bytes (any size, empty included): bytes, a memoryview, or a
            contiguous numpy array (a ``np.memmap`` of a file is read a chunk at a time).
        timeout: seconds each agreement barrier waits for every process.
        keeper_of: ``keeper_of(p, P)`` is the process that keeps process ``p``'s copy; a
            permutation with no fixed point. Default :func:`default_keeper`.
        chunk_bytes: the bytes moved per collective (device and host memory stay within
            four chunks beyond the payloads).
        sink: if given, called as ``sink(offset, chunk)`` in offset order with the received
            bytes instead of collecting them; ``chunk`` is valid during the call only.
        name: names the barriers (with a per-process count, like every objckpt operation).

    Returns:
        The owner's bytes (``data``), or ``data=None`` when a ``sink`` took them.

    Raises:
        PeerCopyUnavailableError: some process cannot take part (one process only, CPU
            collectives off); every process raises it, naming them.
        CoordinationError: a barrier timed out (naming who did not arrive), the processes
            disagree on the keeper map, or a process failed (naming it and its error).
        ValueError: ``keeper_of`` is not a permutation without fixed points.
    """
    if chunk_bytes < _MIN_TAIL:
        raise ValueError(f"peer copy: chunk_bytes must be at least {_MIN_TAIL}, got {chunk_bytes}")
    unavailable = peer_copy_unavailable()
    count, here = jax.process_count(), jax.process_index()
    if count == 1:
        raise PeerCopyUnavailableError(f"peer copy: {unavailable}")
    keepers = keeper_map(count, keeper_of)
    owner = keepers.index(here)
    data = _as_bytes(payload)
    keys = _Keys(get_coordinator(), operation_tag("peer_copy", name))
    try:
        infos = keys.agree("sizes", timeout, size=data.size, unavailable=unavailable, keepers=keepers)
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
        largest = max(i["size"] for i in infos.values())
        received: bytearray | None = None
        error: str | None = None
        try:
            received = None if sink is not None else bytearray(nbytes)
        except MemoryError as e:
            error = f"MemoryError: {e}"
        _check(keys.agree("ready", timeout, error=error), name)
        into = _Receiver(nbytes, received, sink)
        try:
            _transfer(data, largest, keepers, chunk_bytes, into)
        except BaseException:  # the others may never reach the next barrier: nobody is left to release
            keys.forget()
            raise
        _check(keys.agree("done", timeout, error=into.error), name)
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

    def __init__(self, nbytes: int, buffer: bytearray | None, sink: Sink | None) -> None:
        self.nbytes = nbytes
        self.buffer = memoryview(buffer) if buffer is not None else None
        self.sink = sink
        self.error: str | None = None

    def take(self, offset: int, chunk: np.ndarray) -> None:
        n = max(0, min(chunk.size, self.nbytes - offset))
        if n == 0 or self.error is not None:
            return
        view = chunk[:n].data
        if self.buffer is not None:
            self.buffer[offset : offset + n] = view
            return
        assert self.sink is not None
        try:
            self.sink(offset, view)
        except Exception as e:  # kept, not raised: the other processes wait for this one's collectives
            self.error = f"{type(e).__name__}: {e}"[:1000]


def _chunks(largest: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, padded size) of every chunk: full ones, then a tail rounded up to a power of two."""
    out = [(off, chunk_bytes) for off in range(0, largest - chunk_bytes + 1, chunk_bytes)]
    done = len(out) * chunk_bytes
    if done < largest:
        out.append((done, min(chunk_bytes, max(_MIN_TAIL, 1 << (largest - done - 1).bit_length()))))
    return out


def _transfer(data: np.ndarray, largest: int, keepers: list[int], chunk_bytes: int, into: _Receiver) -> None:
    """Move every chunk to its keeper, two in flight: chunk k+1 is sent before chunk k is taken."""
    mesh = _mesh()
    device = mesh.devices[jax.process_index()]
    sharding = NamedSharding(mesh, P(_AXIS))
    send = _sender(mesh, tuple(keepers))
    pending: tuple[int, jax.Array] | None = None
    for offset, size in _chunks(largest, chunk_bytes):
        piece = data[offset : offset + size]
        if piece.size < size:  # past this process's end: zeros, never stale memory
            piece = np.concatenate([piece, np.zeros(size - piece.size, np.uint8)])
        local = jax.device_put(piece.reshape(1, size), device)
        moved = send(jax.make_array_from_single_device_arrays((len(keepers), size), sharding, [local]))
        if pending is not None:
            _take(into, *pending)
        pending = (offset, moved)
    if pending is not None:
        _take(into, *pending)


def _take(into: _Receiver, offset: int, moved: jax.Array) -> None:
    shard = moved.addressable_shards[0].data
    into.take(offset, np.asarray(shard).reshape(-1))
    moved.delete()


def _mesh() -> Mesh:
    """One device per process (its lowest id), in process order: the peer-copy mesh."""
    first: dict[int, Any] = {}
    for d in jax.devices():
        if d.process_index not in first or d.id < first[d.process_index].id:
            first[d.process_index] = d
    return Mesh(np.array([first[p] for p in sorted(first)]), (_AXIS,))


@functools.cache
def _sender(mesh: Mesh, keepers: tuple[int, ...]) -> Callable[[jax.Array], jax.Array]:
    perm = [(p, k) for p, k in enumerate(keepers)]

    def body(x: jax.Array) -> jax.Array:
        return jax.lax.ppermute(x, _AXIS, perm)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS)))  # type: ignore[no-any-return]
