"""Restore safetensors tensors onto any target, reading only the rows the devices need.

A tensor in a safetensors file is its bytes in C order, so a run of rows (first
dimension) is one contiguous byte range. For each selected tensor this process
takes the distinct boxes its addressable devices hold under the target's
sharding (replicas share one), merges their row intervals, and reads each
merged interval with ranged reads of at most 16 MiB (``Options.read_chunk`` if smaller),
many at once under ``Options.read_window`` (the transfer engine's sliding
window, retries and timeouts). Each box is then a view of its interval, put on
its devices; a tensor is assembled once its last interval lands. A process
whose devices together hold whole rows (any sharding of one host's devices,
one device) reads each byte once; boxes cut along later dimensions by devices
of other processes read their rows whole.

Targets mean what they mean for objckpt checkpoints: a ``jax.ShapeDtypeStruct``
or ``jax.Array`` leaf is restored onto its sharding and dtype (``cast`` rules),
one without a sharding onto the default device, ``None`` gives host numpy (or,
at a prefix of names, that subtree as nested dicts), any other value is a
placeholder for the saved one; ``partial=True`` reads nothing of the tensors the
target leaves out. Target leaves are matched to tensors by their keys joined
with ``.`` (``params.layers.0.w``), or through ``names`` (target name → tensor name).
Safetensors files hold no checksums: what is read is what is there.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from objckpt.core.tree import check_names
from objckpt.errors import FormatError, TargetMismatchError
from objckpt.options import Options
from objckpt.restoring.casts import cast_values, check_cast
from objckpt.restoring.host_memory import physical_memory, refuse_over_limit
from objckpt.restoring.placement import (
    box_on_devices,
    boxes_joined,
    boxes_of,
    is_array_target,
    joined,
    on_default_device,
    sharding_of,
    whole_on,
)
from objckpt.safetensors.files import Tensors
from objckpt.safetensors.header import TensorEntry, numpy_dtype
from objckpt.safetensors.shards import nested
from objckpt.storage.streaming import STREAM_PIECE
from objckpt.transfer import runtime
from objckpt.transfer.buffers import fault_in, host_buffer
from objckpt.transfer.engine import TransferEngine
from objckpt.transfer.stats import TransferStats

log = logging.getLogger("objckpt")

Slices = tuple[slice, ...]  # a box of a tensor as numpy indexes it

#: The longest ranged read: a tensor up to this size is one GET whose response becomes its buffer.
READ_BYTES = 32 * 2**20
#: Copies and placements moving this many bytes or more run on a worker thread, off the I/O loop.
OFF_LOOP_BYTES = 1 * 2**20


def dotted(keypath: tuple[Any, ...]) -> str:
    """A target leaf's keys joined with ``.`` (dict keys, attribute names, indexes)."""
    parts = []
    for entry in keypath:
        if isinstance(entry, DictKey):
            parts.append(str(entry.key))
        elif isinstance(entry, GetAttrKey):
            parts.append(entry.name)
        elif isinstance(entry, SequenceKey):
            parts.append(str(entry.idx))
        elif isinstance(entry, FlattenedIndexKey):
            parts.append(str(entry.key))
        else:
            parts.append(str(entry))
    return ".".join(parts)


@dataclass
class _Leaf:
    """One tensor to restore: where its bytes are, its target, its boxes and row intervals."""

    name: str
    key: str
    entry: TensorEntry
    target: Any
    boxes: list[tuple[Slices, list[Any]]]
    spans: list[tuple[int, int]]  # row intervals to read, merged
    buffers: dict[int, np.ndarray] = field(default_factory=dict)  # by span start row
    pending: int = 0  # chunks not landed yet
    #: scattered leaves only: each box's own array (in ``boxes``' order), filled as rows stream in
    box_arrays: list[np.ndarray] | None = None

    @property
    def rows(self) -> int:
        return self.entry.shape[0] if self.entry.shape else 1

    @property
    def row_bytes(self) -> int:
        return self.entry.nbytes // self.rows if self.rows else 0


