"""A local-tier step's record: which checkpoint in its directory is which process's part of which step.

A local step lives in ``<local>/process_<p>/step_<N>/`` (:mod:`objckpt.locations.local_dirs`)
and is an objckpt checkpoint like any other (format version 3, :doc:`FORMAT`), written by the
save pipeline into that directory: ``manifest.json``, one index object and its blobs. It holds
one process's part of the step: every box that process's devices held, each once, as the
pieces of a one-process checkpoint (so a restart on the same devices reads nothing else).
Beside it, written last, ``part.json`` says what the checkpoint is (:class:`PartRecord`):

- the manager root it belongs to (its URL), the step, and the save id of the manager run that
  saved it (the checkpoint's own ``save_id``; one id per run, the same on every process);
- the process whose part it is and the job's process count;
- the manifest's byte length and SHA-256, which pin the checkpoint (the manifest pins its index
  object by its crc32c, the index object each piece by its crc32c).

The file is the record's JSON sealed, ``{"crc32c":<n>,"mac":"<hex>","record":<json>}``, both
taken over the JSON's exact bytes: its crc32c, so a flipped bit anywhere in it is refused, and
an HMAC-SHA256 under the key of the manager run that saved it (:func:`authentic`). That key
lives in the manager's root (:mod:`objckpt.locations.run_keys`), never on the local disk: a
step edited or made by someone who can write the local tier but not read the root, or a step
whose root no longer holds its run's key (another job's, a root wiped and reused), is not
authentic. No ``part.json``: no step (a save cut off).

It is parsed strictly (:mod:`objckpt.core.strict`): a local disk can be damaged too. No I/O here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass

from objckpt.core.checksum import crc32c
from objckpt.core.strict import fields, is_int, need, strict_json
from objckpt.errors import FormatError

FORMAT = "objckpt-part"
VERSION = 1
RECORD = "part.json"
_DOC = "local-tier record"
_SEALED = re.compile(rb'\A\{"crc32c":(\d{1,10}),"mac":"([0-9a-f]{64})","record":(.*)\}\Z', re.DOTALL)
_SHA256 = re.compile(r"\A[0-9a-f]{64}\Z")


@dataclass(frozen=True)
class PartRecord:
    """What a local step's checkpoint is (see the module docstring)."""

    root: str
    step: int
    save_id: str
    process_index: int
    process_count: int
    manifest_size: int
    manifest_sha256: str

    def to_json(self, key: bytes) -> bytes:
        """The record's file: its JSON sealed under ``key``, the key of the run that saved it."""
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "root": self.root,
            "step": self.step,
            "save_id": self.save_id,
            "process_index": self.process_index,
            "process_count": self.process_count,
            "manifest": {"size": self.manifest_size, "sha256": self.manifest_sha256},
        }
        return seal(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode(), key)

    def pins(self, manifest: bytes) -> bool:
        """Whether ``manifest`` (a ``manifest.json``'s bytes) is the one this record names."""
        return len(manifest) == self.manifest_size and hashlib.sha256(manifest).hexdigest() == self.manifest_sha256


def record_of(
    manifest: bytes, *, root: str, step: int, save_id: str, process_index: int, process_count: int
) -> PartRecord:
    """The record of a step whose checkpoint's manifest is ``manifest``."""
    digest = hashlib.sha256(manifest).hexdigest()
    return PartRecord(root, step, save_id, process_index, process_count, len(manifest), digest)


def _mac(body: bytes, key: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode()


def seal(body: bytes, key: bytes) -> bytes:
    """A record's JSON as its file: ``{"crc32c":<n>,"mac":"<HMAC-SHA256 under key>","record":<body>}``."""
    return b'{"crc32c":%d,"mac":"%s","record":%s}' % (crc32c(body), _mac(body, key), body)


def _match(data: bytes) -> re.Match[bytes]:
    match = _SEALED.match(data)
    if match is None:
        raise FormatError(f'{_DOC}: not {{"crc32c":<n>,"mac":"<hex>","record":<json>}}')
    if crc32c(match.group(3)) != int(match.group(1)):
        raise FormatError(f"{_DOC}: its bytes fail their crc32c (a damaged or edited record)")
    return match


def unseal(data: bytes) -> bytes:
    """The record's JSON from its file, its crc32c checked (its MAC: :func:`authentic`).

    Raises:
        FormatError: not a sealed record, or its bytes fail their crc32c.
    """
    return _match(data).group(3)


def authentic(data: bytes, key: bytes) -> bool:
    """Whether the sealed record ``data`` carries the MAC of its JSON under ``key`` (its run's key)."""
    match = _match(data)
    return hmac.compare_digest(match.group(2), _mac(match.group(3), key))


def parse_part_record(data: bytes) -> PartRecord:
    """A local step's record from its file's bytes (sealed, :func:`seal`), every field checked.

    Raises:
        FormatError: not a sealed record or its crc32c fails, another version, or a field out of place.
    """
    doc = strict_json(unseal(data), _DOC)
    keys = {"format", "version", "root", "step", "save_id", "process_index", "process_count", "manifest"}
    fields(doc, "(root)", keys, set(), doc=_DOC)
    need(doc["format"] == FORMAT, "format", f"not {FORMAT!r}", _DOC)
    need(doc["version"] == VERSION, "version", f"version {doc['version']!r} is not {VERSION}", _DOC)
    for name in ("step", "process_index", "process_count"):
        need(is_int(doc[name]) and doc[name] >= 0, name, "not a non-negative integer", _DOC)
    need(isinstance(doc["root"], str) and doc["root"] != "", "root", "not a URL", _DOC)
    need(doc["process_index"] < doc["process_count"], "process_index", "not below process_count", _DOC)
    save_id = doc["save_id"]
    need(isinstance(save_id, str) and 0 < len(save_id) <= 128 and save_id.isalnum(), "save_id", "not an id", _DOC)
    pinned = doc["manifest"]
    fields(pinned, "manifest", {"size", "sha256"}, set(), doc=_DOC)
    need(is_int(pinned["size"]) and pinned["size"] > 0, "manifest.size", "not a positive integer", _DOC)
    ok = isinstance(pinned["sha256"], str) and _SHA256.match(pinned["sha256"]) is not None
    need(ok, "manifest.sha256", "not 64 lowercase hex digits", _DOC)
    return PartRecord(
        doc["root"], doc["step"], save_id, doc["process_index"], doc["process_count"], pinned["size"], pinned["sha256"]
    )
