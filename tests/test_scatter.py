"""Streamed reads scattered into target boxes slab by slab (``objckpt.restoring.scatter``).

A memory store is wrapped to stream (:class:`restore_seams.StreamingStore`
hands a whole body over in the sink's pieces), with pieces far smaller than the
library's, so that slabs run along every axis and long reads split into spans
cut through pieces; restore's steps run on it through their seams
(:func:`restore_seams.restore_with`). The real S3 server's streaming is covered
in ``test_s3_stream.py``.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from helpers import assert_tree_bit_exact, full_manifest, random_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from restore_seams import StreamingStore, paths, restore_with

import objckpt
from objckpt.core.checksum import crc32c, crc32c_combine
from objckpt.core.plan import ReadPart, ReadRequest
from objckpt.errors import TransientStoreError
from objckpt.restoring.landing import Landing
from objckpt.restoring.leaf_plan import plan_leaf
from objckpt.restoring.scatter import iter_spans
from objckpt.storage import from_url
from objckpt.storage.streaming import STREAM_PIECE
from objckpt.transfer import runtime


def restored(store, target, **kwargs):
    """``target``'s leaves restored from ``store`` through restore's seams, keyed as in ``target``."""
    out = restore_with(store, paths(target), **kwargs)
    return {k: out[f"['{k}']"] for k in target}


def _tree():
    mesh = jax.make_mesh((4, 2), ("x", "y"))

    def put(value, spec):
        return jax.device_put(value, NamedSharding(mesh, spec))

    return {
        "cube": put(random_array((16, 12, 40), np.float32, 1), P("x", "y", None)),  # rows of 160 B: slabs of rows
        "wide": put(random_array((8, 1000), np.float32, 2), P("x", "y")),  # rows of 2000 B: slabs along axis 1
        "bytes": put(random_array((64, 96), np.int8, 3), P("x", "y")),
        "vector": put(random_array((4096,), np.float32, 4), P(None)),
        "scalar": put(np.float32(7.5), P()),
        "half": put(random_array((32, 64), jax.numpy.bfloat16, 5), P("y", "x")),
    }


def _resharded_target(tree):
    other = jax.make_mesh((2, 4), ("a", "b"))
    specs = {"cube": P(None, "a", "b"), "wide": P("b", "a"), "bytes": P("b", "a"), "vector": P("b")}
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other, specs.get(k, P())))
        for k, v in tree.items()
    }


@pytest.mark.parametrize("read_chunk", [32 << 20, 3000])  # one GET per read; long reads cut into spans
def test_streamed_reads_land_bit_exact_on_another_sharding(memory_store, read_chunk):
    tree = _tree()
    objckpt.save(memory_store.url, tree)
    target = _resharded_target(tree)
    store = StreamingStore(from_url(memory_store.url))
    out = restored(store, target, options=objckpt.Options(read_chunk=read_chunk))
    assert_tree_bit_exact(tree, out)
    for k in tree:
        assert out[k].sharding == target[k].sharding
    streaming = store.calls
    assert streaming, "no read was streamed"
    if read_chunk == 3000:
        manifest = full_manifest(from_url(memory_store.url))
        pieces = {(p.blob, p.offset): p.length for leaf in manifest.leaves for p in leaf.pieces}
        assert pieces, "the manifest read lists no pieces"
        blobs = {b.key for b in manifest.blobs}
        cut = [(k, s, e) for k, s, e in streaming if k in blobs and ((k, s) not in pieces or pieces[(k, s)] != e - s)]
        assert cut, "no piece was read as several spans"


def _corrupt(url, path, k, at):
    """Flip a bit of the ``k``-th saved piece of leaf ``path``, ``at(piece)`` bytes into it; the piece."""
    store = from_url(url)
    manifest = full_manifest(store)
    (entry,) = [leaf for leaf in manifest.leaves if leaf.path == path]
    piece = entry.pieces[k]
    data = bytearray(runtime.run_sync(store.get(piece.blob)))
    data[piece.offset + at(piece)] ^= 0x10
    runtime.run_sync(store.put(piece.blob, bytes(data)))
    return piece


def test_a_corrupt_byte_in_a_streamed_piece_is_named(memory_store):
    tree = _tree()
    objckpt.save(memory_store.url, tree)
    # A byte in the last slab: the piece is checked once every slab is in.
    piece = _corrupt(memory_store.url, "['wide']", 0, lambda p: p.length - 3)
    for chunk in (32 << 20, 3000):  # checked whole, and combined from spans
        store = StreamingStore(from_url(memory_store.url))
        with pytest.raises(objckpt.IntegrityError, match=r"\['wide'\].*" + piece.blob):
            restored(store, _resharded_target(tree), options=objckpt.Options(read_chunk=chunk))


def test_a_stream_cut_short_is_retried_from_the_start(memory_store):
    """A retry starts the sink over: the checksum it had begun in the failed attempt
    is forgotten (kept, it would not match the piece's)."""
    tree = _tree()
    objckpt.save(memory_store.url, tree)
    failed: list[str] = []

    async def cut_once(store, key, start, end, sink):
        if end - start > 2048 and not failed:
            failed.append(key)
            body = await store.get_range_buffer(key, start=start, end=end)
            sink.begin()
            first = sink.next_size(0, 1024)
            sink.receive(0, body[:first])  # a first slab, then the connection drops
            raise TransientStoreError("connection reset mid-body")

    stats = objckpt.TransferStats()
    out = restored(StreamingStore(from_url(memory_store.url), before=cut_once), _resharded_target(tree), stats=stats)
    assert failed and stats.retries >= 1
    assert_tree_bit_exact(tree, out)


def _small_leaves():
    """Leaves of a few KiB, packed many to a blob with alignment gaps between them."""
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    return {
        f"w{i:02d}": jax.device_put(
            random_array((8 + 4 * (i % 3), 36), np.float32, 20 + i), NamedSharding(mesh, P("x", "y"))
        )
        for i in range(24)
    }


def _small_target(tree):
    other = jax.make_mesh((2, 4), ("a", "b"))
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other, P("a", "b"))) for k, v in tree.items()
    }


