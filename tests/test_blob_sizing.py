"""Blob sizes for request limits: each process picks its blob size from its own bytes.

A pod-scale save aims at ``Options.blobs_per_save`` PUTs, small saves keep
``Options.blob_size`` blobs, pieces never grow past ``Options.blob_size`` (so
restores read what they read before), and a staged blob never takes more than a
quarter of the staging memory.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from helpers import assert_tree_bit_exact, count_reads, full_manifest, random_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.core.plan import PACKING_SLACK, OwnedPiece, packing_order, plan_blobs
from objckpt.options import GiB, MiB, Options
from objckpt.saving import upload as upload_module
from objckpt.saving.blob_sizing import blob_size_for, save_blob_size, split_pieces, staging_limit
from objckpt.saving.staging import StagingPool
from objckpt.storage import from_url
from objckpt.transfer.stats import TransferStats

# Llama-3-405B with bf16 params, fp32 master, Adam mu and nu (benchmarks/scale/state.py), saved from
# fsdp=512 x tensor=8 (4,096 devices) by 1,024 processes of 4 devices each.
D_MODEL, FFN, VOCAB, LAYERS, Q, KV = 16384, 53248, 128256, 126, 128 * 128, 8 * 128
FSDP, TENSOR, PROCESSES, DEVICES_PER_PROCESS = 512, 8, 1024, 4
COPIES = (2, 4, 4, 4)  # itemsize of params, master, mu, nu
MATRICES = {  # per layer: shape and which mesh axis cuts each dimension
    "wq": ((D_MODEL, Q), (FSDP, TENSOR)),
    "wk": ((D_MODEL, KV), (FSDP, TENSOR)),
    "wv": ((D_MODEL, KV), (FSDP, TENSOR)),
    "wo": ((Q, D_MODEL), (TENSOR, FSDP)),
    "w1": ((D_MODEL, FFN), (FSDP, TENSOR)),
    "w3": ((D_MODEL, FFN), (FSDP, TENSOR)),
    "w2": ((FFN, D_MODEL), (TENSOR, FSDP)),
}
OUTER = {"embed": ((VOCAB, D_MODEL), (TENSOR, FSDP)), "lm_head": ((D_MODEL, VOCAB), (FSDP, TENSOR))}


def _process_pieces(stacked: bool) -> list[OwnedPiece]:
    """One process's pieces of the 405B state (the layer matrices and the two vocab matrices: all
    but the norms, under 0.01% of the bytes), one box per device and leaf, in packing order."""
    pieces = []
    leaf = 0
    for itemsize in COPIES:
        shapes = [*OUTER.values()]
        if stacked:
            shapes += [((LAYERS, *shape), (1, *cuts)) for shape, cuts in MATRICES.values()]
        else:
            shapes += [m for _ in range(LAYERS) for m in MATRICES.values()]
        for shape, cuts in shapes:
            box = tuple(n // c for n, c in zip(shape, cuts))
            for device in range(DEVICES_PER_PROCESS):  # boxes of different devices: distinct starts
                start = (device * box[0], *(0 for _ in box[1:]))
                pieces.append(OwnedPiece(leaf, start, tuple(s + b for s, b in zip(start, box)), itemsize, None, device))
            leaf += 1
    pieces.sort(key=packing_order)
    return pieces


def _whole_save_puts(blobs_per_process: int) -> int:
    """Every PUT of the save: each process's blobs, index object and live-save marker, and the root."""
    return PROCESSES * (blobs_per_process + 2) + 1


@pytest.mark.parametrize("stacked", [False, True], ids=["unstacked", "stacked"])
@pytest.mark.parametrize("hold_uploads", [False, True], ids=["save", "save_async"])
def test_a_405b_save_from_1024_processes_makes_at_most_50000_puts(stacked, hold_uploads):
    options = Options(memory_budget=16 * GiB)  # a TPU host's default: a quarter of its RAM, capped
    owned = split_pieces(_process_pieces(stacked), max_bytes=options.blob_size)
    host_bytes = sum(p.nbytes for p in owned)
    assert 5.0e9 < host_bytes * PROCESSES < 6.0e12 and 5.4e9 < host_bytes < 5.6e9  # the 5.7 TB state

    floor_blobs = plan_blobs(owned, blob_size=options.blob_size, key=str)
    size = save_blob_size(options, host_bytes, processes=PROCESSES, hold_uploads=hold_uploads)
    blobs = plan_blobs(owned, blob_size=size, key=str)

    assert _whole_save_puts(len(floor_blobs)) > 170_000  # what 32 MiB blobs cost: the problem
    assert _whole_save_puts(len(blobs)) <= 50_000
    assert size <= staging_limit(options, hold_uploads=hold_uploads) // 4
    assert size == (128 * MiB if not hold_uploads else 192 * MiB)  # the sync save's 512 MiB pool caps it

    # The same pieces as in 32 MiB blobs: a restore reads the same boxes, with the same checksums.
    def boxes(plan):
        return sorted((p.piece.leaf, p.piece.start, p.piece.stop) for b in plan for p in b.pieces)

    assert boxes(blobs) == boxes(floor_blobs)
    assert all(b.size <= size + PACKING_SLACK for b in blobs)


