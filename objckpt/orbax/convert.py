"""Convert an Orbax checkpoint into a native objckpt one, slab by slab within the memory budget.

The Orbax arrays are read through tensorstore in slabs (runs of leading rows
of one leaf, or of an inner dimension's rows where one row is larger than a
group), a group of slabs at a time (:data:`GROUP_BYTES`, at most a quarter of
``Options.memory_budget``). Slabs and groups are generated as they are read, so
a zarr header declaring a vast shape costs nothing up front. Each group is packed into blobs,
checksummed and uploaded by the same staging and upload path a save uses, and
dropped once uploaded. The next group's reads run while a group uploads, so
reading and writing overlap; host memory holds two groups and the staging pool,
within the budget however large the checkpoint or any one leaf. The root manifest goes
last, create-if-absent, exactly as for a save: a conversion that dies leaves
no checkpoint at the destination, only blobs that ``gc`` collects.

The save id, and so every blob key, is derived from the source (its URL and
metadata), so a conversion resumes by rerunning, as ``objckpt cp`` does: a
blob a killed run already wrote, found at the destination with the right
size, is read back and compared with the same blob staged from the source,
and kept if identical; only the rest is uploaded. A manager root converts step by step
(:func:`convert_orbax_steps`), each Orbax step into objckpt's
``step_<number>`` directory, skipping steps already committed there.

Arrays are stored as host arrays (they restore onto any sharding, as every
objckpt checkpoint does); Python scalars and strings as such.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from objckpt.core.dtypes import dtype_name
from objckpt.core.format import LeafEntry
from objckpt.core.plan import OwnedPiece, plan_blobs
from objckpt.core.tree import flatten
from objckpt.errors import CheckpointExistsError, CheckpointNotFoundError, StoreError
from objckpt.multihost import get_coordinator, operation_tag
from objckpt.options import Options
from objckpt.orbax.composite import OrbaxComposite, orbax_checkpoint_at
from objckpt.orbax.composite_convert import CompositeParts, check_one_process, composite_parts
from objckpt.orbax.layout import OrbaxItem, numpy_dtype
from objckpt.orbax.tensorstore_io import (
    READ_CHUNKS,
    BoxRead,
    Waiter,
    chunk_shape,
    chunks_in,
    describe_kvstore,
    import_tensorstore,
    kvstore_for,
    open_leaf,
)
from objckpt.progress import ProgressArg
from objckpt.saving.upload import PieceRecord
from objckpt.saving.writer import Source, upload_batch, write
from objckpt.transfer import dask_jobs, runtime
from objckpt.transfer.handle import opened
from objckpt.transfer.retries import opened_store
from objckpt.transfer.stats import TransferStats

log = logging.getLogger("objckpt")

_PRIMARY = {"processes": [0]}  # host data, written by the one converting process
#: Bytes of slabs read as one group: small enough that reading the next group overlaps
#: uploading this one several times over a checkpoint, large enough for many blobs in flight.
GROUP_BYTES = 256 << 20


@dataclass
class ConvertStats:
    """The figures of one conversion.

    Attributes:
        src: the Orbax checkpoint (credentials stripped).
        dst: the objckpt checkpoint written.
        leaves: leaves converted.
        bytes_read: bytes read from the Orbax checkpoint.
        bytes_written: bytes written as objckpt blobs, the manifest and indexes included.
        blobs_kept: blobs found at the destination from an earlier run, identical, and not
            uploaded again.
        seconds: wall time.
    """

    src: str
    dst: str
    leaves: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blobs_kept: int = 0  # found at the destination from an earlier run, identical, not uploaded again
    seconds: float = 0.0


@dataclass(frozen=True)
class _Slab:
    leaf: int  # index into the objckpt leaf order
    start: tuple[int, ...]
    stop: tuple[int, ...]
    nbytes: int


def convert_orbax(
    src: str,
    dst: str,
    *,
    src_storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    progress: ProgressArg = False,
    client: Any = None,
) -> ConvertStats:
    """Write the Orbax checkpoint at ``src`` as an objckpt checkpoint at ``dst``.

    With ``client`` (a ``distributed.Client``), the groups of slabs are read and uploaded by tasks on its
    Dask cluster, split by bytes (:mod:`objckpt.transfer.dask_jobs`), every blob numbered as one process
    numbers it; this process commits them, writing the same checkpoint.

    Raises:
        CheckpointNotFoundError: no Orbax checkpoint at ``src``.
        CheckpointExistsError: ``dst`` already holds a committed checkpoint.
        FormatError: ``src`` holds what objckpt cannot read (named).
    """
    options = options or Options()
    item, parts = _found(src, src_storage_options, options)
    job = None if client is None else (client, src)
    return _convert(item, dst, src_storage_options, dst_storage_options, options, progress, parts, job)


def _found(src: str, storage_options: dict[str, Any] | None, options: Options) -> tuple[OrbaxItem, Any]:
    with opened_store(src, storage_options, options) as source:
        found = orbax_checkpoint_at(source)
    if found is None:
        raise CheckpointNotFoundError(f"no Orbax checkpoint at {src}")
    return composite_parts(found, storage_options, options) if isinstance(found, OrbaxComposite) else (found, None)


def _convert_task(ids: list[int], src: str, dst: str, so: Any, dso: Any, options: Options, firsts: list[int]) -> Any:
    """A task of a conversion on Dask: groups ``ids`` read and uploaded; their records and bytes read."""
    item, parts = _found(src, so, options)
    records: list[PieceRecord] = []
    stats = _convert(item, dst, so, dso, options, False, parts, task=(ids, firsts, records))
    return records, stats.bytes_read


def convert_orbax_steps(
    src_root: str,
    dst_root: str,
    *,
    steps: list[int] | None = None,
    src_storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    progress: ProgressArg = False,
) -> dict[int, ConvertStats | None]:
    """Convert the steps of an Orbax ``CheckpointManager`` root (all, or ``steps``) into
    an objckpt manager root at ``dst_root``. Steps already committed there are left
    as they are (None in the result): rerunning after a failure resumes."""
    from objckpt.roots.step_names import step_dir

    options = options or Options()
    found = orbax_steps(src_root, src_storage_options, options)
    chosen = sorted(found if steps is None else [s for s in steps if s in found])
    missing = sorted(set(steps or []) - set(found))
    if missing:
        raise CheckpointNotFoundError(f"no Orbax step {', '.join(map(str, missing))} under {src_root}")
    out: dict[int, ConvertStats | None] = {}
    for step in chosen:
        try:
            out[step] = convert_orbax(
                f"{src_root.rstrip('/')}/{step}",
                f"{dst_root.rstrip('/')}/{step_dir(step)}",
                src_storage_options=src_storage_options,
                dst_storage_options=dst_storage_options,
                options=options,
                progress=progress,
            )
        except CheckpointExistsError:
            out[step] = None
    return out


def orbax_steps(root: str, storage_options: dict[str, Any] | None, options: Options) -> list[int]:
    """The committed steps of an Orbax ``CheckpointManager`` root (``<step>/_CHECKPOINT_METADATA``)."""
    with opened_store(root, storage_options, options) as store:
        listed = runtime.run_sync(store.list(""))
    steps = set()
    for info in listed:
        head, sep, rest = info.key.partition("/")
        if sep and head.isdigit() and rest == "_CHECKPOINT_METADATA":
            steps.add(int(head))
    return sorted(steps)


def _convert(
    item: OrbaxItem,
    dst: str,
    src_options: dict[str, Any] | None,
    dst_options: dict[str, Any] | None,
    options: Options,
    progress: ProgressArg,
    parts: CompositeParts | None = None,
    job: tuple[Any, str] | None = None,
    task: tuple[list[int], list[int], list[PieceRecord]] | None = None,
) -> ConvertStats:
    """Convert ``item``; with ``parts``, the Composite step it is the PyTree item of (:mod:`objckpt.orbax.composite_convert`).
    ``job``: the Dask client and the source URL its tasks open; ``task``: a task's group ids, every group's first
    blob number and the list its records go to (nothing committed)."""
    ts = import_tensorstore()
    started = time.perf_counter()
    stats = ConvertStats(src=parts.url if parts else item.url, dst=dst)
    transfer = TransferStats()
    with (
        kvstore_for(item.url, src_options) as (kvstore, context_spec),
        opened(dst, dst_options, options, transfer) as handle,
    ):
        context = ts.Context(context_spec)
        in_flight: list[tuple[_Slab, BoxRead]] = []  # the group being read
        waiter = Waiter(
            options.request_timeout,
            describe_kvstore(kvstore),
            lambda: [future for _, read in in_flight for future in read.futures],
        )
        prefix = parts.prefix() if parts else ""
        by_path = {prefix + leaf.path: leaf for leaf in item.leaves if leaf.kind != "skipped"}
        tree = item.skeleton(lambda i: None)
        flat, skeleton = flatten(parts.tree(tree) if parts else tree)
        arrays = {
            i: open_leaf(ts, item, by_path[leaf.path], kvstore, context, waiter)
            for i, leaf in enumerate(flat)
            if leaf.path in by_path and by_path[leaf.path].kind in ("array", "scalar")
        }
        entries = [
            _entry(item, by_path[leaf.path], arrays.get(i), leaf.path, waiter)
            if leaf.path in by_path or parts is None
            else parts.entry(leaf.path)  # a Composite's other items
            for i, leaf in enumerate(flat)
        ]
        strings = {
            i: item.strings[by_path[leaf.path].name]
            for i, leaf in enumerate(flat)
            if i not in arrays and leaf.path in by_path
        }
        group_bytes = max(1, min(GROUP_BYTES, options.memory_budget // 4))
        converted = {i: a for i, a in arrays.items() if entries[i].kind == "ndarray"}
        chunks = {i: chunk_shape(a) for i, a in converted.items()}
        # Slabs and groups are generated as they are read: a header may declare any shape.
        slabs = itertools.chain.from_iterable(_slabs(i, a, group_bytes) for i, a in converted.items())
        groups = _groups(slabs, group_bytes, chunks)
        total = sum(math.prod(int(n) for n in a.shape) * numpy_dtype(a.dtype).itemsize for a in converted.values())
        head = [_string_piece(i, text) for i, text in strings.items() if text]
        head += parts.pieces(flat, 0) if parts else []
        save_id = _save_id(item, parts)
        listed = list(groups) if job or task else []  # on Dask: each group's blobs numbered before any read
        if task is not None:
            for g in task[0]:
                in_flight[:] = _start_reads(ts, arrays, chunks, listed[g])
                pieces = (head if g == 0 else []) + _landed(item, flat, by_path, in_flight, stats, waiter)
                task[2].extend(upload_batch(handle, pieces, save_id=save_id, first=task[1][g]))
            return stats

        def on_dask(client: Any, src: str) -> Iterator[list[PieceRecord]]:
            """The groups read and uploaded by tasks, started once :func:`write` has its marker up."""
            firsts, n = [], 0
            for g, group in enumerate(listed):
                boxes = [OwnedPiece(s.leaf, s.start, s.stop, numpy_dtype(arrays[s.leaf].dtype).itemsize) for s in group]
                firsts.append(n)
                n += len(plan_blobs((head if g == 0 else []) + boxes, blob_size=options.blob_size, key=str))
            ids = [(g, sum(s.nbytes for s in group)) for g, group in enumerate(listed)]
            kw = {"src": src, "dst": dst, "so": src_options, "dso": dst_options, "options": options, "firsts": firsts}
            for records, read in dask_jobs.fan_out(client, f"convert {src} {dst}", _convert_task, ids, **kw):
                stats.bytes_read += read
                yield records

        def batches() -> Iterator[list[OwnedPiece]]:
            """The strings and process 0's per-process values, then each group of slabs once landed,
            the next group's reads started before this one is uploaded."""
            pieces = list(head)
            group = next(groups, None)
            in_flight[:] = _start_reads(ts, arrays, chunks, group or [])
            if group is None and pieces:  # no arrays at all: the strings alone
                yield pieces
            while group is not None:
                pieces += _landed(item, flat, by_path, in_flight, stats, waiter)
                group = next(groups, None)
                in_flight[:] = _start_reads(ts, arrays, chunks, group or [])
                yield pieces
                pieces = []

        source = Source(
            skeleton,
            entries,
            [] if listed else batches(),
            total,
            metadata={"converted_from": stats.src, "orbax_created": item.created},
            streamed=True,
            other_parts=parts.other_parts(flat, entries) if parts else (),
            processes=check_one_process(parts, get_coordinator()) if parts else 0,
            check=lambda records: _check_complete(item, entries, converted, records),
            cancel=lambda: _cancel(in_flight),
            uploaded=on_dask(*job) if job and listed else (),
        )
        tag = operation_tag("convert", handle.url)
        writing = write(
            handle,
            source,
            save_id=save_id,
            tag=tag,
            coordinator=get_coordinator(),
            blob_size=options.blob_size,
            resume=True,
            progress=progress,
            verb="convert",
            entered=started,
        )
        writing.future.result()
        stats.blobs_kept = writing.blobs_kept
    stats.leaves = len(entries)
    stats.bytes_written = transfer.bytes_written
    stats.seconds = time.perf_counter() - started
    log.info(
        "objckpt converted the Orbax checkpoint %s to %s: %d leaves, %d bytes read, %d written, %.2f s",
        item.url,
        dst,
        stats.leaves,
        stats.bytes_read,
        stats.bytes_written,
        stats.seconds,
    )
    return stats