def restore_tensors(
    store: Any,
    tensors: Tensors,
    url: str,
    target: Any,
    *,
    partial: bool,
    options: Options,
    stats: TransferStats,
    cast: str,
    names: Mapping[str, str] | None = None,
) -> Any:
    """Restore ``target``'s tensors (all when it is None) from the files at ``store``.

    Raises:
        TargetMismatchError: target leaves no tensor answers to, tensors the target leaves out
            without ``partial``, a shape that differs, a cast ``cast`` refuses.
        HostMemoryError: more host memory than the machine has, before any read.
    """
    started = time.perf_counter()
    selection, subtrees, rebuild = _select(tensors, url, target, partial, names or {})
    values: dict[str, Any] = {}
    leaves = []
    for name, value in selection.items():
        entry = tensors.by_name[name]
        if entry.nbytes == 0 and not is_array_target(value):  # nothing to read or place: made here
            values[name] = np.zeros(entry.shape, _host_dtype(entry, value))
        else:
            leaves.append(_plan(name, tensors.file_of(name), entry, value, cast))
    _check_host_memory(leaves, url)
    values.update(runtime.run_sync(_read_all(store, leaves, options, stats, cast)))
    stats.seconds = time.perf_counter() - started
    log.info(
        "objckpt restored the safetensors checkpoint %s: %d tensors, %d bytes in %.2f s",
        url,
        len(values),
        stats.bytes_read,
        stats.seconds,
    )
    return rebuild(values, subtrees)


def _select(
    tensors: Tensors, url: str, target: Any, partial: bool, names: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, list[str]], Any]:
    """The tensors to read with their target leaves; the ``None`` subtrees (target name → tensor
    names under it); and how to build the result from the values by tensor name."""
    if target is None:
        return {name: None for name in tensors.by_name}, {}, lambda values, _: nested(values)
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda x: x is None)
    wanted = [(names.get(d, d), value) for d, value in ((dotted(path), value) for path, value in flat)]
    subtrees: dict[str, list[str]] = {}
    selection: dict[str, Any] = {}
    missing = []
    for name, value in wanted:
        if name in tensors.by_name:
            selection[name] = value
            continue
        below = [n for n in tensors.by_name if n.startswith(name + ".")] if value is None else []
        if below:
            subtrees[name] = below
            selection.update({n: None for n in below})
        else:
            missing.append(name)
    unnamed = [n for n in tensors.by_name if n not in selection]
    check_names(missing, unnamed, partial=partial, what=f"the safetensors checkpoint {url}")

    def rebuild(values: dict[str, Any], subtrees: dict[str, list[str]]) -> Any:
        out = []
        for name, _ in wanted:
            if name in subtrees:
                out.append(nested({n: values[n] for n in subtrees[name]}, strip=name + "."))
            else:
                out.append(values[name])
        return jax.tree_util.tree_unflatten(treedef, out)

    return selection, subtrees, rebuild


def _plan(name: str, key: str, entry: TensorEntry, target: Any, cast: str) -> _Leaf:
    shape = entry.shape
    if is_array_target(target):
        if tuple(target.shape) != shape:
            raise TargetMismatchError(f"tensor {name}: saved shape {shape}, target shape {tuple(target.shape)}")
        saved, wanted = numpy_dtype(entry.dtype), np.dtype(target.dtype)
        if saved != wanted and cast != "unsafe":
            check_cast(name, saved, wanted)
    boxes = boxes_of(target, shape)
    leaf = _Leaf(name, key, entry, target, boxes, [])
    leaf.spans = _merge([(b[0].start, b[0].stop) if shape else (0, 1) for b, _ in boxes])
    return leaf


def _host_dtype(entry: TensorEntry, target: Any) -> np.dtype:
    """The dtype of a tensor restored to host numpy: a numpy placeholder's, else the saved one."""
    return target.dtype if isinstance(target, np.ndarray) else numpy_dtype(entry.dtype)


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, stop in sorted(intervals):
        if stop <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _check_host_memory(leaves: list[_Leaf], url: str) -> None:
    needs = []
    for leaf in leaves:
        spans = sum(stop - start for start, stop in leaf.spans) * leaf.row_bytes
        on_host = getattr(leaf.target, "sharding", None) is None or all(
            d.platform == "cpu" for _, devices in leaf.boxes for d in devices
        )
        needs.append((leaf.name, f"{leaf.entry.dtype}{list(leaf.entry.shape)}", spans, on_host))
    refuse_over_limit(needs, physical_memory(), of=f" of the safetensors checkpoint {url}")


