"""Every tuning number of objckpt in one place, with documented defaults.

Planners take these values as explicit arguments; only the public entry points
fill in defaults, so a benchmark or test can change one knob without patching.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

from objckpt.core.checksum import DIGESTS

MiB = 1 << 20
GiB = 1 << 30


def _default_memory_budget() -> int:
    """A quarter of physical memory, capped at 16 GiB, at least 256 MiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * GiB
    return max(256 * MiB, min(total // 4, 16 * GiB))


@dataclass(frozen=True)
class RetryConfig:
    """How the transfer engine retries transient failures (429, 5xx, resets, timeouts).

    Attributes:
        max_attempts: attempts per request, the first included (after a timeout, the
            next attempt gets twice the time: ``Options.request_timeout``).
        initial_backoff: seconds before the first retry; doubles each time (full jitter).
        max_backoff: cap on one backoff sleep.
        deadline: total seconds one request may take across all its attempts: each
            attempt is cut to what is left of it, so an operation whose store stalls fails
            within it. When the last attempt timed out, the error names the process and
            what it waited for; the first one that times out logs a warning naming the endpoint.
        checksum_reads: reads of the same bytes, the first included, before a
            checksum mismatch is called corruption at rest (an ``IntegrityError``
            that says it persisted over that many reads); a mismatch that a
            re-read cures was a bit flipped in flight. Each re-read counts in
            ``TransferStats.checksum_retries``.
    """

    max_attempts: int = 10
    initial_backoff: float = 0.1
    max_backoff: float = 10.0
    deadline: float = 60.0
    checksum_reads: int = 5

    def __post_init__(self) -> None:
        if self.checksum_reads < 1:
            raise ValueError(f"RetryConfig.checksum_reads must be >= 1, got {self.checksum_reads!r}")


#: ``Options.max_read_size`` by default for reads whose buffers are freed after the copy.
DEFAULT_COPIED_READ_SIZE = 8 * MiB


@dataclass(frozen=True)
class Options:
    """Tuning for save and restore.

    Attributes:
        blob_size: the smallest object a save writes, and the largest piece:
            small leaves are packed together, large shards are cut into pieces
            of at most this, which restores read (or runs of them up to
            ``read_chunk``). 32 MiB balances request overhead against parallelism.
            A save's blobs are larger only when it is large (see ``blobs_per_save``).
        max_blob_size: the largest object a save writes (each is one PUT, so a
            failed one resends at most this). Blobs are also held to a quarter of
            the staging memory (``memory_budget`` for ``save_async``,
            ``staging_pool`` for ``save``), so larger blobs never hold more memory.
            Below ``blob_size``, ``blob_size`` wins.
        blobs_per_save: how many blobs a whole save aims at, all its processes
            together, because stores limit requests per second (a new GCS bucket
            about 1,000 writes/s, S3 3,500 PUTs/s per prefix). Each process decides
            alone: it packs its own bytes into about ``blobs_per_save`` / process
            count blobs, rounded up to a multiple of ``blob_size`` and held
            between ``blob_size`` and ``max_blob_size``
            (:func:`objckpt.saving.blob_sizing.blob_size_for`). Small saves keep
            ``blob_size``; a 5.7 TB save from 1,024 processes (5.2 GiB each)
            writes 128 MiB blobs (``save``: a quarter of the 512 MiB staging
            pool) or 192 MiB ones (``save_async``) instead of 32 MiB ones.
            Restores read the same pieces either way.
        max_concurrency: requests in flight at once per operation, at most.
        adaptive_concurrency: when the store answers 429 or 503 SlowDown, halve
            the requests in flight (once per round) and widen them again by one
            per round of successes (:mod:`objckpt.transfer.throttle`); False keeps
            ``max_concurrency`` in flight whatever the store answers (each
            refusal is still retried).
        memory_budget: bytes of host memory a save may hold: its staging buffers,
            and the host copies of shards copied off an accelerator, which it
            uploads from and holds until they are sent. When the model is larger,
            the blocking phase streams (copy, upload, release) and blocks longer:
            an async save returns once all but the last budget's worth is sent.
            The default (a quarter of physical memory, at most 16 GiB) holds a
            host's share of most states, so an async save returns after one
            copy off the devices and holds about the state's size meanwhile.
        staging_pool: bytes of staging buffers a synchronous ``save`` keeps and
            recycles (capped by ``memory_budget``; ``save_async`` stages up to
            the whole budget so it can return early). Reused buffers skip the
            first touch of fresh pages. Blobs that a synchronous save sends in
            place (contiguous host shards, to a store that takes a body of
            parts, such as obstore's) use no buffer at all.
        read_window: bytes of copied ranged reads in flight during restore (also
            capped by ``memory_budget``): it bounds restore's host memory above the
            restored arrays. Reads whose buffers become the arrays themselves
            (aligned whole boxes on the CPU backend) do not count;
            ``max_concurrency`` bounds those. Bound for an accelerator they count:
            a read's buffer lives until ``device_put`` has copied it.
            Nor do streamed reads, which hold a few MiB each, not their length
            (``streamed_window`` bounds them).
        streamed_window: bytes of copied reads streamed at once during a restore
            onto another sharding, on stores that stream them (each read is
            received and scattered by a thread of its own, a few MiB at a time,
            so this is not memory). Raise it when the store is far away (each
            read waits a round trip for its first byte); lower it when scatter
            threads contend for the CPU.
        max_read_size: largest coalesced ranged read of pieces that are copied
            (a single larger piece is read alone). None (the default) picks by
            where the bytes land: a whole packed blob (``read_chunk`` plus the
            few KiB of spacers a blob may run past it) when the store streams
            reads (they hold no buffer of their length), else 8 MiB (each
            response is a new buffer). Set a number to bound both.
        read_chunk: largest single GET. Reads made only of whole target boxes,
            whose response buffers become the arrays, coalesce up to this size;
            a single read larger than this (a huge piece) is fetched as parallel
            sub-range GETs and joined before its checksum is checked.
        coalesce_gap: ranges of one blob closer than this are merged into one GET.
            0 by default so a partial restore never reads bytes it skips.
        split_replicas_above: the smallest slab a replicated shard is cut into,
            along its leading axis, one slab per replica at most, so the replicas'
            owners share its upload (and a read-once restore, its reads) without
            cutting it into reads too small to be worth a request.
        request_timeout: seconds one attempt of a store call may take, once it holds its
            concurrency slot, before it counts as stalled; a transfer's first attempt is given
            this plus its size at 2 MiB/s until the operation has measured its throughput, then
            twice its time at that throughput (at least 2 s); each retry after a timeout gets
            twice the time of the attempt before (``RetryConfig.deadline`` bounds them all).
        barrier_timeout: seconds a multi-host barrier waits before naming stragglers.
        manifest_size_limit: the reader refuses larger manifests (hostile input).
        live_marker_lease: seconds a live-save marker protects its checkpoint prefix
            from ``gc``, ``rm`` and retention after it was last written
            (:mod:`objckpt.saving.live_markers`); a save rewrites it every tenth of this and fails
            rather than commit if it could not for nine tenths. Independent of gc's
            grace period; the orphans of a crashed save wait at most this long.
        retry: retry policy for transient store errors.
        tune_malloc: fix glibc's mmap threshold at 1 MiB (``mallopt``) on the
            first save or restore that asks, so freed 8–32 MiB staging and
            response buffers go back to the OS instead of staying in the heap.
            Process-wide and permanent: it also changes how the rest of the
            program allocates. Off by default; turn it on when a process that
            saves or restores large checkpoints shows RSS that grows and stays.
            No effect outside glibc.
        pause_gc: defer Python's cyclic garbage collector while a restore runs
            (process-wide, restored when the last restore ends). Off by default;
            turn it on when a restore that makes many small arrays pays for full
            collections of a large heap.
        digest: ``"sha256"``: a save records each piece's SHA-256 in its index
            object and the root pins each index object by its SHA-256, so whoever
            can write a copy (a replica bucket) cannot change bytes unnoticed, as
            they can under crc32c alone; a restore or verify with it set refuses
            a checkpoint saved without it. Readers check the digests of any
            checkpoint that has them, whatever this says. None (the default):
            crc32c only, the format unchanged.
        reshard: restore a leaf whose target boxes cut the saved pieces (mesh axes
            swapped, another device order, another device count) by reading it on a
            sharding of the target's devices lined up with the saved pieces and moving
            it to the target sharding on the devices, where that makes the host that
            fetches most read fewer bytes (:mod:`objckpt.restoring.read_sharding`).
            Device memory then holds one leaf beyond the restored ones while it moves.
            False reads every leaf directly onto its target sharding (whole saved
            pieces, up to many times the bytes needed where the target cuts them), for
            jobs whose devices cannot hold one extra leaf. Every process of a restore
            must pass the same value: the processes that reshard join a collective.
        device_snapshot: ``"off"`` (the default), ``"auto"`` or ``"on"``: an async
            save first copies every shard it writes on its own accelerator (HBM
            copies take milliseconds) and returns once those copies are
            dispatched; the device→host copy and the upload then run in the
            background, while training goes on. Costs device memory the size of
            the host's shards until each is copied to the host. ``"auto"``
            snapshots only when every device reports room for that beyond the
            peak it has used so far plus a tenth of its memory
            (:func:`objckpt.saving.host_copies.wants_snapshot`); ``"on"``
            always (out-of-memory is then the job's risk). Off: the save
            allocates no device memory, and returns once its shards are copied
            to the host. Synchronous saves, and shards on CPU devices, never snapshot.
        format_version: the checkpoint format a save writes: 3 (the default: index
            objects a restore reads in part) or 2 (for readers of objckpt versions
            that predate 3). Readers read 1, 2, 3 and 4 whatever this says.
        compression: ``"zstd"``: a save stores each array leaf's bytes as byte planes
            (byte ``j`` of every value together), each compressed with zstd, in pieces
            of at most 1 MiB raw, and writes format version 4 (docs/FORMAT.md
            "Compressed pieces"): bf16 weights ≈ 1.45× smaller, f32 optimizer moments
            ≈ 1.1-1.2×, at the CPU cost docs/PERFORMANCE.md ("Compression") measures.
            Needs the ``zstandard`` package (the ``compression`` extra)
            and ``format_version=3``. None (the default): bytes stored as they are.
            Readers decode compressed checkpoints whatever this says.
        save_threads: threads a save's CPU work runs on at once: its checksums, its
            compression, and its writes into a local file system (``file://``, a
            memcpy per byte). Fewer leave more of the host to a training step that
            runs beside an async save's upload; more finish that upload sooner where
            nothing else runs. None (the default): 1 for ``save_async`` (and so
            ``CheckpointManager``), whose upload runs beside training: on a TPU host a
            second thread slowed the step 1.04-1.4x, one left it at 1.00x; for a
            synchronous ``save``, a quarter of the cores this process may use, at least 2
            (docs/PERFORMANCE.md, "The accelerator path"). Raise it for an async save
            with ``compression``, whose zstd runs within these threads. Requests that
            wait on the network take no thread.
        keep_snapshot_buffer: a ``CheckpointManager`` with a local tier keeps the buffer
            its last local save copied this process's part into, once written, and the
            next local save copies into it: its pages are in already, so the copy, which
            blocks training, faults in none (256 MiB a process in bench_tiers: 0.4-0.5 s
            -> 0.11-0.15 s). The cost: host memory of this process's part held between local saves,
            which each local save needs anyway. False: a fresh buffer each time, freed
            once written.
    """

    blob_size: int = 32 * MiB
    max_blob_size: int = 256 * MiB
    blobs_per_save: int = 32_768
    max_concurrency: int = 32
    adaptive_concurrency: bool = True
    memory_budget: int = field(default_factory=_default_memory_budget)
    staging_pool: int = 512 * MiB
    read_window: int = 128 * MiB
    streamed_window: int = 256 * MiB
    max_read_size: int | None = None
    read_chunk: int = 32 * MiB
    coalesce_gap: int = 0
    split_replicas_above: int = 1 * MiB
    request_timeout: float = 10.0
    barrier_timeout: float = 300.0
    manifest_size_limit: int = 256 * MiB
    live_marker_lease: float = 600.0
    retry: RetryConfig = field(default_factory=RetryConfig)
    tune_malloc: bool = False
    pause_gc: bool = False
    digest: str | None = None
    reshard: bool = True
    format_version: int = 3
    device_snapshot: str = "off"
    compression: str | None = None
    save_threads: int | None = None
    keep_snapshot_buffer: bool = True

    def __post_init__(self) -> None:
        for name in (
            "blob_size",
            "max_blob_size",
            "blobs_per_save",
            "max_concurrency",
            "memory_budget",
            "staging_pool",
            "read_window",
            "streamed_window",
            "max_read_size",
            "read_chunk",
            "live_marker_lease",
            "save_threads",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:  # max_read_size and save_threads may be None (picked)
                raise ValueError(f"Options.{name} must be positive, got {value!r}")
        if self.max_blob_size > 5 * GiB:
            raise ValueError(
                f"Options.max_blob_size must be at most 5 GiB (S3's single PUT), got {self.max_blob_size!r}"
            )
        if self.coalesce_gap < 0:
            raise ValueError(f"Options.coalesce_gap must be >= 0, got {self.coalesce_gap!r}")
        if self.digest not in (None, *DIGESTS):
            raise ValueError(f"Options.digest must be None or one of {', '.join(DIGESTS)}, got {self.digest!r}")
        if self.format_version not in (2, 3) or type(self.format_version) is not int:
            raise ValueError(f"Options.format_version must be 2 or 3, got {self.format_version!r}")
        if self.compression not in (None, "zstd"):
            raise ValueError(f"Options.compression must be None or 'zstd', got {self.compression!r}")
        if self.compression is not None:
            if self.format_version != 3:
                raise ValueError("Options.compression needs Options.format_version=3 (it writes format version 4)")
            if importlib.util.find_spec("zstandard") is None:
                raise ImportError(
                    'Options(compression="zstd") needs the zstandard package: pip install zstandard (objckpt[compression])'
                )
        if self.device_snapshot not in ("off", "auto", "on"):
            raise ValueError(f"Options.device_snapshot must be 'off', 'auto' or 'on', got {self.device_snapshot!r}")

    def copied_read_limit(self, *, streamed: bool) -> int:
        """``max_read_size``, or its default for reads the store streams (``streamed``) or not."""
        if self.max_read_size is not None:
            return self.max_read_size
        from objckpt.core.plan import PACKING_SLACK  # here: the planner pulls in numpy, `objckpt --help` needs none

        return self.read_chunk + PACKING_SLACK if streamed else DEFAULT_COPIED_READ_SIZE
