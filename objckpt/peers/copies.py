"""The local tier's peer copies, moved by :func:`objckpt.peers.transfer.exchange_with_peers`.

After a local save, every process sends that step (its data file, then its manifest, then
a 16-byte trailer: ``OBJCKPT1`` and the manifest's length) to its keeper, which writes it
under ``process_<keeper>/peer/process_<owner>/step_<N>/`` in the local tier's own format,
manifest last (:func:`send_to_keepers`). On a restore that finds a process's own copy
missing, the keepers send the copies back the other way, each to its owner, which restores
from the bytes in memory (:func:`fetch_from_keepers`) and writes them into its own
directory afterwards, in the background (:func:`keep_received`).

Every process calls them together, sending an empty payload when it
has nothing to send. The bytes travel through JAX's runtime only (the peer-copy module);
what arrives is checked before it is kept or read: the manifest strictly (its crc32c, its
boxes), the root and the process it names (this manager's root; the owner the copy is
for), and every box by its crc32c when it is restored.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from objckpt.core.format.local import MANIFEST, LocalManifest, authentic, parse_local_manifest
from objckpt.errors import FormatError
from objckpt.locations.local_dirs import (
    MANIFEST_LIMIT,
    ForeignStepError,
    LocalTier,
    commit_manifest,
    read_regular,
    write_step,
)
from objckpt.peers.transfer import exchange_with_peers, keeper_map
from objckpt.roots.step_names import step_dir

log = logging.getLogger("objckpt")

_MAGIC = b"OBJCKPT1"
_TRAILER = struct.Struct("<8sQ")
Keeper = Callable[[int, int], int]


def payload_of(tier: LocalTier, directory: Path, owner: int | None = None) -> list[np.ndarray]:
    """The step in ``directory`` (``owner``'s, default this process's) as one payload in two segments:
    the data file (mapped, read as it is sent), then the manifest and the trailer."""
    manifest = tier.read(directory, owner)  # this root's, this owner's, inside the tier
    manifest_bytes = read_regular(directory / MANIFEST, MANIFEST_LIMIT)
    if parse_local_manifest(manifest_bytes) != manifest:
        raise FormatError(f"{directory / MANIFEST} changed while it was read")
    path = directory / manifest.data
    if path.stat().st_size < manifest.data_size:
        raise FormatError(f"{path} is shorter than its manifest says")
    data = np.memmap(path, np.uint8, "r", shape=(manifest.data_size,)) if manifest.data_size else np.zeros(0, np.uint8)
    tail = manifest_bytes + _TRAILER.pack(_MAGIC, len(manifest_bytes))
    return [data, np.frombuffer(tail, np.uint8)]


@dataclass(frozen=True)
class Received:
    """A process's own step, brought back from its keeper: its manifest and its data file's bytes."""

    manifest: LocalManifest
    data: np.ndarray


def _manifest_of(
    read: Callable[[int, int], bytes], nbytes: int, where: str, tier: LocalTier, owner: int
) -> LocalManifest:
    """The manifest of a payload of ``nbytes`` (data file, manifest, trailer), read through
    ``read(offset, size)``, checked to leave room for its data, to be ``owner``'s step of
    ``tier``'s root and sealed under its run's key in that root.

    Raises:
        FormatError: not a local-tier step, or not sealed under its run's key.
        ForeignStepError: another root's or process's step, or a run the root holds no key of.
    """
    if nbytes < _TRAILER.size:
        raise FormatError(f"peer copy {where}: {nbytes} bytes is not a local-tier step")
    magic, length = _TRAILER.unpack(read(nbytes - _TRAILER.size, _TRAILER.size))
    end = nbytes - _TRAILER.size
    if magic != _MAGIC or length > end:
        raise FormatError(f"peer copy {where}: not a local-tier step")
    raw = read(end - length, length)
    manifest = parse_local_manifest(raw)
    if manifest.data_size > end - length:
        raise FormatError(f"peer copy {where}: {end - length} data bytes, its manifest says {manifest.data_size}")
    check_whose(manifest, tier.url, owner, where)
    key = tier.key_of(manifest.save_id)
    if key is None:
        raise ForeignStepError(f"peer copy {where}: {tier.url} holds no key of its run {manifest.save_id}")
    if not authentic(raw, key):
        raise FormatError(f"peer copy {where}: not sealed under its run's key (an edited or forged manifest)")
    return manifest


def check_whose(manifest: LocalManifest, url: str, owner: int, where: str) -> None:
    """Refuse a copy that is not ``owner``'s step of the root ``url`` (ForeignStepError)."""
    if manifest.root != url:
        raise ForeignStepError(f"peer copy {where}: a step of the root {manifest.root}, not of {url}")
    if manifest.process_index != owner:
        raise ForeignStepError(f"peer copy {where}: process {manifest.process_index}'s step, not process {owner}'s")


def unpack(payload: np.ndarray, where: str, tier: LocalTier, owner: int) -> Received:
    """A payload (data file, manifest, trailer) as its manifest and data, checked as ``owner``'s step
    of ``tier``'s root (:func:`_manifest_of`)."""
    read = lambda at, n: payload[at : at + n].tobytes()  # noqa: E731
    manifest = _manifest_of(read, payload.size, f"from {where}", tier, owner)
    return Received(manifest, payload[: manifest.data_size])


