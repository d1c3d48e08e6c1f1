"""Restore an Orbax checkpoint onto any target, reading only the chunks each device needs.

``objckpt.restore`` comes here when the URL holds no objckpt manifest but an
Orbax item (:mod:`objckpt.orbax.layout`). Targets mean what they mean for an
objckpt checkpoint: a ``jax.ShapeDtypeStruct`` or ``jax.Array`` leaf is
restored onto its sharding (any mesh, any device count; without one, onto the
saved one where it can: :mod:`objckpt.restoring.target_shardings`), ``None`` gives host
numpy (or, for a subtree, the subtree), any other value is a placeholder for
the saved one, and ``partial=True`` reads nothing of the leaves the target
leaves out. For each array leaf, each distinct box the addressable devices
hold is one tensorstore read (replicas share it); reads run concurrently while
the bytes read and not yet on their devices stay within ``Options.read_window``,
so a restore holds little more than the restored arrays. As for objckpt
checkpoints, a restore needing more host memory than the machine has is a
:class:`~objckpt.errors.HostMemoryError` before any read, and dtype casts
follow ``cast``.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any

import numpy as np

from objckpt.core.tree import check_names, flatten_target, unflatten_target
from objckpt.errors import TargetMismatchError
from objckpt.options import Options
from objckpt.orbax.layout import OrbaxItem, OrbaxLeaf, numpy_dtype
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
from objckpt.restoring import host_memory
from objckpt.restoring.casts import cast_values, check_cast
from objckpt.restoring.host_memory import refuse_over_limit
from objckpt.restoring.placement import (
    box_on_devices,
    boxes_of,
    is_array_target,
    joined,
    on_default_device,
    sharding_of,
)
from objckpt.restoring.target_shardings import on_saved_orbax_shardings
from objckpt.transfer.stats import TransferStats

log = logging.getLogger("objckpt")


def restore_orbax(
    item: OrbaxItem,
    target: Any,
    *,
    storage_options: dict[str, Any] | None,
    partial: bool,
    options: Options,
    stats: TransferStats,
    cast: str,
) -> Any:
    """Restore ``item`` onto ``target`` (arguments as :func:`objckpt.restore`'s)."""
    ts = import_tensorstore()
    started = time.perf_counter()
    selection = _select(item, target, partial)
    with kvstore_for(item.url, storage_options) as (kvstore, context_spec):
        context = ts.Context(context_spec)
        pending: collections.deque[tuple[int, BoxRead, list[Any]]] = collections.deque()
        waiter = Waiter(
            options.request_timeout,
            describe_kvstore(kvstore),
            lambda: [future for _, read, _ in pending for future in read.futures],
        )
        arrays = {
            i: open_leaf(ts, item, item.leaves[i], kvstore, context, waiter)
            for i in selection
            if item.leaves[i].kind in ("array", "scalar")
        }
        shapes = {i: tuple(int(n) for n in a.shape) for i, a in arrays.items()}
        selection = on_saved_orbax_shardings(item.leaves, shapes, selection)  # eval_shape's targets
        for i, t in selection.items():
            if i in arrays:
                _check_target(item.leaves[i], arrays[i], t, cast)
        boxes = {i: boxes_of(selection[i], tuple(int(n) for n in a.shape)) for i, a in arrays.items()}
        _check_host_memory(item, selection, arrays, boxes, host_memory.physical_memory())  # before any read
        try:
            values = _read_all(ts, item, selection, arrays, boxes, options, stats, cast, waiter, pending)
        finally:
            for _, read, _ in pending:  # a failed restore leaves no read running
                read.cancel()
    stats.seconds = time.perf_counter() - started
    log.info(
        "objckpt restored the Orbax checkpoint %s: %d leaves, %d bytes in %.2f s",
        item.url,
        len(values),
        stats.bytes_read,
        stats.seconds,
    )
    if target is None:
        return item.skeleton(lambda i: values[i])
    flat, treedef = flatten_target(target)
    index = {leaf.path: i for i, leaf in enumerate(item.leaves)}
    return unflatten_target(treedef, [values[index[path]] for path, _ in flat])


def _select(item: OrbaxItem, target: Any, partial: bool) -> dict[int, Any]:
    if target is None:
        return {i: None for i, leaf in enumerate(item.leaves) if leaf.kind != "skipped"}
    flat, _ = flatten_target(target)
    index = {leaf.path: i for i, leaf in enumerate(item.leaves)}
    missing = [path for path, _ in flat if path not in index]
    named = {path for path, _ in flat}
    unnamed = [leaf.path for leaf in item.leaves if leaf.path not in named and leaf.kind != "skipped"]
    check_names(missing, unnamed, partial=partial, what=f"the Orbax checkpoint {item.url}")
    return {index[path]: value for path, value in flat}


def _check_target(leaf: OrbaxLeaf, array: Any, target: Any, cast: str) -> None:
    shape, dtype = tuple(array.shape), numpy_dtype(array.dtype)
    if is_array_target(target):
        if tuple(target.shape) != shape:
            raise TargetMismatchError(f"leaf {leaf.path}: saved shape {shape}, target shape {tuple(target.shape)}")
        if np.dtype(target.dtype) != dtype and cast != "unsafe":
            check_cast(leaf.path, dtype, np.dtype(target.dtype))


def _box_bytes(box: tuple[slice, ...], itemsize: int) -> int:
    return math.prod(s.stop - s.start for s in box) * itemsize  # Python ints: no int64 wrap


def _check_host_memory(
    item: OrbaxItem,
    selection: dict[int, Any],
    arrays: dict[int, Any],
    boxes: dict[int, list[tuple[tuple[slice, ...], list[Any]]]],
    limit: int | None,
) -> None:
    """:func:`objckpt.restoring.leaf_plan.check_host_memory` for an Orbax item (sizes from its
    zarr headers): all of a host leaf's boxes, the largest box of one bound for other devices."""
    needs = []
    for i, array in arrays.items():
        dtype = numpy_dtype(array.dtype)
        sizes = [_box_bytes(box, dtype.itemsize) for box, _ in boxes[i]]
        on_host = _stays_on_host(selection[i], boxes[i])
        need = (sum(sizes) if on_host else max(sizes)) if sizes else 0
        needs.append((item.leaves[i].path, f"{dtype.name}{[int(n) for n in array.shape]}", need, on_host))
    refuse_over_limit(needs, limit, of=f" of the Orbax checkpoint {item.url}")


def _stays_on_host(target: Any, boxes: list[tuple[tuple[slice, ...], list[Any]]]) -> bool:
    """Whether a leaf's boxes stay in host memory: a host value, or devices that are the host's."""
    if sharding_of(target) is None:
        return True
    return all(device.platform == "cpu" for _, devices in boxes for device in devices)


def _read_all(
    ts: Any,
    item: OrbaxItem,
    selection: dict[int, Any],
    arrays: dict[int, Any],
    boxes_by_leaf: dict[int, list[tuple[tuple[slice, ...], list[Any]]]],
    options: Options,
    stats: TransferStats,
    cast: str,
    waiter: Waiter,
    pending: collections.deque[tuple[int, BoxRead, list[Any]]],
) -> dict[int, Any]:
    """Every selected leaf's value.

    Box reads are issued in order while the bytes read and not yet placed stay
    within ``Options.read_window`` (and the memory budget), and the chunks their
    tensorstore reads touch within four reads' worth (:data:`READ_CHUNKS`): a sliding
    window, the oldest read awaited first (by ``waiter``, under the request timeout). Each box lands in an aligned buffer (:class:`BoxRead`)
    that is put on its devices as it lands: adopted as the device buffer on CPU,
    copied from and dropped on accelerators, so host memory holds the window above
    the restored arrays. A leaf is assembled once its last box is placed.
    """
    window = max(1, min(options.read_window, options.memory_budget))
    chunk_window = 4 * READ_CHUNKS
    values: dict[int, Any] = {}
    placed: dict[int, list[Any]] = {}
    expected: dict[int, int] = {}
    in_flight = chunks_in_flight = 0
    batch = None  # the reads issued since the last wait, submitted together (tensorstore coalesces them)

    def land() -> None:
        nonlocal in_flight, chunks_in_flight
        i, read, devices = pending[0]
        leaf = item.leaves[i]
        host = read.result(item, leaf, waiter)
        pending.popleft()
        in_flight -= read.nbytes
        chunks_in_flight -= read.chunks
        stats.bytes_read += host.nbytes
        stats.requests += 1
        placed.setdefault(i, []).extend(_place(leaf, host, selection[i], devices, cast))
        if len(placed[i]) >= expected[i]:
            values[i] = _assemble(leaf, arrays[i], selection[i], placed.pop(i))

    for i in selection:
        leaf = item.leaves[i]
        if leaf.kind == "string":
            values[i] = item.strings[leaf.name]
            continue
        array = arrays[i]
        dtype = numpy_dtype(array.dtype)
        chunk = chunk_shape(array)
        boxes = boxes_by_leaf[i]
        expected[i] = sum(len(devices) for _, devices in boxes)
        for box, devices in boxes:
            nbytes = _box_bytes(box, dtype.itemsize)
            chunks = min(chunks_in([(s.start, s.stop) for s in box], chunk), READ_CHUNKS)
            while pending and (in_flight + nbytes > window or chunks_in_flight + chunks > chunk_window):
                if batch is not None:
                    batch.submit()
                    batch = None
                land()
            if batch is None:
                batch = ts.Batch()
            read = BoxRead(ts, array, box, dtype, batch, chunk=chunk)
            pending.append((i, read, devices))
            in_flight += nbytes
            chunks_in_flight += read.chunks
    if batch is not None:
        batch.submit()
    while pending:
        land()
    return values


def _place(leaf: OrbaxLeaf, host: np.ndarray, target: Any, devices: list[Any], cast: str) -> list[Any]:
    """One landed box: on each of its devices for an array target (cast as asked), else as it is."""
    if not is_array_target(target):
        if leaf.kind == "scalar":
            return [host.item()]  # Orbax restores its scalars as Python numbers
        if isinstance(target, np.ndarray) and target.dtype != host.dtype:
            return [_cast(leaf, host, target.dtype, cast)]
        return [host]
    host = _cast(leaf, host, np.dtype(target.dtype), cast)
    return [on_default_device(host)] if sharding_of(target) is None else box_on_devices(host, devices)


def _assemble(leaf: OrbaxLeaf, array: Any, target: Any, shards: list[Any]) -> Any:
    """A leaf from its placed boxes: the global array on the target's sharding, or the one host value."""
    sharding = sharding_of(target)
    return joined(tuple(array.shape), sharding, shards) if sharding is not None else shards[0]


def _cast(leaf: OrbaxLeaf, host: np.ndarray, dtype: np.dtype, cast: str) -> np.ndarray:
    return host if host.dtype == dtype else cast_values(leaf.path, host, dtype, unsafe=cast == "unsafe")