def test_small_saves_keep_the_floor():
    floor, ceiling = 32 * MiB, 256 * MiB
    for host_bytes, processes in [(0, 1), (1, 1), (10 * GiB, 1), (100 * GiB, 1), (1 * GiB, 8), (2 * GiB, 256)]:
        got = blob_size_for(host_bytes, processes=processes, floor=floor, ceiling=ceiling, blobs_per_save=32_768)
        assert got == floor, (host_bytes, processes)
    assert save_blob_size(Options(), 40 * GiB, processes=1, hold_uploads=False) == 32 * MiB


def test_blob_size_is_clamped_and_rounded_to_whole_pieces():
    def size(host_bytes, processes=1024, floor=32 * MiB, ceiling=256 * MiB, target=32_768):
        return blob_size_for(host_bytes, processes=processes, floor=floor, ceiling=ceiling, blobs_per_save=target)

    assert size(5 * GiB) == 160 * MiB  # 5 GiB over 32 blobs
    assert size(5 * GiB + 1) == 192 * MiB  # a multiple of the floor, so 32 MiB pieces fill a blob
    assert size(64 * GiB) == 256 * MiB  # the ceiling
    assert size(64 * GiB, ceiling=100 * MiB) == 100 * MiB
    assert size(64 * GiB, floor=64 * MiB, ceiling=32 * MiB) == 64 * MiB  # the user's floor wins
    assert size(5 * GiB, processes=8192) == 256 * MiB  # more processes than the target: one blob each, capped
    assert size(5 * GiB, processes=1, target=1, ceiling=8 * GiB) == 5 * GiB


