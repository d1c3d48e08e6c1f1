"""An incremental checkpoint made to stand alone: its references become blobs of its own (``cp``).

A copy of an incremental checkpoint (``objckpt cp``) copies each blob a reference leads to into
the destination under the key it has inside its base (``<hh>/<base save_id>-p<n>-<seq>.blob``:
the save id in the name keeps it distinct from the checkpoint's own blobs), and rewrites each
version 3 index object's head so that its ``blobs`` name those keys. The frames stay byte for
byte (rows name blobs by position), so only the head changes: its length, and with it every
frame's offset, its crc32c and SHA-256 (which the root pins), and the object's size. The copy's
root drops ``bases``: it is an ordinary version 3 checkpoint. Pure: no I/O.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace

from objckpt.core.checksum import crc32c, sha256_hex
from objckpt.core.format.bases import is_ref, split_ref
from objckpt.core.format.index3 import HEAD_PREFIX, MAGIC
from objckpt.core.format.schema import IndexRef, Manifest
from objckpt.core.strict import strict_json


def local_key(key: str) -> str:
    """Where the copy keeps blob ``key``: a reference's key inside its base, any other key as is."""
    return split_ref(key)[1] if is_ref(key) else key


def standalone_index(data: bytes, ref: IndexRef) -> tuple[bytes, IndexRef]:
    """A version 3 index object (already checked against ``ref``) with its references made
    keys of its own, and the root entry that pins it."""
    head = data[: ref.head]
    (length,) = struct.unpack_from("<I", head, len(MAGIC))
    doc = strict_json(head[HEAD_PREFIX : HEAD_PREFIX + length], ref.key)
    doc["blobs"] = [[local_key(k), size] for k, size in doc["blobs"]]
    frames = doc["frames"]
    delta = 0
    for _ in range(8):  # the offsets' digits change the head's length: a few rounds settle it
        doc["frames"] = [[f[0], f[1], f[2] + delta, *f[3:]] for f in frames]
        text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        new_delta = HEAD_PREFIX + len(text) - ref.head
        if new_delta == delta:
            break
        delta = new_delta
    else:  # pragma: no cover - the length converges within two rounds
        raise RuntimeError(f"{ref.key}: the rewritten head's length does not settle")
    new_head = MAGIC + struct.pack("<I", len(text)) + text
    out = new_head + data[ref.head :]
    pinned = ref._replace(
        size=len(out),
        crc32c=crc32c(new_head),
        sha256=None if ref.sha256 is None else sha256_hex(new_head),
        head=len(new_head),
    )
    return out, pinned


def standalone_root(manifest: Manifest, indexes: list[IndexRef]) -> Manifest:
    """The copy's root: the rewritten index objects' entries, and no ``bases``."""
    return replace(manifest, indexes=tuple(indexes), bases=())