def _check_complete(
    item: OrbaxItem, entries: list[LeafEntry], arrays: dict[int, Any], records: list[PieceRecord]
) -> None:
    """Refuse to commit unless every converted leaf's pieces hold all its bytes: a checkpoint
    that ``verify`` would refuse is never committed, whatever the source's headers said."""
    held = dict.fromkeys(arrays, 0)
    for leaf, piece in records:
        if leaf in held:
            held[leaf] += piece.length
    for i, array in arrays.items():
        want = math.prod(int(n) for n in array.shape) * numpy_dtype(array.dtype).itemsize
        if held[i] != want:
            raise StoreError(
                f"converting the Orbax checkpoint {item.url}: leaf {entries[i].path} got {held[i]} of its"
                f" {want} bytes; nothing was committed"
            )


def _cancel(reads: list[tuple[_Slab, BoxRead]]) -> None:
    for _, read in reads:
        read.cancel()


def _save_id(item: OrbaxItem, parts: CompositeParts | None = None) -> str:
    """The same for the same source: a rerun rewrites the blobs a failed run left."""
    extra = [parts.identity()] if parts else []
    identity = "\n".join([item.url, item.created, *(f"{leaf.path}={leaf.name}" for leaf in item.leaves), *extra])
    return hashlib.sha256(identity.encode()).hexdigest()[:32]


