"""The local tier's peer copies, moved by :func:`objckpt.peers.transfer.exchange_with_peers`.

After a local save, every process sends that step (each file of its checkpoint and its record,
then a table of their names and sizes and a 16-byte trailer: ``OBJCKPT2`` and the table's
length) to its keeper, which writes the files under
``process_<keeper>/peer/process_<owner>/step_<N>/``, the record last (:func:`send_to_keepers`).
On a restore that finds a process's own copy missing, the keepers send the copies back the
other way, each to its owner, which restores from the files in memory
(:func:`fetch_from_keepers`) and writes them into its own directory afterwards, in the
background (:func:`keep_received`).

Every process calls them together, sending an empty payload when it has nothing to send.
The bytes travel through JAX's runtime only (the transfer module); what arrives is checked
before it is kept or read: its record strictly (its crc32c, the root and the process it names:
this manager's root, the owner the copy is for; sealed under its run's key in that root) and
the manifest it pins; every index object and piece by its crc32c when it is restored.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from objckpt.core.format import MANIFEST_KEY
from objckpt.core.format.local import RECORD, PartRecord, authentic, parse_part_record
from objckpt.core.strict import strict_json
from objckpt.errors import FormatError
from objckpt.locations.local_dirs import (
    MANIFEST_LIMIT,
    ForeignStepError,
    LocalTier,
    commit_record,
    place,
    step_objects,
    tmp_dir,
)
from objckpt.peers.transfer import exchange_with_peers, keeper_map
from objckpt.roots.step_names import step_dir
from objckpt.storage.urls import check_relative

log = logging.getLogger("objckpt")

_MAGIC = b"OBJCKPT2"
_TRAILER = struct.Struct("<8sQ")
Keeper = Callable[[int, int], int]


def payload_of(tier: LocalTier, directory: Path, owner: int | None = None) -> list[np.ndarray]:
    """The step in ``directory`` (``owner``'s, default this process's) as one payload: each of its
    files (mapped, read as they are sent), then the table of their names and sizes and the trailer."""
    tier.read(directory, owner)  # this root's, this owner's, inside the tier, its manifest pinned
    objects = step_objects(tier.inside(directory))
    names = sorted(objects)
    table = json.dumps({"files": [[name, int(objects[name].size)] for name in names]}).encode()
    tail = table + _TRAILER.pack(_MAGIC, len(table))
    return [*(objects[name] for name in names), np.frombuffer(tail, np.uint8)]


@dataclass(frozen=True)
class Received:
    """A process's own step, brought back from its keeper: its record and its files' bytes, by key."""

    record: PartRecord
    objects: dict[str, np.ndarray]


def _files_of(read: Callable[[int, int], bytes], nbytes: int, where: str) -> list[tuple[str, int, int]]:
    """The files of a payload of ``nbytes`` read through ``read(offset, size)``: (key, offset, size)."""
    if nbytes < _TRAILER.size:
        raise FormatError(f"peer copy {where}: {nbytes} bytes is not a local-tier step")
    magic, length = _TRAILER.unpack(read(nbytes - _TRAILER.size, _TRAILER.size))
    end = nbytes - _TRAILER.size
    if magic != _MAGIC or length > min(end, MANIFEST_LIMIT):
        raise FormatError(f"peer copy {where}: not a local-tier step")
    table = strict_json(read(end - length, length), "peer copy table")
    entries = table.get("files") if isinstance(table, dict) else None
    if not isinstance(entries, list):
        raise FormatError(f"peer copy {where}: its table lists no files")
    out, offset = [], 0
    for entry in entries:
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], int)
        if not ok or entry[1] < 0:
            raise FormatError(f"peer copy {where}: a file entry {entry!r} is not [name, size]")
        check_relative(entry[0], "file name", allow_empty=False, allow_partial=False)
        out.append((entry[0], offset, entry[1]))
        offset += entry[1]
    if offset != end - length or len({k for k, _, _ in out}) != len(out):
        raise FormatError(f"peer copy {where}: its files do not fill the payload exactly, or one is named twice")
    return out


def _record_of(
    read: Callable[[int, int], bytes], files: list[tuple[str, int, int]], where: str, tier: LocalTier, owner: int
) -> PartRecord:
    """The record of a payload's step, checked to be ``owner``'s step of ``tier``'s root, sealed
    under its run's key in that root, and to pin the payload's manifest.

    Raises:
        FormatError: no record or manifest, not sealed under its run's key, another manifest.
        ForeignStepError: another root's or process's step, or a run the root holds no key of.
    """
    found = {key: (at, n) for key, at, n in files}
    if RECORD not in found or MANIFEST_KEY not in found:
        raise FormatError(f"peer copy {where}: no {RECORD} or {MANIFEST_KEY}")
    raw = read(*found[RECORD])
    record = parse_part_record(raw)
    check_whose(record, tier.url, owner, where)
    key = tier.key_of(record.save_id)
    if key is None:
        raise ForeignStepError(f"peer copy {where}: {tier.url} holds no key of its run {record.save_id}")
    if not authentic(raw, key):
        raise FormatError(f"peer copy {where}: not sealed under its run's key (an edited or forged record)")
    if not record.pins(read(*found[MANIFEST_KEY])):
        raise FormatError(f"peer copy {where}: its {MANIFEST_KEY} is not the one its record pins")
    return record


def check_whose(record: PartRecord, url: str, owner: int, where: str) -> None:
    """Refuse a copy that is not ``owner``'s step of the root ``url`` (ForeignStepError)."""
    if record.root != url:
        raise ForeignStepError(f"peer copy {where}: a step of the root {record.root}, not of {url}")
    if record.process_index != owner:
        raise ForeignStepError(f"peer copy {where}: process {record.process_index}'s step, not process {owner}'s")