def test_staged_blobs_stay_within_the_staging_memory():
    for options, hold in [
        (Options(memory_budget=16 * GiB), False),  # save: the 512 MiB recycled pool
        (Options(memory_budget=16 * GiB), True),  # save_async: the budget
        (Options(memory_budget=256 * MiB), True),
        (Options(memory_budget=256 * MiB, staging_pool=64 * MiB), False),
    ]:
        limit = staging_limit(options, hold_uploads=hold)
        size = save_blob_size(options, 1 << 50, processes=1024, hold_uploads=hold)
        assert size == max(options.blob_size, min(options.max_blob_size, limit // 4))
        pool = StagingPool(limit, capacity=size + PACKING_SLACK)  # as snapshot_and_upload makes it
        assert pool.max_buffers * pool.capacity <= max(limit, options.blob_size + PACKING_SLACK)
        assert pool.max_buffers >= 3 or size == options.blob_size


def test_split_pieces_keeps_order_and_bytes_and_caps_size():
    pieces = [
        OwnedPiece(0, (0, 0), (1000, 300), 4, "a", 0),
        OwnedPiece(1, (0,), (10,), 2, "b", 1, True),
        OwnedPiece(2, (0, 0, 0), (3, 700, 700), 1, "c", 2),
    ]
    out = split_pieces(pieces, max_bytes=64 << 10)
    assert all(p.nbytes <= 64 << 10 for p in out)
    for piece in pieces:
        parts = [p for p in out if p.leaf == piece.leaf]
        assert sum(p.nbytes for p in parts) == piece.nbytes
        assert {(p.source, p.device, p.shared) for p in parts} == {(piece.source, piece.device, piece.shared)}
    assert [p.leaf for p in out] == sorted(p.leaf for p in out)  # each piece's parts where it was
    assert split_pieces(pieces[1:2], max_bytes=64 << 10)[0] is pieces[1]  # small ones pass as they are


def test_options_bounds():
    with pytest.raises(ValueError, match="max_blob_size"):
        Options(max_blob_size=6 * GiB)
    with pytest.raises(ValueError, match="blobs_per_save"):
        Options(blobs_per_save=0)


def _tree():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharded = {
        f"w{i}": jax.device_put(random_array((512, 512), np.float32, seed=i), NamedSharding(mesh, P("data", "model")))
        for i in range(4)
    }
    small = {f"s{i}": random_array((37 * i + 5,), np.uint8, seed=100 + i) for i in range(20)}
    return {"sharded": sharded, "small": small, "host": random_array((300, 1000), np.float32, seed=9)}


FLOOR = 64 << 10


def _save_and_restore(target, tree, name, options, monkeypatch):
    """Save ``tree`` with ``options`` under ``name``, restore it onto its own shardings counting
    every read; (blobs, pieces, data reads, restore stats, save stats)."""
    url = f"{target.url}/{name}"
    save_stats = objckpt.save(url, tree, storage_options=target.storage_options, options=options)
    manifest = full_manifest(from_url(url, **target.storage_options))
    blob_keys = {b.key for b in manifest.blobs}
    counting = count_reads(monkeypatch)
    stats = TransferStats()
    read_options = Options(read_chunk=FLOOR, max_read_size=FLOOR)  # reads of at most one piece's size
    restored = objckpt.restore(url, tree, storage_options=target.storage_options, options=read_options, stats=stats)
    assert_tree_bit_exact(jax.tree.map(np.asarray, tree), jax.tree.map(np.asarray, restored))
    reads = sorted((k, a, b) for store in counting for k, a, b in store.reads if k in blob_keys)
    pieces = sorted((p.length, p.crc32c) for leaf in manifest.leaves for p in leaf.pieces)
    monkeypatch.undo()
    return manifest.blobs, pieces, reads, stats, save_stats


@pytest.mark.s3
@pytest.mark.parametrize("staged", [False, True], ids=["in_place", "staged"])
def test_larger_blobs_round_trip_and_restores_read_the_same_pieces(s3_store, monkeypatch, staged):
    """Force the rule to pick blobs 8x the floor: the save writes ~8x fewer blobs, restores bit-exact,
    and each restore GET is no larger, and no more numerous, than from floor-sized blobs."""
    tree = _tree()
    floor_options = Options(blob_size=FLOOR)
    sized_options = Options(blob_size=FLOOR, max_blob_size=8 * FLOOR, blobs_per_save=4)
    pools: list[StagingPool] = []
    if staged:

        class RecordingPool(StagingPool):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                pools.append(self)

        sized_options = Options(blob_size=FLOOR, max_blob_size=64 * FLOOR, blobs_per_save=4, staging_pool=16 * FLOOR)

    base_blobs, base_pieces, base_reads, base_stats, _ = _save_and_restore(
        s3_store, tree, "floor", floor_options, monkeypatch
    )
    if staged:
        monkeypatch.setattr(upload_module, "piece_bytes_of", lambda piece, host: None)  # stage every blob
        monkeypatch.setattr(upload_module, "StagingPool", RecordingPool)
    blobs, pieces, reads, stats, save_stats = _save_and_restore(s3_store, tree, "sized", sized_options, monkeypatch)

    nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    assert all(b.size <= FLOOR + PACKING_SLACK for b in base_blobs)
    assert len(base_blobs) >= nbytes // FLOOR
    # The rule's size: a quarter of the bytes (blobs_per_save=4), whole pieces, within the bounds.
    size = max(b.size for b in blobs)
    expected = min(-(-nbytes // 4 // FLOOR) * FLOOR, 8 * FLOOR if not staged else 4 * FLOOR)
    assert expected - FLOOR < size <= expected + PACKING_SLACK
    assert len(blobs) <= math.ceil(len(base_blobs) / (expected // FLOOR)) + 1
    assert save_stats.objects_written < len(base_blobs)
    if staged:  # blobs staged whole take a quarter of the staging pool at most
        (pool,) = pools
        assert pool.capacity <= 4 * FLOOR + PACKING_SLACK and pool.max_buffers * pool.capacity <= 16 * FLOOR

    assert pieces == base_pieces  # the same pieces, byte for byte
    assert all(b - a <= FLOOR + PACKING_SLACK for _, a, b in reads)  # every GET piece-sized
    assert len(reads) <= len(base_reads)
    for got in (reads, base_reads):  # every byte once, and only the spacing between joined pieces besides
        assert nbytes <= sum(b - a for _, a, b in got) <= nbytes + 128 * len(pieces)
    assert stats.requests <= base_stats.requests


@pytest.mark.slow
@pytest.mark.s3
def test_each_of_two_processes_sizes_its_own_blobs_and_the_save_restores(s3_store):
    """Two JAX processes, no coordination about sizes: each packs its own bytes into about
    blobs_per_save / 2 blobs, pieces stay at the floor, and both read the save back bit-exact."""
    from tests.multiprocess import run_processes

    options = {"blob_size": FLOOR, "max_blob_size": 64 * FLOOR, "blobs_per_save": 8, "barrier_timeout": 60}
    job = {
        "kind": "save",
        "restore_after": True,
        "url": s3_store.url,
        "storage_options": s3_store.storage_options,
        "mesh": [2, 4],
        "axes": ["data", "model"],
        "scale": 8,
        "options": options,
    }
    results = run_processes(2, job)
    assert all(r is not None for r in results), results
    assert all(r["restore"]["mismatches"] == [] for r in results), results

    manifest = full_manifest(from_url(s3_store.url, **s3_store.storage_options))
    pieces = [p for leaf in manifest.leaves for p in leaf.pieces]
    assert pieces and all(p.length <= FLOOR for p in pieces)
    for process in (0, 1):
        mine = [b for b in manifest.blobs if f"-p{process}-" in b.key]
        written = sum(p.length for p in pieces if f"-p{process}-" in p.blob)
        size = blob_size_for(written, processes=2, floor=FLOOR, ceiling=64 * FLOOR, blobs_per_save=8)
        assert size >= 8 * FLOOR  # the rule chose blobs well above the floor from this process's bytes
        assert max(b.size for b in mine) <= size + PACKING_SLACK
        assert len(mine) <= 4 + 2 < written // FLOOR  # about 8 / 2 blobs, where the floor makes dozens