def _entry(item: OrbaxItem, leaf: Any, array: Any, path: str, waiter: Waiter) -> LeafEntry:
    if leaf.kind == "string":
        text = item.strings[leaf.name].encode()
        return LeafEntry(path, "str", "uint8", (len(text),), writers=_PRIMARY)
    dtype = numpy_dtype(array.dtype)
    shape = tuple(int(n) for n in array.shape)
    if leaf.kind == "scalar":
        what = f"reading scalar {leaf.path} ({leaf.name}) of the Orbax checkpoint {item.url}"
        value = np.asarray(waiter.wait(array.read(), what)).item()  # stored inline, as Orbax restores it
        kind = "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "float"
        return LeafEntry(path, kind, value=value)
    return LeafEntry(path, "ndarray", dtype_name(dtype), shape, writers=_PRIMARY)


def _slabs(leaf: int, array: Any, limit: int) -> Iterator[_Slab]:
    """Boxes of at most ``limit`` bytes tiling the leaf, in order, generated as needed: runs
    along the outermost dimension whose one index (with the dimensions after it) fits the
    limit, at each index of the dimensions before it. Sizes in Python integers."""
    shape = tuple(int(n) for n in array.shape)
    itemsize = numpy_dtype(array.dtype).itemsize
    total = math.prod(shape) * itemsize
    if total == 0:
        return
    if not shape:
        yield _Slab(leaf, (), (), total)
        return
    d = 0
    while d + 1 < len(shape) and math.prod(shape[d + 1 :]) * itemsize > limit:
        d += 1
    inner = math.prod(shape[d + 1 :]) * itemsize  # bytes of one index along dimension d
    rows = max(1, limit // inner)
    rest = shape[d + 1 :]
    for outer in itertools.product(*(range(n) for n in shape[:d])):
        for r in range(0, shape[d], rows):
            stop = min(r + rows, shape[d])
            yield _Slab(
                leaf,
                (*outer, r, *(0,) * len(rest)),
                (*(o + 1 for o in outer), stop, *rest),
                (stop - r) * inner,
            )


def _groups(slabs: Iterable[_Slab], limit: int, chunks: dict[int, tuple[int, ...]]) -> Iterator[list[_Slab]]:
    """Slabs in groups of at most ``limit`` bytes (a bigger slab alone) whose reads touch at
    most four reads' worth of chunks (:data:`READ_CHUNKS`), generated as needed."""
    group: list[_Slab] = []
    size = touched = 0
    for slab in slabs:
        n = min(chunks_in(list(zip(slab.start, slab.stop, strict=True)), chunks[slab.leaf]), READ_CHUNKS)
        if group and (size + slab.nbytes > limit or touched + n > 4 * READ_CHUNKS):
            yield group
            group, size, touched = [], 0, 0
        group.append(slab)
        size += slab.nbytes
        touched += n
    if group:
        yield group


def _start_reads(
    ts: Any, arrays: dict[int, Any], chunks: dict[int, tuple[int, ...]], group: list[_Slab]
) -> list[tuple[_Slab, BoxRead]]:
    """Issue the reads of ``group``'s slabs, together as one tensorstore batch (it fetches
    and decodes their chunks concurrently, merging neighbouring ranges), into buffers of ours."""
    batch = ts.Batch()
    reads = []
    for slab in group:
        array = arrays[slab.leaf]
        box = tuple(slice(a, b) for a, b in zip(slab.start, slab.stop, strict=True))
        reads.append((slab, BoxRead(ts, array, box, numpy_dtype(array.dtype), batch, chunk=chunks[slab.leaf])))
    batch.submit()
    return reads


def _landed(
    item: OrbaxItem,
    flat: list[Any],
    leaves: dict[str, Any],
    reads: list[tuple[_Slab, BoxRead]],
    stats: ConvertStats,
    waiter: Waiter,
) -> list[OwnedPiece]:
    """The slabs of started ``reads`` as pieces to pack, once each has landed."""
    pieces = []
    for slab, read in reads:
        host = read.result(item, leaves[flat[slab.leaf].path], waiter)
        stats.bytes_read += host.nbytes
        pieces.append(OwnedPiece(slab.leaf, slab.start, slab.stop, host.dtype.itemsize, source=(host, slab.start)))
    return pieces


def _string_piece(leaf: int, text: str) -> OwnedPiece:
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    return OwnedPiece(leaf, (0,), (len(data),), 1, source=(data, (0,)))
