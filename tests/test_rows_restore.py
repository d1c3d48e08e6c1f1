"""A version 3 restore plans from pieces held as columns, end to end through the local S3 server:
the leaves' pieces are LeafPieces, the reads' parts LazyParts, and every restore is bit-exact
(with digests, across spans of a long streamed read, onto a target that cuts the saved pieces);
a version 2 checkpoint still plans from tuples."""

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


@pytest.mark.parametrize(("version", "digest"), [(3, None), (3, "sha256"), (2, None)], ids=["v3", "v3-digest", "v2"])
def test_version_3_restores_plan_from_columns(s3_store, planned, version: int, digest: str | None) -> None:
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
    options = objckpt.Options(format_version=version, digest=digest, blob_size=64 << 10, read_chunk=16 << 10)
    objckpt.save(s3_store.url, state, options=options, storage_options=s3_store.storage_options)
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
    if version == 3:
        assert all(isinstance(leaf.pieces, LeafPieces) for leaf in array_leaves)
        assert all(isinstance(r.parts, LazyParts) for r in requests)
        assert any(len(r.parts) > 1 for r in requests)
    else:
        assert not any(isinstance(leaf.pieces, LeafPieces) for leaf in array_leaves)
        assert all(isinstance(r.parts, tuple) for r in requests)