async def _read_all(store: Any, leaves: list[_Leaf], options: Options, stats: TransferStats, cast: str) -> dict:
    """Every leaf's value: its chunks read under the engine's window, each leaf finished as its last lands."""
    engine = TransferEngine.from_options(store, options, stats)
    chunk = max(1, options.read_chunk if options.max_read_size is None else options.max_read_size)
    chunk = min(chunk, READ_BYTES)
    values: dict[str, Any] = {}
    items: list[tuple[_Leaf, int, int, int]] = []  # leaf, span start row, byte start in span, byte end in span
    streamed = bool(getattr(store, "streams_reads", False))
    scattered: set[str] = set()
    for leaf in leaves:
        if leaf.entry.nbytes == 0:
            values[leaf.name] = _finish(leaf, cast)
            continue
        step = chunk
        if streamed and _scatters(leaf):  # reads of whole rows, each row's parts copied into its boxes
            scattered.add(leaf.name)
            step = max(1, chunk // leaf.row_bytes) * leaf.row_bytes
        for r0, r1 in leaf.spans:
            length = (r1 - r0) * leaf.row_bytes
            for lo in range(0, length, step):
                items.append((leaf, r0, lo, min(length, lo + step)))
                leaf.pending += 1

    async def sink_for(leaf: _Leaf, r0: int, lo: int, hi: int, length: int) -> Any:
        """Where a streamed read's bytes go, the memory made (and faulted in by the kernel in one
        pass, not one fault per 4 KiB inside the copies) at the leaf's or interval's first read."""
        if leaf.name in scattered:  # rows, a few MiB at a time, each row's columns copied into its boxes
            if leaf.box_arrays is None:
                leaf.box_arrays = _box_arrays(leaf)
                await _off_loop(leaf.entry.nbytes, lambda: [fault_in(a) for a in leaf.box_arrays or []])
            return _ScatterRows(leaf, r0 + lo // leaf.row_bytes)
        buffer = leaf.buffers.get(r0)  # the interval's aligned buffer, received into as it arrives
        if buffer is None:
            buffer = leaf.buffers[r0] = host_buffer(length, zeroed=False)
            await _off_loop(length, fault_in, buffer)
        return _Into(buffer[lo:hi])

    async def land(leaf: _Leaf, r0: int, lo: int, hi: int, length: int, data: memoryview) -> None:
        if length == hi - lo:  # the whole interval in one read: its buffer is the response's
            leaf.buffers[r0] = np.frombuffer(data, np.uint8)
        else:  # made at the interval's first landed read, so only the window's leaves hold buffers
            buffer = leaf.buffers.get(r0)
            if buffer is None:
                buffer = leaf.buffers[r0] = np.empty(length, np.uint8)
            await _off_loop(hi - lo, buffer[lo:hi].__setitem__, slice(None), np.frombuffer(data, np.uint8))

    async def one(item: tuple[_Leaf, int, int, int]) -> None:
        leaf, r0, lo, hi = item
        base = leaf.entry.start + r0 * leaf.row_bytes
        length = (dict(leaf.spans)[r0] - r0) * leaf.row_bytes
        data = None
        if streamed:
            sink = await sink_for(leaf, r0, lo, hi, length)
            got = await engine.get_range_streamed(leaf.key, base + lo, base + hi, sink)
        else:
            data = await engine.get_range(leaf.key, base + lo, base + hi)
            got = len(data)
        if got != hi - lo:
            raise FormatError(
                f"{store.url}/{leaf.key}: tensor {leaf.name!r} bytes [{base + lo}, {base + hi}) read"
                f" {got} bytes: the file is shorter than its header says"
            )
        if data is not None:
            await land(leaf, r0, lo, hi, length, data)
        leaf.pending -= 1
        if leaf.pending == 0:  # placed on a worker thread: the I/O loop keeps reading meanwhile
            values[leaf.name] = await _off_loop(leaf.entry.nbytes, _finish, leaf, cast)

    def held(item: tuple[_Leaf, int, int, int]) -> int:
        """What a read counts against the window: its length, except a read whose response
        becomes its leaf's value (the interval in one read, not streamed), which
        ``max_concurrency`` bounds, as in objckpt's own restore. Streamed reads count so that
        their values' memory is made and faulted in as their reads start, not all at once."""
        leaf, r0, lo, hi = item
        return hi - lo if streamed or (dict(leaf.spans)[r0] - r0) * leaf.row_bytes != hi - lo else 0

    budget = options.streamed_window if streamed else options.read_window
    window = max(chunk, min(budget, options.memory_budget))
    await engine.for_each(items, one, window_bytes=window, size=held)
    return values


def _scatters(leaf: _Leaf) -> bool:
    """Whether ``leaf`` is read into its boxes' own arrays as its rows stream in: a sharded
    array target whose devices hold several boxes, in the saved dtype, whose rows fit one
    streamed piece. Else its rows land whole and ``device_put`` cuts the boxes (one more copy)."""
    target = leaf.target
    return (
        is_array_target(target)
        and sharding_of(target) is not None
        and len(leaf.boxes) > 1
        and bool(leaf.entry.shape)
        and 0 < leaf.row_bytes <= STREAM_PIECE
        and np.dtype(target.dtype) == numpy_dtype(leaf.entry.dtype)
    )


def _box_arrays(leaf: _Leaf) -> list[np.ndarray]:
    """One aligned, unfilled array per box (faulted in by the caller): on the CPU backend each
    becomes its device's array without a copy."""
    dtype = numpy_dtype(leaf.entry.dtype)
    out = []
    for box, _ in leaf.boxes:
        shape = tuple(s.stop - s.start for s in box)
        out.append(host_buffer(math.prod(shape) * dtype.itemsize, zeroed=False).view(dtype).reshape(shape))
    return out


class _ScatterRows:
    """A read sink for whole rows ``row0``... of a scattered leaf: each piece it asks for is whole
    rows, and each box takes its part of them (its columns) straight from the stream's buffer."""

    def __init__(self, leaf: _Leaf, row0: int) -> None:
        self.row0, self.row_bytes = row0, leaf.row_bytes
        self.dtype, self.inner = numpy_dtype(leaf.entry.dtype), leaf.entry.shape[1:]
        self.boxes = [(box, array) for (box, _), array in zip(leaf.boxes, leaf.box_arrays or [], strict=True)]

    def begin(self) -> None:
        pass  # a retry writes the same rows to the same places again

    def next_size(self, offset: int, limit: int) -> int:
        return max(1, limit // self.row_bytes) * self.row_bytes

    def receive(self, offset: int, data: memoryview) -> None:
        first = self.row0 + offset // self.row_bytes
        rows = np.frombuffer(data, self.dtype).reshape((-1, *self.inner))
        last = first + len(rows)
        for box, array in self.boxes:
            lo, hi = max(first, box[0].start), min(last, box[0].stop)
            if lo < hi:
                array[lo - box[0].start : hi - box[0].start] = rows[(slice(lo - first, hi - first), *box[1:])]


class _Into:
    """A read sink that copies what it receives into ``dest`` (part of an interval's buffer)."""

    def __init__(self, dest: np.ndarray) -> None:
        self.dest = dest

    def begin(self) -> None:
        pass  # a retry writes the same bytes to the same places again

    def next_size(self, offset: int, limit: int) -> int:
        return limit

    def receive(self, offset: int, data: memoryview) -> None:
        self.dest[offset : offset + len(data)] = np.frombuffer(data, np.uint8)


async def _off_loop(nbytes: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a worker thread when it moves at least :data:`OFF_LOOP_BYTES`, else here."""
    if nbytes < OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _finish(leaf: _Leaf, cast: str) -> Any:
    """A leaf from its landed intervals: each box a view, cast as asked, on its devices."""
    entry, target = leaf.entry, leaf.target
    dtype = numpy_dtype(entry.dtype)
    inner = entry.shape[1:] if entry.shape else ()

    def box_value(box: Slices) -> np.ndarray:
        if not entry.shape:
            buffer = leaf.buffers.get(0, np.zeros(dtype.itemsize, np.uint8))
            return buffer.view(dtype).reshape(())
        if math.prod(entry.shape) == 0:
            return np.zeros(tuple(s.stop - s.start for s in box), dtype)
        r0 = next(start for start, stop in leaf.spans if start <= box[0].start and box[0].stop <= stop)
        rows = leaf.buffers[r0].view(dtype).reshape((-1, *inner))
        return rows[(slice(box[0].start - r0, box[0].stop - r0), *box[1:])]

    array_target = is_array_target(target)
    want = np.dtype(target.dtype) if array_target else _host_dtype(entry, target)
    sharding = sharding_of(target)
    whole = tuple(slice(0, n) for n in entry.shape)
    if leaf.box_arrays is not None:  # scattered: each box's array is filled, and on its devices
        arrays, leaf.box_arrays = leaf.box_arrays, None
        return boxes_joined(tuple(entry.shape), target.sharding, zip(arrays, (d for _, d in leaf.boxes), strict=True))
    if sharding is not None and leaf.spans == [(0, leaf.rows)] and sharding.is_fully_addressable:
        # Every row is here: one device_put slices the boxes out and places them (no Python per box).
        host = box_value(whole)
        if host.dtype != want:
            host = cast_values(leaf.name, host.copy(order="C"), want, unsafe=cast == "unsafe")
        leaf.buffers.clear()
        return whole_on(host, sharding)
    shards: list[Any] = []
    for box, devices in leaf.boxes:
        host = box_value(box)
        if host.dtype != want:
            host = cast_values(leaf.name, host.copy(order="C"), want, unsafe=cast == "unsafe")
        if not array_target:
            leaf.buffers.clear()
            return host if host.flags.c_contiguous and host.flags.writeable else np.array(host)
        if devices == [None]:
            leaf.buffers.clear()
            return on_default_device(host)
        shards.extend(box_on_devices(host, devices))
    leaf.buffers.clear()
    return joined(tuple(entry.shape), target.sharding, shards)
