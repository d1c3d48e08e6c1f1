"""verify(read_data=False): each blob checked against the checksum its store keeps, no data read.

A blob is its pieces at their offsets and zeros elsewhere (:mod:`objckpt.core.plan`), so
the CRC-32C of the whole blob follows from the pieces' CRC-32Cs the manifest and index
objects record (:func:`objckpt.core.checksum.blob_crc32c`), with no byte read. The store
keeps its own CRC-32C of every object: GCS computes one and lists it (one request per
1,000 objects); S3 keeps the one a save sends with each upload (``x-amz-checksum-crc32c``)
and returns it on ``HeadObject(ChecksumMode=ENABLED)``, one request per object. Comparing
the two finds a blob missing, resized, or changed after the save (bytes written by anyone
else carry another checksum, or, on S3, none), without downloading the checkpoint. A blob
whose store keeps no CRC-32C (on S3: written without one, by another client or by an objckpt
that sent none) cannot be checked this way and is reported by name. A base's blob that an
incremental checkpoint references (asked for under the base) holds pieces it does not reference
too: only its presence and size are checked (the full read checks each referenced piece).

What this cannot say: which piece of a changed blob differs (the full read does), and it
trusts that the bytes a checksum was made from are the bytes sent (the store checked them
on arrival, against the save's CRC-32C).
"""

from __future__ import annotations

from objckpt.core.checksum import blob_crc32c
from objckpt.core.format import BlobEntry, Manifest
from objckpt.core.format.bases import is_ref, split_ref
from objckpt.errors import ChecksumsUnavailableError, FormatError, StoreError
from objckpt.layouts.base import VerifyProblem
from objckpt.storage.checksums import KeepsChecksums, StoredChecksum, keeps_checksums
from objckpt.tools.blob_pieces import PieceRef, pieces_by_blob
from objckpt.transfer.handle import Handle
from objckpt.transfer.retries import parent_of

#: Checksum requests (S3 HEADs) queued ahead of the engine's window at once.
QUEUED = 1024


def stored_checksums(handle: Handle) -> KeepsChecksums:
    """The store's checksums, or :class:`ChecksumsUnavailableError` naming a store that keeps none."""
    kept = keeps_checksums(handle.bulk)
    if kept is None:
        raise ChecksumsUnavailableError(
            f"verify {handle.url} without reading data: the store ({type(handle.bulk).__name__}) keeps no checksum"
            " of its own to compare (only S3 and GCS do); read every byte instead"
            " (objckpt.verify(url) or `objckpt verify URL`, without --no-read)"
        )
    return kept


def expected_crc32c(blob: BlobEntry, pieces: list[PieceRef]) -> int:
    """The CRC-32C of the whole blob the manifest describes: its pieces' combined with zero gaps."""
    try:
        return blob_crc32c(((p.offset, p.length, p.crc32c) for _, p in pieces), blob.size)
    except ValueError as e:
        raise FormatError(f"blob {blob.key}: {e}") from None


async def verify_stored(handle: Handle, kept: KeepsChecksums, manifest: Manifest) -> list[VerifyProblem]:
    """Every blob of ``manifest`` compared with the size and CRC-32C ``kept`` holds; no data read."""
    engine, url = handle.engine, handle.url
    listed = await engine.call(f"LIST {url}/ (with checksums)", lambda: kept.list_checksums())
    present = {c.key: c for c in listed}
    by_blob = pieces_by_blob(manifest)
    problems: list[VerifyProblem] = []
    up = keeps_checksums(parent_of(handle.bulk)) if manifest.bases else None

    async def one(blob: BlobEntry) -> None:
        pieces = by_blob.get(blob.key, [])
        stored = present.get(blob.key)
        at, key = (up, "/".join(split_ref(blob.key))) if is_ref(blob.key) and up else (kept, blob.key)
        unlisted = stored is not None and stored.size == blob.size and stored.crc32c is None
        if at is up or (unlisted and not kept.lists_checksums):
            try:
                stored = await engine.call(f"HEAD {url}/{blob.key}", lambda: at.head_checksum(key))
            except FileNotFoundError:
                stored = None
            except StoreError as e:
                problems.append(VerifyProblem("unreadable", blob.key, f"unreadable blob {url}/{blob.key}: {e}"))
                return
        problems.extend(compare(url, blob, pieces, stored, whole=at is not up))

    await engine.for_each(manifest.blobs, one, window_bytes=QUEUED, size=lambda b: 1)
    problems.sort(key=lambda p: (p.blob, p.start or 0, p.kind))
    return problems


def compare(
    url: str, blob: BlobEntry, pieces: list[PieceRef], stored: StoredChecksum | None, *, whole: bool = True
) -> list[VerifyProblem]:
    """What is wrong with one blob, from what the store says of it (``stored``, None: absent);
    its checksum too when ``pieces`` are the ``whole`` blob's (not a base's blob a reference reads)."""
    leaves = sorted({path for path, _ in pieces})
    what = f"{len(pieces)} piece(s) of {', '.join(leaves) if leaves else 'no leaf'}"
    key = blob.key
    if stored is None:
        return [VerifyProblem("missing", key, f"missing blob {url}/{key} ({blob.size} bytes; {what})")]
    if stored.size < blob.size:
        return [
            VerifyProblem(
                "short",
                key,
                f"short blob {url}/{key}: {stored.size} bytes, the manifest says {blob.size} ({what})",
                start=stored.size,
                end=blob.size,
            )
        ]
    if stored.size > blob.size:
        return [
            VerifyProblem(
                "size",
                key,
                f"blob {url}/{key} is {stored.size} bytes, the manifest says {blob.size}",
                start=blob.size,
                end=stored.size,
            )
        ]
    if not whole:
        return []
    if stored.crc32c is None:
        return [
            VerifyProblem(
                "unchecked",
                key,
                f"unchecked blob {url}/{key}: the store keeps no crc32c of it (written without one, so not by"
                f" this save or by an objckpt that sent none); {what} unchecked: read it (verify without --no-read)",
            )
        ]
    expected = expected_crc32c(blob, pieces)
    if stored.crc32c != expected:
        return [
            VerifyProblem(
                "checksum",
                key,
                f"changed blob {url}/{key}: the store's crc32c {stored.crc32c:08x} is not the {expected:08x}"
                f" of the {what} the manifest records (verify without --no-read names the pieces)",
                start=0,
                end=blob.size,
            )
        ]
    return []