def keep_received(tier: LocalTier, received: Received) -> None:
    """Write a step brought back from the keeper into this process's own directory, manifest last."""
    check_whose(received.manifest, tier.url, tier.process_index, "kept")
    key = tier.key(received.manifest.save_id)
    directory = tier.inside(tier.step_dir(received.manifest.step))
    write_step(directory, received.manifest, received.data, key=key, checksum=False)
    tier.retain()


class _Incoming:
    """A sink writing received bytes to a file, then turned into a step directory under ``base``."""

    def __init__(self, tier: LocalTier, owner: int) -> None:
        base = tier.inside(tier.held_dir(owner))
        base.mkdir(parents=True, exist_ok=True)
        tier.inside(base)
        self.tier, self.owner = tier, owner
        self.base = base
        self.path = base / f".incoming-{os.getpid()}"
        self.file = open(self.path, "wb")
        self.size = 0

    def __call__(self, offset: int, chunk: memoryview) -> None:
        self.file.seek(offset)
        self.file.write(chunk)
        self.size = max(self.size, offset + len(chunk))

    def finish(self, nbytes: int) -> LocalManifest | None:
        """Place what arrived (``nbytes``; 0: nothing was sent) as a step; its manifest."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        try:
            if nbytes == 0:
                return None
            if self.size < nbytes:
                raise FormatError(f"peer copy into {self.base}: {self.size} of {nbytes} bytes arrived")
            with open(self.path, "r+b") as f:

                def read(at: int, n: int) -> bytes:
                    f.seek(at)
                    return f.read(n)

                manifest = _manifest_of(read, nbytes, f"into {self.base}", self.tier, self.owner)
                f.truncate(manifest.data_size)
            directory = self.tier.inside(self.base / step_dir(manifest.step))
            directory.mkdir(parents=True, exist_ok=True)
            self.tier.inside(directory)
            os.replace(self.path, directory / manifest.data)
            commit_manifest(directory, manifest, self.tier.key(manifest.save_id))
            self.tier.read(directory, self.owner)  # whole and consistent, or an error now
            return manifest
        finally:
            if self.path.exists():
                self.path.unlink()


def send_to_keepers(tier: LocalTier, step: int | None, *, timeout: float, keeper_of: Keeper | None) -> int | None:
    """Send this process's ``step`` (None or absent: nothing) to its keeper; keep what this process receives.

    Returns the step received from the process this one keeps (None: it sent nothing).
    """
    directory = tier.step_dir(step) if step is not None else None
    try:
        payload = payload_of(tier, directory) if directory is not None else []
    except (OSError, FormatError) as e:  # nothing to send: still take part
        log.warning("objckpt peer copy: step %s of process %d is not sendable: %s", step, tier.process_index, e)
        payload = []
    count = tier.process_count
    keepers = keeper_map(count, keeper_of)
    owner = keepers.index(tier.process_index)
    incoming = _Incoming(tier, owner)
    copy = exchange_with_peers(payload, timeout=timeout, keeper_of=keeper_of, sink=incoming, name="local_tier")
    manifest = incoming.finish(copy.nbytes)
    tier.retain()
    return manifest.step if manifest is not None else None


def fetch_from_keepers(
    tier: LocalTier, step: int, fetch: dict[int, int], *, timeout: float, keeper_of: Keeper | None
) -> Received | None:
    """Bring back, from their keepers, the copies of ``step`` that the processes in ``fetch`` lost.

    ``fetch``: ``{owner: keeper}``. Every process calls this; a keeper sends its held copy to
    its owner, everyone else an empty payload. Returns this process's step, in memory (None:
    it was sent nothing).
    """
    count, here = tier.process_count, tier.process_index
    keepers = keeper_map(count, keeper_of)
    owner_of = {k: p for p, k in enumerate(keepers)}

    def back(process: int, n: int) -> int:  # in reverse, a keeper "keeps" its owner
        return owner_of[process]

    mine = owner_of[here]
    payload: list[np.ndarray] = []
    if fetch.get(mine) == here:
        payload = payload_of(tier, tier.held_dir(mine) / step_dir(step), mine)
    copy = exchange_with_peers(payload, timeout=timeout, keeper_of=back, name="local_tier_back")
    if copy.nbytes == 0 or copy.data is None:
        return None
    received = unpack(copy.data, f"process {keepers[here]}", tier, here)
    if received.manifest.step != step:
        raise FormatError(f"peer copy from process {keepers[here]}: step {received.manifest.step}, not {step}")
    return received


class Keepers:
    """The peer copies of ``tier``'s steps, as :class:`objckpt.locations.tiers.StepLocations` uses them."""

    def __init__(self, tier: LocalTier, *, timeout: float, keeper_of: Keeper | None) -> None:
        self.tier = tier
        self.timeout = timeout
        self.keeper_of = keeper_of

    def keepers(self) -> list[int]:
        return keeper_map(self.tier.process_count, self.keeper_of)

    def send(self, step: int | None) -> int | None:
        """:func:`send_to_keepers` of this process's ``step`` (None: nothing to send)."""
        return send_to_keepers(self.tier, step, timeout=self.timeout, keeper_of=self.keeper_of)

    def fetch(self, step: int, fetch: dict[int, int]) -> Received | None:
        return fetch_from_keepers(self.tier, step, fetch, timeout=self.timeout, keeper_of=self.keeper_of)

    def keep(self, received: Received) -> None:
        keep_received(self.tier, received)
