"""verify for an Orbax checkpoint: read every chunk of every array, and say which leaf fails.

Orbax stores no checksum of its arrays, so what can be verified is that the
checkpoint is complete and decodes: every leaf's array opens (its zarr header
and, in OCDBT, the database's manifest and B-tree nodes are there and parse), and
every chunk of it is there, reads and decodes (a damaged compressed chunk fails to
decode; a flipped bit inside an uncompressed one is not detected, and a chunk file
missing from the per-array layout reads as the fill value, as Orbax reads it: tensorstore
writes no chunk that holds only the fill value, so its absence is no error). Each array is
read in boxes cut along its chunk grid, a few at a time, under the same byte
window as a restore (``Options.read_window``), so verify holds little memory
whatever the checkpoint's size. Every leaf that fails is reported, naming the
leaf, its Orbax parameter name and the box that did not read.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any

from objckpt.errors import FormatError, StoreError
from objckpt.layouts.base import VerifyProblem, VerifyReport
from objckpt.options import Options
from objckpt.orbax.layout import OrbaxItem, OrbaxLeaf, numpy_dtype
from objckpt.orbax.tensorstore_io import (
    READ_CHUNKS,
    Waiter,
    chunk_shape,
    describe_kvstore,
    import_tensorstore,
    kvstore_for,
    open_leaf,
    split_box,
)
from objckpt.progress import ProgressArg, reporting
from objckpt.transfer.stats import TransferStats

#: What ``objckpt verify`` checks of an Orbax checkpoint, in its report's words.
CHECKS = "every array's chunks read and decoded; Orbax stores no checksums to compare"


def verify_orbax(
    item: OrbaxItem,
    storage_options: dict[str, Any] | None,
    options: Options,
    stats: TransferStats,
    progress: ProgressArg = False,
) -> VerifyReport:
    """Read every chunk of every array leaf of ``item``; a :class:`VerifyReport` with ``format="orbax"``
    listing each leaf that does not open or read (kind ``unreadable``, ``blob`` its parameter name)."""
    ts = import_tensorstore()
    started = time.perf_counter()
    problems: dict[str, VerifyProblem] = {}
    failed_boxes: collections.Counter[str] = collections.Counter()
    leaves = [leaf for leaf in item.leaves if leaf.kind in ("array", "scalar")]
    with kvstore_for(item.url, storage_options) as (kvstore, context_spec):
        context = ts.Context(context_spec)
        pending: collections.deque[tuple[OrbaxLeaf, str, Any, int]] = collections.deque()
        waiter = Waiter(options.request_timeout, describe_kvstore(kvstore), lambda: [p[2] for p in pending])
        arrays: list[tuple[OrbaxLeaf, Any]] = []
        for leaf in leaves:
            try:
                arrays.append((leaf, open_leaf(ts, item, leaf, kvstore, context, waiter)))
            except (FormatError, StoreError) as exc:
                problems[leaf.name] = VerifyProblem("unreadable", leaf.name, str(exc), leaf=leaf.path)
        total = sum(math.prod(int(n) for n in a.shape) * numpy_dtype(a.dtype).itemsize for _, a in arrays)
        window = max(1, min(options.read_window, options.memory_budget))
        in_flight = 0

        def land() -> None:
            nonlocal in_flight
            leaf, where, future, nbytes = pending.popleft()
            in_flight -= nbytes
            try:
                waiter.wait(future, f"reading {where} of leaf {leaf.path} ({leaf.name}) of the Orbax checkpoint")
            except StoreError as exc:
                _failed(leaf, f"{where}: {exc}")
                return
            except Exception as exc:  # tensorstore: ValueError for a read or decode that fails
                _failed(leaf, f"{where} does not read or decode: {exc}")
                return
            stats.bytes_read += nbytes
            stats.requests += 1

        def _failed(leaf: OrbaxLeaf, what: str) -> None:
            failed_boxes[leaf.name] += 1
            problems.setdefault(leaf.name, _problem(leaf, f"{item.url}: {what}"))

        with reporting(progress, "verify", item.url, total, lambda: stats.bytes_read, stats):
            for leaf, array in arrays:
                itemsize = numpy_dtype(array.dtype).itemsize
                chunk = chunk_shape(array)
                per_box = max(1, min(READ_CHUNKS, window // max(1, math.prod(chunk) * itemsize)))
                bounds = tuple((0, int(n)) for n in array.shape)
                for box in split_box(bounds, chunk, per_box):
                    nbytes = math.prod(b - a for a, b in box) * itemsize
                    while pending and in_flight + nbytes > window:
                        land()
                    where = "chunks " + " x ".join(f"[{a}, {b})" for a, b in box) if box else "the scalar"
                    future = array[tuple(slice(a, b) for a, b in box)].read()
                    pending.append((leaf, where, future, nbytes))
                    in_flight += nbytes
            while pending:
                land()
    for name, count in failed_boxes.items():
        if count > 1:
            first = problems[name]
            problems[name] = _problem_like(first, f"{first.message} (and {count - 1} more box(es) of it)")
    return VerifyReport(
        url=item.url,
        problems=sorted(problems.values(), key=lambda p: p.leaf or ""),
        bytes_read=stats.bytes_read,
        requests=stats.requests,
        retries=stats.retries,
        seconds=time.perf_counter() - started,
        format="orbax",
        arrays=len(leaves),
        checks=CHECKS,
    )


def _problem(leaf: OrbaxLeaf, what: str) -> VerifyProblem:
    message = f"leaf {leaf.path} ({leaf.name}) of the Orbax checkpoint {what}"
    return VerifyProblem("unreadable", leaf.name, message, leaf=leaf.path)


def _problem_like(problem: VerifyProblem, message: str) -> VerifyProblem:
    return VerifyProblem(problem.kind, problem.blob, message, leaf=problem.leaf)
