"""Every restore plans from pieces held as columns (one planner for every format version), end to
end through the local S3 server: the leaves' pieces are LeafPieces, the reads' parts LazyParts,
and every restore is bit-exact (with digests, across spans of a long streamed read, onto a target
that cuts the saved pieces), whether version 3 frames, version 2 index objects or a version 1
manifest listed the pieces."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.core.format.rows import LeafPieces
from objckpt.core.plan_rows import LazyParts
from objckpt.restoring import api
from objckpt.storage import from_url
from tests.helpers import rewrite_as_v1

pytestmark = pytest.mark.s3


def _mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, ("a", "b"), devices=jax.devices()[:8])


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, list]]:
    """Each restore's (manifest, reads), as restore planned them."""
    seen: list[tuple[object, list]] = []
    plan = api.plan

    def recording(manifest, plans, options, *, streamed):
        requests = plan(manifest, plans, options, streamed=streamed)
        seen.append((manifest, requests))
        return requests

    monkeypatch.setattr(api, "plan", recording)
    return seen


@pytest.mark.parametrize(
    ("version", "digest"), [(3, None), (3, "sha256"), (2, None), (1, None)], ids=["v3", "v3-digest", "v2", "v1"]
)
def test_every_version_restores_plan_from_columns(s3_store, planned, version: int, digest: str | None) -> None:
    rng = np.random.default_rng(0)
    hosts = {
        "w": rng.standard_normal((256, 64), dtype=np.float32),
        "v": rng.standard_normal((64, 512), dtype=np.float32),
        "n": rng.standard_normal((64,), dtype=np.float32),
    }
    saved = _mesh((4, 2))
    state = {
        "w": jax.device_put(hosts["w"], NamedSharding(saved, P("a", "b"))),
        "v": jax.device_put(hosts["v"], NamedSharding(saved, P("b", "a"))),
        "n": jax.device_put(hosts["n"], NamedSharding(saved, P())),
    }
    # Small blobs and read chunks: many pieces per read, and reads streamed in several spans.
    options = objckpt.Options(format_version=max(version, 2), digest=digest, blob_size=64 << 10, read_chunk=16 << 10)
    objckpt.save(s3_store.url, state, options=options, storage_options=s3_store.storage_options)
    if version == 1:  # the same blobs, every piece listed in the root manifest
        rewrite_as_v1(from_url(s3_store.url, **s3_store.storage_options))
    other = _mesh((2, 4))
    targets = {
        "w": NamedSharding(other, P("b", "a")),  # cuts every saved piece
        "v": NamedSharding(other, P(None, "b")),
        "n": NamedSharding(other, P("a")),
    }
    target = {k: jax.ShapeDtypeStruct(hosts[k].shape, hosts[k].dtype, sharding=s) for k, s in targets.items()}
    out = objckpt.restore(s3_store.url, target, options=options, storage_options=s3_store.storage_options)
    for k, host in hosts.items():
        assert out[k].sharding == targets[k]
        assert np.asarray(out[k]).tobytes() == host.tobytes(), k
    (manifest, requests), *_ = planned
    array_leaves = [leaf for leaf in manifest.leaves if leaf.pieces]
    assert len(array_leaves) == 3 and requests
    assert manifest.version == version
    assert all(isinstance(leaf.pieces, LeafPieces) for leaf in array_leaves)
    assert len({id(leaf.pieces.rows) for leaf in array_leaves}) == 1  # rows of one Rows
    assert all(isinstance(r.parts, LazyParts) for r in requests)
    assert any(len(r.parts) > 1 for r in requests)


def test_a_restore_reads_leaf_after_leaf_whatever_the_blob_keys(s3_store, planned) -> None:
    """A blob's key starts with a hash, and an index lists its blobs by key; a restore still
    reads leaf after leaf, as the save packed them, so a leaf spread over several blobs is read
    in one stretch and its host buffer lives only that long (read in key order, an 8 GiB
    restore onto a TPU held every multi-blob leaf's buffer at once)."""
    tree = {f"w{i:02d}": np.full((3 << 16,), i, np.float32) for i in range(12)}  # 768 KiB each
    options = objckpt.Options(blob_size=256 << 10)  # every leaf in 3 blobs: 36 blobs
    objckpt.save(s3_store.url, tree, options=options, storage_options=s3_store.storage_options)
    out = objckpt.restore(s3_store.url, options=options, storage_options=s3_store.storage_options)
    for k, v in tree.items():
        assert np.asarray(out[k]).tobytes() == v.tobytes(), k
    (_, requests), *_ = planned
    firsts = [min(part.leaf for part in r.parts) for r in requests]
    assert len(requests) >= 12 and firsts == sorted(firsts), firsts
    keys = [r.blob for r in requests]
    assert keys != sorted(keys)  # the keys' own order is another one: the check above is not vacuous