def unpack(payload: np.ndarray, where: str, tier: LocalTier, owner: int) -> Received:
    """A payload as its record and files, checked as ``owner``'s step of ``tier``'s root (:func:`_record_of`)."""
    read = lambda at, n: payload[at : at + n].tobytes()  # noqa: E731
    files = _files_of(read, payload.size, f"from {where}")
    record = _record_of(read, files, f"from {where}", tier, owner)
    return Received(record, {key: payload[at : at + n] for key, at, n in files})


def _write_files(directory: Path, files: Mapping[str, np.ndarray]) -> None:
    """Write each file of a step into ``directory`` (the record last), synced."""
    for key in sorted(files, key=lambda k: k == RECORD):
        path = directory / key
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(np.ascontiguousarray(files[key]).view(np.uint8).data)
            f.flush()
            os.fsync(f.fileno())


def keep_received(tier: LocalTier, received: Received) -> None:
    """Write a step brought back from the keeper into this process's own directory, record last."""
    check_whose(received.record, tier.url, tier.process_index, "kept")
    directory = tier.inside(tier.step_dir(received.record.step))
    tier.inside(directory.parent)
    tmp = tmp_dir(directory)
    try:
        others = {k: v for k, v in received.objects.items() if k != RECORD}
        _write_files(tmp, others)
        commit_record(tmp, received.record, tier.key(received.record.save_id))
        place(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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

    def finish(self, nbytes: int) -> PartRecord | None:
        """Place what arrived (``nbytes``; 0: nothing was sent) as a step; its record."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        try:
            if nbytes == 0:
                return None
            if self.size < nbytes:
                raise FormatError(f"peer copy into {self.base}: {self.size} of {nbytes} bytes arrived")
            payload = np.memmap(self.path, np.uint8, "r", shape=(nbytes,))
            read = lambda at, n: payload[at : at + n].tobytes()  # noqa: E731
            where = f"into {self.base}"
            files = _files_of(read, nbytes, where)
            record = _record_of(read, files, where, self.tier, self.owner)
            directory = self.tier.inside(self.base / step_dir(record.step))
            tmp = tmp_dir(directory)
            try:
                _write_files(tmp, {k: payload[at : at + n] for k, at, n in files})
                place(tmp, directory)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self.tier.read(directory, self.owner)  # whole and consistent, or an error now
            return record
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
    record = incoming.finish(copy.nbytes)
    tier.retain()
    return record.step if record is not None else None


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
    if received.record.step != step:
        raise FormatError(f"peer copy from process {keepers[here]}: step {received.record.step}, not {step}")
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
