"""A leaf's restore plan and its landing, tested through their seams with no devices and no I/O.

``LeafPlan`` is frozen and pure: made from a manifest entry and a target (or
built directly, with stand-in devices), it says which pieces meet which boxes,
which boxes are assembled, whether a piece can be adopted and whether the boxes
are covered exactly. ``Landing`` is fed responses by hand here; its devices are
a :class:`~objckpt.restoring.landing.Devices` that records what would be placed.
The choice of how a read lands (:func:`~objckpt.restoring.modes.landing_mode`)
is a function of the store's traits and the read.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from objckpt.core.checksum import crc32c
from objckpt.core.format import LeafEntry
from objckpt.core.format.rows import rows_from_pieces
from objckpt.core.pieces import Piece
from objckpt.core.plan import ReadPart, ReadRequest
from objckpt.errors import ChecksumMismatchError
from objckpt.restoring.aligned_reads import ResponseAlignment
from objckpt.restoring.landing import Devices, Landing
from objckpt.restoring.leaf_plan import LeafPlan, plan_leaf
from objckpt.restoring.modes import Mode, landing_mode

F32 = np.dtype(np.float32)


def _cells(shape, cell, values, blob="b", spacer=64):
    """Pieces tiling ``shape`` in ``cell``-shaped boxes, C-ordered in one blob; (pieces, blob bytes)."""
    pieces, body = [], bytearray(spacer)
    for r in range(0, shape[0], cell[0]):
        for c in range(0, shape[1], cell[1]):
            data = np.ascontiguousarray(values[r : r + cell[0], c : c + cell[1]]).tobytes()
            pieces.append(Piece((r, c), (r + cell[0], c + cell[1]), blob, len(body), len(data), crc32c(data)))
            body += data + bytes(-len(data) % 64)
    return tuple(pieces), bytes(body)


def _entry(pieces, shape=(8, 6)):
    """The leaf as a restore plans it: its pieces as rows (``Manifest.in_columns``)."""
    return LeafEntry("['w']", "array", "float32", shape, rows_from_pieces([(0, pieces, 4)]).leaf(0) if pieces else ())


def _rows(shape, parts):
    """Boxes cutting ``shape`` into ``parts`` row blocks, each on two stand-in devices."""
    step = shape[0] // parts
    return {((k * step, 0), ((k + 1) * step, shape[1])): [f"dev{2 * k}", f"dev{2 * k + 1}"] for k in range(parts)}


def _sharded(entry, boxes, **kwargs):
    """A plan of a sharded leaf on stand-in devices (no JAX sharding: only ``is not None`` is asked)."""
    return LeafPlan(entry, F32, F32, "a sharding", boxes, **kwargs)


def test_a_plan_says_which_pieces_meet_which_boxes_without_devices():
    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    pieces, _ = _cells((8, 6), (4, 3), values)
    plan = _sharded(_entry(pieces), _rows((8, 6), 2))
    assert plan.pieces == list(pieces)
    assert plan.box_pieces == {((0, 0), (4, 6)): 2, ((4, 0), (8, 6)): 2}
    assert plan.meets_of(pieces[1]) == [(((0, 0), (4, 6)), ((0, 3), (4, 6)))]
    assert plan.assembled == list(plan.read_boxes)  # no box is one saved piece
    assert plan.needs_assembly and not any(plan.whole_box(p) for p in pieces)
    assert plan.uncovered() is None
    assert plan.host_bytes == 48 * 4  # on the host: every box it reads
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.entry = _entry(())  # type: ignore[misc]


def test_whole_boxes_are_adoptable_unless_cast_or_finished_whole():
    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    pieces, _ = _cells((8, 6), (4, 6), values)
    boxes = _rows((8, 6), 2)
    plan = _sharded(_entry(pieces), boxes)
    assert plan.assembled == [] and not plan.needs_assembly
    assert all(plan.whole_box(p) for p in pieces)
    assert not LeafPlan(_entry(pieces), F32, np.dtype(np.float64), "a sharding", boxes).whole_box(pieces[0])
    assert not LeafPlan(_entry(pieces), F32, None, None, boxes).whole_box(pieces[0])  # numpy: one buffer
    assert not _sharded(_entry(pieces), boxes).places_early  # 192 bytes: placed whole
    assert _sharded(_entry(pieces), boxes, whole_leaf_bytes=0).places_early


def test_holes_and_overlaps_are_found_and_named():
    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    pieces, _ = _cells((8, 6), (4, 3), values)
    boxes = _rows((8, 6), 2)
    hole = _sharded(_entry(pieces[:3]), boxes)
    assert hole.uncovered() == ((4, 0), (8, 6))
    twice = _sharded(_entry((*pieces, pieces[0])), boxes)
    assert twice.uncovered() == ((0, 0), (4, 6))
    assert twice.overlapping(((0, 0), (4, 6))) == (pieces[0], pieces[0])
    wide = Piece((0, 0), (4, 4), "b", 0, 64, 0)
    overlaps = _sharded(_entry((wide, *pieces)), boxes)
    assert overlaps.uncovered() == ((0, 0), (4, 6))
    assert set(overlaps.overlapping(((0, 0), (4, 6)))) in ({wide, pieces[0]}, {wide, pieces[1]})


def test_with_entry_plans_the_new_pieces_and_leaves_the_plan_as_it_was():
    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    pieces, _ = _cells((8, 6), (4, 3), values)
    root = _sharded(_entry(()), _rows((8, 6), 2))  # format 2's root: no pieces yet
    assert not root.pieces and root.box_pieces == {((0, 0), (4, 6)): 0, ((4, 0), (8, 6)): 0}
    full = root.with_entry(_entry(pieces))
    assert list(full.pieces) == list(pieces) and not root.pieces
    assert full.read_boxes == root.read_boxes and full.devices_by_box is root.devices_by_box


def test_plan_leaf_without_a_sharding_plans_one_host_box():
    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    pieces, _ = _cells((8, 6), (4, 3), values)
    plan = plan_leaf(_entry(pieces), None)
    assert plan.sharding is None and plan.on_host and plan.read_boxes == [((0, 0), (8, 6))]
    assert plan.box_pieces == {((0, 0), (8, 6)): 4}


def _request(pieces, leaf=0):
    first, last = pieces[0].offset, pieces[-1].offset + pieces[-1].length
    return ReadRequest("b", first, last, tuple(ReadPart(leaf, p, p.offset - first) for p in pieces))


def test_the_landing_mode_is_a_function_of_the_traits_and_the_read():
    big = ResponseAlignment.LARGE // 4
    values = np.zeros((2 * big // 256, 256), np.float32)
    pieces, _ = _cells(values.shape, (values.shape[0] // 4, 256), values)  # pieces of LARGE / 2
    boxes = {(p.start, p.stop): ["dev"] for p in pieces}
    plans = {0: _sharded(_entry(pieces, values.shape), boxes)}
    large = _request(pieces)
    assert large.length >= ResponseAlignment.LARGE
    assert landing_mode(large, plans, streams_reads=True, reads_in_place=True) is Mode.ADOPTED
    assert landing_mode(large, plans, streams_reads=False, reads_in_place=True) is Mode.ADOPTED
    assert landing_mode(large, plans, streams_reads=True, reads_in_place=False) is Mode.STREAMED
    assert landing_mode(large, plans, streams_reads=False, reads_in_place=False) is Mode.COPIED
    small = _request(pieces[:1])  # under LARGE: no predictable phase, never adopted
    assert landing_mode(small, plans, streams_reads=True, reads_in_place=True) is Mode.STREAMED
    cast = {0: LeafPlan(plans[0].entry, F32, np.dtype(np.float64), "a sharding", boxes)}
    assert landing_mode(large, cast, streams_reads=False, reads_in_place=True) is Mode.COPIED


def test_a_landing_fed_by_hand_assembles_a_host_leaf():
    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    pieces, blob = _cells((8, 6), (4, 3), values)
    landing = Landing({0: plan_leaf(_entry(pieces), None)})
    assert landing.start() == []
    landing.land(_request(pieces[:2]), memoryview(blob)[pieces[0].offset :], "mem://x")
    assert not landing.done(0)
    landing.land(_request(pieces[2:]), memoryview(blob)[pieces[2].offset :], "mem://x")
    assert landing.done(0)
    np.testing.assert_array_equal(landing.result(0), values)
    assert landing.buffers(0) == {}  # handed over, nothing held


def test_a_corrupt_piece_fails_its_landing_naming_leaf_and_blob_and_counts_nothing():
    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    pieces, blob = _cells((8, 6), (4, 3), values)
    landing = Landing({0: plan_leaf(_entry(pieces), None)})
    landing.start()
    damaged = bytearray(blob)
    damaged[pieces[1].offset + 5] ^= 1
    with pytest.raises(ChecksumMismatchError, match=r"\['w'\]: blob mem://x/b"):
        landing.land(_request(pieces), memoryview(bytes(damaged))[pieces[0].offset :], "mem://x")
    landing.land(_request(pieces), memoryview(blob)[pieces[0].offset :], "mem://x")  # read again: lands once
    np.testing.assert_array_equal(landing.result(0), values)


def test_large_leaves_are_placed_box_by_box_in_one_batch_per_read():
    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    pieces, blob = _cells((8, 6), (2, 6), values)  # four pieces, two per box
    puts: list[list[str]] = []
    made: list[tuple] = []

    def put(hosts, devices):
        puts.append(list(devices))
        return [(device, host.copy()) for host, device in zip(hosts, devices)]

    devices = Devices(put=put, from_single_arrays=lambda shape, sharding, arrays: made.append(arrays) or "leaf")
    plan = _sharded(_entry(pieces), _rows((8, 6), 2), whole_leaf_bytes=0)
    landing = Landing({0: plan}, devices=devices)
    landing.start()
    first = memoryview(blob)[pieces[0].offset :]
    landing.land(_request(pieces[:1]), first, "mem://x")
    assert puts == []  # the first box still waits for its second piece
    landing.land(_request(pieces[1:3]), memoryview(blob)[pieces[1].offset :], "mem://x")
    assert puts == [["dev0", "dev1"]]  # the first box, on both its devices, in one call
    landing.land(_request(pieces[3:]), memoryview(blob)[pieces[3].offset :], "mem://x")
    assert puts == [["dev0", "dev1"], ["dev2", "dev3"]]
    assert landing.result(0) == "leaf" and len(made) == 1
    placed = {device: host for device, host in made[0]}
    np.testing.assert_array_equal(placed["dev0"], values[:4])
    np.testing.assert_array_equal(placed["dev3"], values[4:])
