"""How large a save's blobs are: each process picks its own size from its own bytes.

Object stores limit requests, not bytes: a new GCS bucket takes about 1,000 writes
per second at first, S3 3,500 PUTs per second per prefix. A pod-scale save in
``Options.blob_size`` blobs (32 MiB) is a few hundred thousand PUTs, minutes of a
cold bucket's request budget; the same bytes in fewer, larger objects go in
seconds. So a save aims at ``Options.blobs_per_save`` blobs in all: each of its
``P`` processes packs its own bytes into about ``blobs_per_save / P`` blobs
(:func:`blob_size_for`). No process needs another's figures: blob keys are per
process, and a reader takes each blob's size from the index object. The default,
32,768, leaves room under 50,000 PUTs for what else a save writes (each process's
index object and live-save marker, the root) and for blobs that packing leaves
part-filled: 1,024 processes make about 32 blobs each.

Bounds, and why:

* ``Options.blob_size`` is the floor, and the largest piece: pieces are still cut
  at it (:func:`split_pieces`), so a larger blob holds the same pieces as several
  blobs of ``blob_size`` would, and a restore makes the same reads (its GETs are
  pieces, or runs of them up to ``Options.read_chunk``; a blob's size sets none). Small saves stay at the floor: ``blobs_per_save`` blobs of 32 MiB are a
  terabyte.
* ``Options.max_blob_size`` (256 MiB) caps one object, so a failed PUT resends at
  most that much, and a PUT at a slow connection's 10 MB/s still ends well inside
  ``Options.request_timeout``. Each blob is one request: the stores send objects
  of up to 5 GiB (S3's single-PUT limit; GCS's is 5 TiB) in a single PUT, not as
  a multipart upload of N + 2 requests.
* A staged blob is held whole while its PUT runs (one body, one request), so one
  blob takes at most a quarter of the staging memory (:func:`staging_limit`): the
  save's buffers stay within ``Options.memory_budget`` (the staging pool holds
  ``limit // blob`` of them) and several blobs upload while the next is copied.
"""

from __future__ import annotations

from collections.abc import Iterable

from objckpt.core.plan import OwnedPiece, split_box
from objckpt.options import Options

#: A blob takes at most 1/MIN_STAGED_BLOBS of the staging memory, so that the pool holds
#: several at once (three: a blob may run a few KiB past its size), one being copied while
#: the others upload.
MIN_STAGED_BLOBS = 4


def blob_size_for(host_bytes: int, *, processes: int, floor: int, ceiling: int, blobs_per_save: int) -> int:
    """The blob size for a process that writes ``host_bytes`` in a save of ``processes`` processes.

    ``host_bytes`` over ``blobs_per_save // processes`` blobs (at least one), rounded up to a
    whole multiple of ``floor`` (the largest piece, so pieces fill a blob), then clamped to
    ``[floor, ceiling]``; ``floor`` wins where ``ceiling`` is below it.
    """
    per_process = max(1, blobs_per_save // max(1, processes))
    want = -(-host_bytes // per_process)
    want = -(-want // floor) * floor
    return max(floor, min(want, ceiling))


def staging_limit(options: Options, *, hold_uploads: bool) -> int:
    """Bytes of staging buffers a save may hold: the whole ``memory_budget`` for an async
    save (it stages everything before it returns, if it can), the recycled
    ``staging_pool`` (capped by the budget) for a synchronous one."""
    return options.memory_budget if hold_uploads else min(options.memory_budget, options.staging_pool)


def save_blob_size(options: Options, host_bytes: int, *, processes: int, hold_uploads: bool) -> int:
    """:func:`blob_size_for` with ``options``' bounds and the staging memory's cap."""
    ceiling = min(options.max_blob_size, staging_limit(options, hold_uploads=hold_uploads) // MIN_STAGED_BLOBS)
    return blob_size_for(
        host_bytes,
        processes=processes,
        floor=options.blob_size,
        ceiling=ceiling,
        blobs_per_save=options.blobs_per_save,
    )


def split_pieces(pieces: Iterable[OwnedPiece], *, max_bytes: int) -> list[OwnedPiece]:
    """``pieces`` in order, each larger than ``max_bytes`` cut into C-contiguous boxes of at most
    that (:func:`objckpt.core.plan.split_box`), so blobs larger than ``max_bytes`` hold pieces
    no larger than a blob of ``max_bytes`` would."""
    out: list[OwnedPiece] = []
    for p in pieces:
        if p.nbytes <= max_bytes:
            out.append(p)
            continue
        for start, stop in split_box(p.start, p.stop, p.itemsize, max_bytes=max_bytes):
            out.append(OwnedPiece(p.leaf, start, stop, p.itemsize, p.source, p.device, p.shared))
    return out
