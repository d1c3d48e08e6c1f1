"""The local tier's peer copies, moved by :func:`objckpt.peers.transfer.exchange_with_peers`.

After a local save every process sends that step (:func:`payload_of`) to its keeper, which
writes the files under ``process_<keeper>/peer/process_<owner>/step_<N>/``, the record last
(:meth:`Keepers.send`). A restore that finds a process's own step missing brings it back the
other way (:meth:`Keepers.fetch`), restores from the files in memory and writes them into
the owner's directory afterwards (:meth:`Keepers.keep`). Every process calls them together,
sending an empty payload when it has nothing to send. What arrives is checked before it is kept
or read: its record as a local step's (:func:`objckpt.locations.local_dirs.check_record`) and
the manifest it pins; every index object and piece by its crc32c when it is restored.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from objckpt.core.format import MANIFEST_KEY
from objckpt.core.format.local import RECORD, PartRecord
from objckpt.core.strict import strict_json
from objckpt.errors import FormatError
from objckpt.locations.local_dirs import (
    MANIFEST_LIMIT,
    LocalDir,
    check_record,
    commit_record,
    place,
    read_regular,
    step_objects,
    sync_files,
    tmp_dir,
)
from objckpt.peers.transfer import exchange_with_peers, keeper_map
from objckpt.roots.step_names import step_dir
from objckpt.storage.urls import check_relative

log = logging.getLogger("objckpt")

_MAGIC = b"OBJCKPT2"
_HEAD = struct.Struct("<8sQ")
#: Where each file of a payload starts: a multiple of this, the bytes before it zero.
_FILE_ALIGN = 4096
Keeper = Callable[[int, int], int]


def payload_of(tier: LocalDir, directory: Path, owner: int | None = None) -> list[np.ndarray]:
    """The step in ``directory`` (``owner``'s, default this process's) as one payload: a head (the
    ``OBJCKPT2`` magic, the table's length and the table of its files' names and sizes), then
    each file (mapped, read as it is sent) from the next multiple of 4 KiB, so a keeper writes
    each as it arrives and an owner restores from the bytes in place."""
    tier.read(directory, owner)  # this root's, this owner's, inside the tier, its manifest pinned
    objects = step_objects(tier.inside(directory))
    names = sorted(objects)
    table = json.dumps({"files": [[name, int(objects[name].size)] for name in names]}).encode()
    head = _HEAD.pack(_MAGIC, len(table)) + table
    segments = [np.frombuffer(head, np.uint8)]
    end = len(head)
    for name in names:  # each file starts on a page: a copy restored from memory lands its pieces aligned
        gap = _aligned(end) - end
        if gap:
            segments.append(np.zeros(gap, np.uint8))
        segments.append(objects[name])
        end += gap + objects[name].size
    return segments


def _aligned(offset: int) -> int:
    """``offset`` rounded up to where a file of a payload starts (:data:`_FILE_ALIGN`)."""
    return -(-offset // _FILE_ALIGN) * _FILE_ALIGN


@dataclass(frozen=True)
class Received:
    """A process's own step, brought back from its keeper: its record and its files' bytes, by key."""

    record: PartRecord
    objects: dict[str, np.ndarray]


def _table(head: bytes, nbytes: int | None, where: str) -> tuple[int, list[tuple[str, int, int]]]:
    """From a payload's first bytes (at least :data:`_HEAD` ``.size``, then as many as the table
    takes), its files: (key, offset in the payload, size); and the length of the head (0: the
    table is not all there yet). ``nbytes``: the payload's length, which the files must fill
    exactly (None: not known yet, checked once it is)."""
    if nbytes is not None and nbytes < _HEAD.size:
        raise FormatError(f"peer copy {where}: {nbytes} bytes is not a local-tier step")
    magic, length = _HEAD.unpack(head[: _HEAD.size])
    room = MANIFEST_LIMIT if nbytes is None else min(nbytes - _HEAD.size, MANIFEST_LIMIT)
    if magic != _MAGIC or length > room:
        raise FormatError(f"peer copy {where}: not a local-tier step")
    end = _HEAD.size + length
    if len(head) < end:
        return 0, []
    table = strict_json(bytes(head[_HEAD.size : end]), "peer copy table")
    entries = table.get("files") if isinstance(table, dict) else None
    if not isinstance(entries, list):
        raise FormatError(f"peer copy {where}: its table lists no files")
    out, offset = [], end
    for entry in entries:
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], int)
        if not ok or entry[1] < 0:
            raise FormatError(f"peer copy {where}: a file entry {entry!r} is not [name, size]")
        check_relative(entry[0], "file name", allow_empty=False, allow_partial=False)
        start = _aligned(offset)
        out.append((entry[0], start, entry[1]))
        offset = start + entry[1]
    if (nbytes is not None and offset != nbytes) or len({k for k, _, _ in out}) != len(out):
        raise FormatError(f"peer copy {where}: its files do not fill the payload exactly, or one is named twice")
    return end, out


def _record_of(
    read: Callable[[int, int], bytes], files: list[tuple[str, int, int]], where: str, tier: LocalDir, owner: int
) -> PartRecord:
    """The record of a payload's step, checked to be ``owner``'s step of ``tier``'s root, sealed
    under its run's key in that root, and to pin the payload's manifest.

    Raises:
        FormatError: no record or manifest, not sealed under its run's key, another manifest.
        ForeignStepError: another root's or process's step, or a run the root holds no key of.
    """
    found, where = {key: (at, n) for key, at, n in files}, f"peer copy {where}"
    if RECORD not in found or MANIFEST_KEY not in found:
        raise FormatError(f"{where}: no {RECORD} or {MANIFEST_KEY}")
    record = check_record(read(*found[RECORD]), where, root=tier.url, process_index=owner, key_of=tier.key_of)
    if not record.pins(read(*found[MANIFEST_KEY])):
        raise FormatError(f"{where}: its {MANIFEST_KEY} is not the one its record pins")
    return record


def unpack(payload: np.ndarray, where: str, tier: LocalDir, owner: int) -> Received:
    """A payload as its record and files, checked as ``owner``'s step of ``tier``'s root (:func:`_record_of`)."""
    read = lambda at, n: payload[at : at + n].tobytes()  # noqa: E731
    if payload.size < _HEAD.size:
        raise FormatError(f"peer copy from {where}: {payload.size} bytes is not a local-tier step")
    length = _HEAD.unpack(read(0, _HEAD.size))[1]
    _, files = _table(read(0, _HEAD.size + min(length, MANIFEST_LIMIT)), payload.size, f"from {where}")
    if not files:
        raise FormatError(f"peer copy from {where}: not a local-tier step")
    record = _record_of(read, files, f"from {where}", tier, owner)
    return Received(record, {key: payload[at : at + n] for key, at, n in files})


class _Incoming:
    """A sink writing a received step's files as they arrive into a new directory under ``base``,
    then, once checked, moved into place as a step."""

    def __init__(self, tier: LocalDir, owner: int) -> None:
        base = tier.inside(tier.held_dir(owner))
        base.mkdir(parents=True, exist_ok=True)
        tier.inside(base)
        self.tier, self.owner = tier, owner
        self.base = base
        self.tmp = tmp_dir(base / "step_incoming")
        self.head = bytearray()
        self.files: list[tuple[str, int, int]] | None = None
        self.open: tuple[int, Any] | None = None  # (index in files, its file object)
        self.size = 0

    def __call__(self, offset: int, chunk: memoryview) -> None:
        if offset != self.size:
            raise FormatError(f"peer copy into {self.base}: bytes at {offset}, {self.size} expected")
        self.size += len(chunk)
        data = memoryview(chunk).cast("B")
        if self.files is None:
            self.head += data
            if len(self.head) < _HEAD.size:
                return
            end, files = _table(bytes(self.head), None, f"into {self.base}")
            if not end:
                return
            self.files, data = files, memoryview(bytes(self.head[end:]))
            at = end
        else:
            at = offset
        self._write(at, data)

    def _write(self, at: int, data: memoryview) -> None:
        """Bytes ``data`` of the payload at ``at``, into the files they belong to."""
        assert self.files is not None
        for k, (key, start, size) in enumerate(self.files):
            lo, hi = max(at, start), min(at + len(data), start + size)
            if lo >= hi:
                continue
            if self.open is None or self.open[0] != k:
                self._close()
                path = self.tmp / key
                path.parent.mkdir(parents=True, exist_ok=True)
                self.open = (k, open(path, "wb"))
            self.open[1].write(data[lo - at : hi - at])

    def _close(self) -> None:
        if self.open is not None:
            f = self.open[1]
            self.open = None
            f.flush()
            os.fsync(f.fileno())
            f.close()

    def finish(self, nbytes: int) -> PartRecord | None:
        """Place what arrived (``nbytes``; 0: nothing was sent) as a step; its record."""
        try:
            self._close()
            if nbytes == 0:
                return None
            if self.size != nbytes or self.files is None:
                raise FormatError(f"peer copy into {self.base}: {self.size} of {nbytes} bytes arrived")
            ends = [start + size for _, start, size in self.files]
            if (ends[-1] if ends else len(self.head)) != nbytes:
                raise FormatError(f"peer copy into {self.base}: its files do not fill its {nbytes} bytes")
            for key, _, _size in self.files:  # an empty file gets no bytes: made here
                path = self.tmp / key
                if not path.exists():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.touch()
            where = f"into {self.base}"
            record = _record_of(lambda at, n: self._read(at, n), self.files, where, self.tier, self.owner)
            directory = self.tier.inside(self.base / step_dir(record.step))
            sync_files(self.tmp)
            place(self.tmp, directory)
            self.tier.read(directory, self.owner)  # whole and consistent, or an error now
            return record
        finally:
            self._close()
            if self.tmp.exists():
                shutil.rmtree(self.tmp, ignore_errors=True)

    def _read(self, at: int, n: int) -> bytes:
        """``n`` bytes of the payload at ``at``, from the file written there (one whole file)."""
        assert self.files is not None
        for key, start, size in self.files:
            if start == at and size == n:
                return read_regular(self.tmp / key, MANIFEST_LIMIT)[:n]
        raise FormatError(f"peer copy into {self.base}: no file at byte {at}")


class Keepers:
    """The peer copies of ``tier``'s steps, as :class:`objckpt.locations.tiers.StepLocations` uses
    them; every process calls :meth:`send` and :meth:`fetch` together."""

    def __init__(self, tier: LocalDir, *, timeout: float, keeper_of: Keeper | None) -> None:
        self.tier = tier
        self.timeout = timeout
        self.keeper_of = keeper_of

    def keepers(self) -> list[int]:
        return keeper_map(self.tier.process_count, self.keeper_of)

    def send(self, step: int | None) -> int | None:
        """Send this process's ``step`` (None or absent: nothing) to its keeper; keep what this process
        receives. Returns the step received from the process this one keeps (None: it sent nothing)."""
        tier = self.tier
        try:
            payload = payload_of(tier, tier.step_dir(step)) if step is not None else []
        except (OSError, FormatError) as e:  # nothing to send: still take part
            log.warning("objckpt peer copy: step %s of process %d is not sendable: %s", step, tier.process_index, e)
            payload = []
        incoming = _Incoming(tier, self.keepers().index(tier.process_index))
        copy = exchange_with_peers(
            payload, timeout=self.timeout, keeper_of=self.keeper_of, sink=incoming, name="local_tier"
        )
        record = incoming.finish(copy.nbytes)
        tier.retain()
        return record.step if record is not None else None

    def fetch(self, step: int, fetch: dict[int, int]) -> Received | None:
        """Bring back, from their keepers, the copies of ``step`` that the processes in ``fetch`` lost.

        ``fetch``: ``{owner: keeper}``. A keeper sends its held copy to its owner, every other
        process an empty payload. Returns this process's step, in memory (None: it was sent nothing).
        """
        tier, here, keepers = self.tier, self.tier.process_index, self.keepers()
        owner_of = {k: p for p, k in enumerate(keepers)}

        def back(process: int, n: int) -> int:  # in reverse, a keeper "keeps" its owner
            return owner_of[process]

        mine = owner_of[here]
        payload: list[np.ndarray] = []
        if fetch.get(mine) == here:
            payload = payload_of(tier, tier.held_dir(mine) / step_dir(step), mine)
        copy = exchange_with_peers(payload, timeout=self.timeout, keeper_of=back, name="local_tier_back")
        if copy.nbytes == 0 or copy.data is None:
            return None
        received = unpack(copy.data, f"process {keepers[here]}", tier, here)
        if received.record.step != step:
            raise FormatError(f"peer copy from process {keepers[here]}: step {received.record.step}, not {step}")
        return received

    def keep(self, received: Received) -> None:
        """Write a step brought back from the keeper into this process's own directory, record last."""
        tier = self.tier
        check_record(
            received.objects[RECORD].tobytes(), "peer copy kept", root=tier.url, process_index=tier.process_index
        )
        directory = tier.inside(tier.step_dir(received.record.step))
        tier.inside(directory.parent)
        tmp = tmp_dir(directory)
        try:
            for key, data in received.objects.items():  # the record is written last, sealed anew
                if key != RECORD:
                    (tmp / key).parent.mkdir(parents=True, exist_ok=True)
                    (tmp / key).write_bytes(np.ascontiguousarray(data).view(np.uint8).data)
            sync_files(tmp)
            commit_record(tmp, received.record, tier.key(received.record.save_id))
            place(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        tier.retain()
