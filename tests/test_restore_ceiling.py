"""Restores at the raw-GET ceiling (issue 79, items 2 and 3): what a restore does per byte.

A compressed piece inside one box is decoded straight into its place in that box, with no
temporary arrays and no copy after (the extra copy and the temporaries' fresh pages made a
compressed restore slower than a plain one); pieces that several boxes share are still
decoded, then copied. Restores on the local S3 server are bit-exact either way. The speed
itself is a benchmark's (benchmarks/bench_compression.py), not a test's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_tree_bit_exact
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.core import codecs
from objckpt.restoring.landing import Landing

ZSTD = objckpt.Options(compression="zstd")


def _tree(mesh_axes=("x", "y")):
    rng = np.random.default_rng(0)
    mesh = jax.make_mesh((4, 2), mesh_axes)
    values = {
        "bf16": (rng.standard_normal((512, 256), dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16),
        "f32": rng.standard_normal((256, 64), dtype=np.float32) * np.float32(1e-4),
        "u8": rng.integers(0, 4, (128, 64), dtype=np.uint8),
    }
    return {k: jax.device_put(jnp.asarray(v), NamedSharding(mesh, P("x", "y"))) for k, v in values.items()}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64", "uint8", "bool", "int32"])
def test_decode_joins_the_planes_into_the_buffer_it_is_given(dtype):
    value = (np.arange(3000) * 7919 % 251).astype(np.float32).astype(np.dtype(dtype))
    raw = value.view(np.uint8)
    out = np.full(raw.shape, 0xAA, np.uint8)
    got = codecs.decode(codecs.encode(raw, value.itemsize), value.itemsize, raw.nbytes, "piece", out)
    assert np.shares_memory(got, out) and out.tobytes() == raw.tobytes()
    assert (
        codecs.decode(codecs.encode(raw, value.itemsize), value.itemsize, raw.nbytes, "piece").tobytes()
        == raw.tobytes()
    )


def test_a_compressed_restore_onto_the_saved_sharding_decodes_in_place_on_s3(s3_store, monkeypatch):
    tree = {**_tree(), "scale": jnp.asarray(1.5, jnp.float32)}  # a 0-d leaf: decoded into a view of its buffer
    url = f"{s3_store.url}/zstd"
    objckpt.save(url, tree, storage_options=s3_store.storage_options, options=ZSTD)
    copies = []
    real_copy = Landing.copy
    monkeypatch.setattr(Landing, "copy", lambda self, *a: copies.append(a[0]) or real_copy(self, *a))
    restored = objckpt.restore(url, jax.eval_shape(lambda: tree), storage_options=s3_store.storage_options)
    assert_tree_bit_exact(tree, restored)
    assert copies == []  # every piece lies inside one box: decoded where it belongs


def test_a_compressed_restore_onto_boxes_that_cut_the_pieces_copies_them_and_is_bit_exact_on_s3(s3_store):
    tree = _tree()
    url = f"{s3_store.url}/zstd"
    objckpt.save(url, tree, storage_options=s3_store.storage_options, options=ZSTD)
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    sharding = NamedSharding(mesh, P("b", "a"))
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in tree.items()}
    for reshard in (True, False):
        restored = objckpt.restore(
            url, target, storage_options=s3_store.storage_options, options=objckpt.Options(reshard=reshard)
        )
        assert_tree_bit_exact(tree, restored)
        assert all(r.sharding == sharding for r in restored.values())


def test_the_peers_bench_measures_a_workload_of_few_large_leaves():
    from benchmarks.rivals import workloads  # noqa: PLC0415 - the benchmark's, not the package's

    few = workloads.get("few")
    assert "few" in workloads.NAMES and few.nbytes == 1 << 30
    assert len(few.leaves) == 16 and all(leaf.shape == (4096, 4096) for leaf in few.leaves)