def test_small_pieces_are_received_many_at_a_time(memory_store):
    """With the library's piece size, one receive carries many whole pieces and the gaps
    between them; each is still checked and scattered on its own."""
    sizes: list[int] = []

    async def recording(store, key, start, end, sink):  # what each receive is handed
        real = sink.receive
        sink.receive = lambda offset, data: sizes.append(len(data)) or real(offset, data)

    tree = _small_leaves()
    objckpt.save(memory_store.url, tree)
    manifest = full_manifest(from_url(memory_store.url))
    pieces = [p for leaf in manifest.leaves for p in leaf.pieces]
    store = StreamingStore(from_url(memory_store.url), piece=STREAM_PIECE, before=recording)
    out = restored(store, _small_target(tree))
    assert_tree_bit_exact(tree, out)
    assert len(sizes) < len(pieces) // 4, "small pieces were received one by one"
    assert max(sizes) > 8 * max(p.length for p in pieces)


def test_a_corrupt_byte_among_many_pieces_received_at_once_is_named(memory_store):
    tree = _small_leaves()
    objckpt.save(memory_store.url, tree)
    piece = _corrupt(memory_store.url, "['w13']", 1, lambda p: 5)
    store = StreamingStore(from_url(memory_store.url), piece=STREAM_PIECE)
    with pytest.raises(objckpt.IntegrityError, match=r"\['w13'\].*" + piece.blob):
        restored(store, _small_target(tree))


def test_spans_are_cut_between_rows_of_a_piece(memory_store):
    tree = {"w": jax.device_put(random_array((100, 300), np.float32, 9))}  # rows of 1200 bytes
    objckpt.save(memory_store.url, tree)
    manifest = full_manifest(from_url(memory_store.url))
    (piece,) = manifest.leaves[0].pieces
    request = ReadRequest(piece.blob, piece.offset, piece.offset + piece.length, (ReadPart(0, piece, 0),))
    target = {"w": jax.ShapeDtypeStruct((100, 300), np.float32, sharding=tree["w"].sharding)}
    plans = {0: plan_leaf(manifest.leaves[0], target["w"])}
    spans = list(iter_spans(request, plans, 10_000))
    assert spans[0][0] == 0 and spans[-1][1] == piece.length
    assert all(a == b for (_, a), (b, _) in zip(spans, spans[1:]))  # contiguous
    assert all(first % 1200 == 0 for first, _ in spans)  # each starts on a row
    assert (
        len(spans) == 12 and max(last - first for first, last in spans) <= 10_000 + 1200
    )  # cuts move back a row at most


@pytest.mark.parametrize(("a", "b"), [(0, 0), (1, 0), (0, 1), (5, 7), (4096, 3), (3, 1 << 20), (777, 12345)])
def test_crc32c_combine_matches_the_whole(a, b):
    first, second = os.urandom(a), os.urandom(b)
    assert crc32c_combine(crc32c(first), crc32c(second), b) == crc32c(first + second)


def test_runs_of_whole_pieces_hold_the_copy_lock_and_slabs_do_not(memory_store):
    """Receives that start with a whole piece copy under the restore's shared copy lock
    (numpy's per-copy GIL release makes threads copying small pieces at once trade the
    GIL on every copy); slabs of a piece that spans several receives go without it."""
    held: list[tuple[bool, bool]] = []  # (a copy of a whole piece, lock held)

    class Recording(Landing):
        def copy(self, i, overlaps, source, origin):
            pieces = {p.start: p.shape for p in self.plans[i].entry.pieces}
            held.append((pieces.get(origin) == source.shape, self.copy_lock.locked()))
            super().copy(i, overlaps, source, origin)

    tree = _tree()
    objckpt.save(memory_store.url, tree)
    out = restored(StreamingStore(from_url(memory_store.url)), _resharded_target(tree), landing=Recording)
    assert_tree_bit_exact(tree, out)
    assert {whole for whole, _ in held} == {True, False}, "expected both whole pieces and slabs"
    assert all(locked == whole for whole, locked in held)
