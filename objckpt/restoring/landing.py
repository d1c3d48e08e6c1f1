"""Where a restore's bytes land: the one object that fills, counts and finishes its leaves.

The plans (:class:`~objckpt.restoring.leaf_plan.LeafPlan`) say what each leaf
needs; a :class:`Landing` holds everything that changes while reads arrive on
several threads: each leaf's host buffers (made when its first piece lands,
freed as its boxes go to their devices), how many pieces each box and each leaf
still waits for, the boxes already placed, and the finished values. A large leaf
goes to its devices box by box as each box is whole, so host memory follows
progress; a small one all at once when it is complete, because placing arrays
one at a time costs per array (a small model has ~2,400 of them).

How each read lands is decided once, before it is issued
(:func:`objckpt.restoring.modes.landing_mode`): streamed into its boxes as it
arrives (:mod:`objckpt.restoring.scatter`, through :meth:`Landing.boxes_met` and
:meth:`Landing.copy`), or read whole and landed (:meth:`Landing.land`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from objckpt.core.boxes import Box, box_to_slices, index_to_box
from objckpt.core.checksum import damage
from objckpt.core.codecs import decode
from objckpt.core.format import LeafEntry
from objckpt.core.plan import ReadRequest
from objckpt.errors import ChecksumMismatchError, FormatError
from objckpt.restoring.aligned_reads import address
from objckpt.restoring.arena import AssemblyArena
from objckpt.restoring.casts import cast_values
from objckpt.restoring.copies_in_flight import TRANSFER_WINDOW, CopiesInFlight
from objckpt.restoring.landing_seams import Devices, HostMemory
from objckpt.restoring.leaf_plan import LeafPlan, Meets
from objckpt.restoring.recycled import RecycledBuffers
from objckpt.transfer.buffers import DEVICE_ALIGNMENT, aligned_zeros


class _Leaf:
    """What changes for one leaf while it lands (only :class:`Landing` touches it)."""

    __slots__ = (
        "arena",
        "arena_key",
        "box_remaining",
        "buffers",
        "done",
        "placed",
        "placed_boxes",
        "remaining",
        "result",
    )

    def __init__(self) -> None:
        self.buffers: dict[Box, np.ndarray] = {}  # allocated when the first piece for a box lands
        self.remaining = 0  # pieces still to land
        self.box_remaining: dict[Box, int] = {}  # pieces still to land, per box
        self.placed: list[jax.Array] = []  # single-device arrays of finished boxes
        self.placed_boxes: set[Box] = set()
        self.arena: AssemblyArena | None = None  # prefaulted memory for this small leaf's boxes
        self.arena_key = 0
        self.result: Any = None
        self.done = False


class Landing:
    """The buffers and counters of one restore's leaves, and the only code that changes them.

    Methods called from reads' threads take :attr:`lock` where they share
    counters or buffer maps; :attr:`copy_lock` is shared by every streamed
    read (see :class:`objckpt.restoring.scatter.ScatterSink`).
    """

    def __init__(
        self,
        plans: Mapping[int, LeafPlan],
        *,
        memory: HostMemory | None = None,
        devices: Devices | None = None,
        transfer_window: int = TRANSFER_WINDOW,
    ) -> None:
        self.plans = plans
        self.memory = memory or HostMemory()
        self.devices = devices or Devices()
        self.transfers = CopiesInFlight(transfer_window, self.devices.wait, ready=self.devices.ended, done=self._copied)
        self.recycled = RecycledBuffers(ended=self.transfers.release_ended)  # boxes bound for an accelerator
        self.lock = threading.Lock()
        self.copy_lock = threading.Lock()
        self._leaves = {i: _Leaf() for i in plans}

    # ------------------------------------------------------------------ before the reads

    def reserve_arena(self) -> None:
        """Start mapping prefaulted memory for every small leaf that will be assembled from parts.

        Called before the reads are planned, so the mapping overlaps planning
        (:mod:`objckpt.restoring.arena` says why). A small leaf qualifies when
        some box it reads is not exactly one saved piece; all of its boxes get
        room, since a streamed read copies even the pieces that are whole boxes.
        Only leaves that stay in host memory qualify.
        """
        chosen = []
        for key, plan in self.plans.items():
            leaf = self._leaves[key]
            if plan.places_early or leaf.done or not plan.on_host:
                continue
            if plan.needs_assembly:
                leaf.arena_key = key
                chosen.append((key, plan.read_boxes, plan.dtype))
        arena = self.memory.arena(chosen)
        for key, _, _ in chosen:
            self._leaves[key].arena = arena

    def replanned(self, plans: Mapping[int, LeafPlan]) -> Landing:
        """A landing for new plans of the same leaves and boxes (a format-2 restore that had to
        read every index object), keeping the memory :meth:`reserve_arena` started mapping."""
        landing = Landing(plans, memory=self.memory, devices=self.devices, transfer_window=self.transfers.limit)
        for i, leaf in self._leaves.items():
            landing._leaves[i].arena, landing._leaves[i].arena_key = leaf.arena, leaf.arena_key
        return landing

    def start(self) -> list[int]:
        """Set every leaf's counters from its plan; returns the leaves that read nothing
        (each to be finished with :meth:`finish_unread`)."""
        unread = []
        for i, plan in self.plans.items():
            leaf = self._leaves[i]
            leaf.box_remaining = dict(plan.box_pieces)
            leaf.remaining = len(plan.pieces)
            if leaf.remaining == 0:
                unread.append(i)
        return unread

    def finish_unread(self, i: int) -> None:
        """Finish a leaf that reads no piece (zeros, or a leaf with no elements)."""
        self._allocate(i)
        self.finish(i)

    # ------------------------------------------------------------------ memory

    def _allocate(self, i: int, boxes: list[Box] | None = None, *, for_pieces: bool = False) -> list[np.ndarray]:
        """Host buffers for ``boxes`` of leaf ``i`` (all it reads by default), made only when needed.

        Made when the first piece for a box lands and, for large sharded leaves, freed
        as soon as the box is complete, so host memory follows progress. With
        ``for_pieces`` the buffers are left uncleared: the saved pieces tile each leaf
        exactly (checked when the manifest is parsed), a box is placed only once
        every piece that meets it has landed, and a failed read fails the restore,
        so every byte is written before it can be read.

        Returns the fresh mappings it made for pieces (of a large leaf that stays in host
        memory, or of any leaf bound for an accelerator), whose pages none of the copies
        has faulted in yet: the caller faults them in (:meth:`_fault_in`) once it has let
        go of the lock it allocates under. A leaf bound for an accelerator borrows its
        buffers from :attr:`recycled`, which takes them back once their copies have ended
        (:mod:`objckpt.restoring.recycled` says why).
        """
        plan, leaf = self.plans[i], self._leaves[i]
        if leaf.done:
            return []
        buffers = leaf.buffers
        missing = [box for box in (plan.read_boxes if boxes is None else boxes) if box not in buffers]
        if not missing:
            return []
        if for_pieces and not plan.places_early:  # a small leaf: every box that pieces assemble, in one buffer
            missing += [box for box in plan.assembled if box not in buffers and box not in missing]
        made = leaf.arena.buffers(leaf.arena_key) if for_pieces and leaf.arena is not None else None
        if made is not None:  # made ahead, in prefaulted memory (see reserve_arena)
            buffers.update((box, made[box]) for box in missing)
            return []
        shapes = [tuple(b - a for a, b in zip(*box)) for box in missing]
        if plan.recycles_buffers and for_pieces:  # lent, and taken back once copied (objckpt.restoring.recycled)
            fresh = []
            for box, shape in zip(missing, shapes):
                buffers[box], mapping = self.recycled.take(shape, plan.dtype)
                if mapping is not None:
                    fresh.append(mapping)
            return fresh
        if not plan.on_host:
            new = np.empty if for_pieces else np.zeros
            buffers.update((box, new(shape, plan.dtype)) for box, shape in zip(missing, shapes))
            return []
        arrays = self.memory.arrays
        if plan.places_early:  # a buffer per box, each freed once its box is placed
            for box, shape in zip(missing, shapes):
                (buffers[box],) = arrays([shape], plan.dtype, zeroed=not for_pieces)
            return [buffers[box] for box in missing] if for_pieces else []
        buffers.update(zip(missing, arrays(shapes, plan.dtype, zeroed=not for_pieces)))
        return []

    def _wait_for_arena(self, i: int) -> None:
        """Wait until a small leaf's prefaulted memory is ready, if it has some.

        Called before taking the allocation lock: :meth:`_allocate` would
        otherwise wait there, holding every other thread's allocations (of
        leaves whose memory is ready) behind this one.
        """
        arena = self._leaves[i].arena
        if arena is not None:
            arena.buffers(self._leaves[i].arena_key)

    def _fault_in(self, fresh: list[np.ndarray]) -> None:
        """Fault in the pages of buffers :meth:`_allocate` just made, before pieces are copied
        into them (cheaper than a fault per page inside the copies: :func:`objckpt.transfer.buffers.fault_in`).

        Called without the lock held: other threads may already be copying into
        the same buffers, which is harmless (a page already in is left as is).
        """
        for buffer in fresh:
            self.memory.fault_in(buffer)

    def boxes_met(self, i: int, piece: Any) -> Meets:
        """The boxes of leaf ``i`` that a planned piece meets (with their overlaps), their
        buffers made if missing.

        Looked at without the lock first: a box's buffer, once made, stays until
        the box is complete, which needs this very piece.
        """
        meets = self.plans[i].meets_of(piece)
        buffers = self._leaves[i].buffers
        if not all(box in buffers for box, _ in meets):
            self._wait_for_arena(i)
            with self.lock:
                fresh = self._allocate(i, [box for box, _ in meets], for_pieces=True)
            self._fault_in(fresh)
        return meets

    def copy(self, i: int, overlaps: Meets, source: np.ndarray, origin: tuple[int, ...]) -> None:
        """Copy each (box, overlap) of ``source`` (whose first element sits at ``origin``) into
        that box's buffer of leaf ``i`` (made by :meth:`boxes_met`)."""
        buffers = self._leaves[i].buffers
        for box, (start, stop) in overlaps:
            buffers[box][box_to_slices(start, stop, origin=box[0])] = source[box_to_slices(start, stop, origin=origin)]

    def place_of(self, i: int, box: Box, start: tuple[int, ...], stop: tuple[int, ...]) -> np.ndarray | None:
        """The region ``[start, stop)`` of leaf ``i``'s buffer for ``box`` (made by :meth:`boxes_met`),
        when it is one contiguous, writable run of memory a read can land in as is; else None."""
        buffer = self._leaves[i].buffers.get(box)
        if buffer is None or not buffer.flags.writeable:
            return None
        slices = box_to_slices(start, stop, origin=box[0])
        region = buffer[slices] if slices else buffer.view()  # a view, a 0-d one too (buffer[()] copies)
        return region if region.flags.c_contiguous else None

    def buffers(self, i: int) -> dict[Box, np.ndarray]:
        """Leaf ``i``'s host buffers now, by box (read-only use: tests and checks)."""
        return self._leaves[i].buffers

    # ------------------------------------------------------------------ a whole response

    def land(self, request: ReadRequest, data: memoryview, url: str) -> None:
        """All one whole response does, in one trip off the loop thread (a trip costs more than placing a box).

        Allocate the boxes it copies into, check and scatter its pieces (or
        adopt them, see :meth:`_adoptable`), then :meth:`count` them.
        """
        fresh: list[np.ndarray] = []
        for part in request.parts:
            self._wait_for_arena(part.leaf)
        with self.lock:
            adopted = self._adoptable(request, data)
            for k, part in enumerate(request.parts):
                if k not in adopted:
                    meets = self.plans[part.leaf].meets_of(part.piece)
                    fresh += self._allocate(part.leaf, [box for box, _ in meets], for_pieces=True)
        self._fault_in(fresh)
        self._scatter(request, data, url, adopted)
        self.count(request)

    def _adoptable(self, request: ReadRequest, data: memoryview) -> set[int]:
        """The parts (by index) whose response bytes can become their box's host array as is.

        That takes a piece that is exactly one box of a leaf placed box by box (a
        read-only view is fine there: it goes straight to its devices), no cast, and
        bytes on the alignment boundary, or a leaf bound for an accelerator, where
        ``device_put`` copies from any address and a copy into a buffer of the box's
        own would only cost a host memcpy more.
        """
        base = address(data)
        return {
            k
            for k, part in enumerate(request.parts)
            if ((base + part.offset) % DEVICE_ALIGNMENT == 0 or not self.plans[part.leaf].on_host)
            and self.plans[part.leaf].whole_box(part.piece)
            and self.plans[part.leaf].entry.codec is None  # stored bytes are not the values
            and (part.piece.start, part.piece.stop) not in self._leaves[part.leaf].buffers
        }

    def _scatter(self, request: ReadRequest, data: memoryview, url: str, adopted: set[int]) -> None:
        """Check each piece of one response and copy it into the boxes that need it.

        An adopted part becomes its box's buffer instead of being copied. Pieces
        never overlap, so threads scattering different responses into the same
        leaf write disjoint regions. On a mismatch the parts adopted so far are
        let go again, so the read can be landed anew.
        """
        for k, part in enumerate(request.parts):
            piece = part.piece
            plan = self.plans[part.leaf]
            raw = data[part.offset : part.offset + piece.length]
            wrong = damage(raw, piece.crc32c, piece.sha256)
            if wrong is not None:
                for j in adopted:
                    if j < k:
                        taken = request.parts[j]
                        self._leaves[taken.leaf].buffers.pop((taken.piece.start, taken.piece.stop), None)
                raise ChecksumMismatchError(
                    f"{wrong} mismatch in leaf {plan.entry.path}: blob {url}/{piece.blob}"
                    f" bytes [{piece.offset}, {piece.offset + piece.length})"
                )
            if plan.entry.codec is not None:  # checked as stored, then decoded (objckpt.core.codecs)
                (box, (start, stop)), *more = plan.meets_of(piece)
                inside = not more and (start, stop) == (piece.start, piece.stop)
                into = self.place_of(part.leaf, box, start, stop) if inside else None  # decoded in place
                source = self._decoded(plan, piece, raw, url, into)
                if into is not None:
                    continue
            else:
                source = np.frombuffer(raw, dtype=plan.dtype).reshape(piece.shape)
            if k in adopted:
                self._leaves[part.leaf].buffers[(piece.start, piece.stop)] = source
                continue
            self.copy(part.leaf, plan.meets_of(piece), source, piece.start)

    @staticmethod
    def _decoded(plan: LeafPlan, piece: Any, stored: memoryview, url: str, into: np.ndarray | None) -> np.ndarray:
        """A compressed piece's values from its checked stored bytes (FormatError naming it),
        decoded into ``into`` (its place in a box) when given."""
        where = f"leaf {plan.entry.path}: blob {url}/{piece.blob} bytes [{piece.offset}, {piece.offset + piece.length})"
        nbytes = math.prod(piece.shape) * plan.dtype.itemsize
        return decode(stored, plan.dtype.itemsize, nbytes, where, into).view(plan.dtype).reshape(piece.shape)

    # ------------------------------------------------------------------ counting and finishing

    def count(self, request: ReadRequest) -> None:
        """Count a read's pieces as landed: put each box of a large leaf it completes on
        its devices, then finish each leaf it completes (a small leaf goes whole then).

        A part is counted done only after its boxes are placed, so a leaf is
        never finished while another thread still places one of its boxes.
        """
        done: list[tuple[int, Box]] = []
        with self.lock:
            for part in request.parts:
                plan = self.plans[part.leaf]
                if plan.places_early:
                    remaining = self._leaves[part.leaf].box_remaining
                    for box, _ in plan.meets_of(part.piece):
                        remaining[box] -= 1
                        if remaining[box] == 0:
                            done.append((part.leaf, box))
        self._place_boxes(done)
        finished: list[int] = []
        with self.lock:
            for part in request.parts:
                leaf = self._leaves[part.leaf]
                leaf.remaining -= 1
                if leaf.remaining == 0:
                    finished.append(part.leaf)
        for i in finished:
            self.finish(i)

    def _place_boxes(self, done: list[tuple[int, Box]]) -> None:
        """Put complete boxes on their devices in one batched transfer and free their host buffers.

        One ``jax.device_put`` of many arrays costs less than one call per array,
        and a small model's restore is mostly this placement.
        """
        hosts: list[np.ndarray] = []
        devices: list[Any] = []
        owners: list[_Leaf] = []
        lent: list[np.ndarray] = []  # buffers to give back once copied
        to_accelerator = 0  # host bytes whose copy to an accelerator is still to run
        for i, box in done:
            plan, leaf = self.plans[i], self._leaves[i]
            host = leaf.buffers.pop(box)
            if plan.recycles_buffers:
                lent.append(host)
            if plan.casts:
                host = cast_values(plan.entry.path, host, plan.out_dtype, unsafe=plan.unsafe_cast)
            for device in plan.devices_by_box[box]:
                hosts.append(host)
                devices.append(device)
                owners.append(leaf)
            leaf.placed_boxes.add(box)
            if not plan.on_host:
                to_accelerator += host.nbytes
        if not hosts:
            return
        arrays = self.devices.put(hosts, devices)
        for leaf, array in zip(owners, arrays):
            leaf.placed.append(array)
        if to_accelerator:
            self.transfers.started(arrays, to_accelerator, lent)

    def _copied(self, hosts: list[np.ndarray]) -> None:
        """Copies made from ``hosts`` have ended: lent buffers among them go back to :attr:`recycled`."""
        self.recycled.give_back(hosts)

    def finish(self, i: int) -> None:
        """Turn leaf ``i``'s filled buffers into its final value and free them."""
        plan, leaf = self.plans[i], self._leaves[i]
        entry = plan.entry
        if plan.places_boxes:  # a box that no piece fills (it has no elements) starts as zeros
            self._allocate(
                i, [box for box in plan.devices_by_box if box not in leaf.buffers and box not in leaf.placed_boxes]
            )
        buffers = leaf.buffers
        if plan.casts:
            buffers = {
                box: cast_values(entry.path, b, plan.out_dtype, unsafe=plan.unsafe_cast) for box, b in buffers.items()
            }
        put = self.devices.put
        if plan.designated is not None:  # replicas other than the designated one start as zeros
            assert plan.sharding is not None
            out_dtype = plan.out_dtype if plan.out_dtype is not None else plan.dtype
            singles = []
            for box, devices in plan.devices_by_box.items():
                for device in devices:
                    mine = [slab for slab, reader in plan.designated[box] if reader == device]
                    if mine == [box]:
                        host = buffers[box]
                    else:  # zeros but for the slabs this device read
                        host = aligned_zeros(tuple(b - a for a, b in zip(*box)), out_dtype)
                        for slab in mine:
                            host[box_to_slices(*slab, origin=box[0])] = buffers[slab]
                    singles.append(put(host, device))
            leaf.result = self.devices.from_single_arrays(entry.shape or (), plan.sharding, singles)
        elif plan.places_early:
            assert plan.sharding is not None
            self._place_boxes([(i, box) for box in list(leaf.buffers)])  # the boxes with no elements
            leaf.result = self.devices.from_single_arrays(entry.shape or (), plan.sharding, leaf.placed)
            leaf.placed = []
        elif plan.sharding is not None:  # one transfer for the whole leaf
            shape = entry.shape or ()
            leaf.result = self.devices.from_callback(
                shape, plan.sharding, lambda index: buffers[index_to_box(index, shape)]
            )
        else:
            (value,) = buffers.values()
            if entry.prng_impl is not None:
                leaf.result = self._keys(plan, value)
            elif entry.kind == "str":
                leaf.result = _decode_str(entry, value.tobytes())
            elif entry.kind == "bytes":
                leaf.result = value.tobytes()
            else:
                leaf.result = value
        if not plan.on_host and not plan.places_early and buffers:
            lent = list(leaf.buffers.values()) if plan.recycles_buffers else []
            self.transfers.started(leaf.result, sum(b.nbytes for b in buffers.values()), lent)
        leaf.buffers = {}
        leaf.done = True

    def _keys(self, plan: LeafPlan, data: np.ndarray) -> jax.Array:
        """Typed PRNG keys from their saved key data (read whole), on the target's sharding.

        Built device by device, each from its slice of the keys, so a sharding
        over devices of several processes (a key replicated over a multi-process
        mesh, as every ``nnx.Rngs`` holds) works: each process places only its own
        devices' keys, where one ``jax.device_put`` onto that sharding is refused.
        """
        keys = jax.random.wrap_key_data(jax.numpy.asarray(data), impl=plan.entry.prng_impl)
        if plan.key_sharding is None:
            return keys
        return self.devices.from_callback(keys.shape, plan.key_sharding, lambda index: keys[index])

    def done(self, i: int) -> bool:
        """Whether leaf ``i`` is finished."""
        return self._leaves[i].done

    def result(self, i: int) -> Any:
        """Leaf ``i``'s restored value (once :meth:`done`)."""
        return self._leaves[i].result

    def results(self) -> Iterator[tuple[int, Any]]:
        """(leaf, restored value) for every leaf, in the plans' order."""
        return ((i, self._leaves[i].result) for i in self.plans)


def _decode_str(entry: LeafEntry, data: bytes) -> str:
    """A ``str`` leaf's bytes as text; the format stores them as UTF-8, so anything else
    is a malformed checkpoint (its crc32c matched: the writer put these bytes there)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"leaf {entry.path}: a str leaf whose bytes are not UTF-8 (at byte {e.start})") from None
