"""Bits flipped in flight are read again; only a mismatch that persists is corruption.

The fault proxy (backends/proxy.py, ``set_corruption``) flips one bit in a share
of GET response bodies while the stored bytes stay intact.
"""

from __future__ import annotations

import copy
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from backends.proxy import FaultProxy
from objckpt.core.format import MANIFEST_KEY
from objckpt.storage import from_url
from objckpt.transfer import runtime

pytestmark = pytest.mark.s3


@pytest.fixture
def proxied_s3(s3_service):
    """The S3 server behind a fault proxy: (proxy, storage options through it)."""
    host, port = s3_service.endpoint_url.rsplit("//", 1)[1].split(":")
    with FaultProxy(host, int(port), seed=7) as proxy:
        options = copy.deepcopy(s3_service.storage_options())
        options["client_kwargs"]["endpoint_url"] = proxy.endpoint_url
        yield proxy, options


def _tree(seed: int) -> dict:
    """One 4 MiB leaf, a whole box per device (restored as is onto its sharding, or copied to numpy)."""
    mesh = jax.make_mesh((8,), ("x",))
    w = jax.random.normal(jax.random.key(seed), (1024, 1024), dtype=jnp.float32)
    return {"w": jax.device_put(w, NamedSharding(mesh, P("x"))), "step": seed}


def _blob_keys(url: str, storage_options: dict) -> list[str]:
    store = from_url(url, **storage_options)
    return sorted(o.key for o in runtime.run_sync(store.list()) if o.key.endswith(".blob"))


def test_the_proxy_flips_one_bit_of_a_get_body_and_nothing_else(proxied_s3, s3_service):
    proxy, options = proxied_s3
    store = from_url(s3_service.url(f"flip-{uuid.uuid4().hex[:8]}"), **options)
    payload = bytes(range(256)) * 4096  # 1 MiB
    runtime.run_sync(store.put("probe.blob", payload))
    proxy.set_corruption(1.0, only=".blob", limit=1)
    got = runtime.run_sync(store.get_range("probe.blob", start=0, end=len(payload)))
    assert len(got) == len(payload)
    differ = [i for i in range(len(payload)) if got[i] != payload[i]]
    assert len(differ) == 1 and got[differ[0]] ^ payload[differ[0]] == 1
    assert runtime.run_sync(store.head("probe.blob")).size == len(payload)  # not a GET: untouched
    assert runtime.run_sync(store.get_range("probe.blob", start=0, end=len(payload))) == payload  # limit reached
    assert proxy.stats.corrupted == 1


def test_restores_with_thirty_percent_of_bodies_flipped_in_flight_are_bit_exact(proxied_s3, s3_service):
    """Six restores, alternately adopted whole boxes (read and landed) and copies to numpy
    (streamed and scattered): every mismatch is read again, and counted."""
    proxy, options = proxied_s3
    retried = 0
    for cycle in range(6):
        url = s3_service.url(f"flipped/{uuid.uuid4().hex[:8]}")
        tree = _tree(cycle)
        objckpt.save(url, tree, storage_options=options)
        proxy.set_corruption(0.3, only=".blob")
        stats = objckpt.TransferStats()
        target = tree if cycle % 2 == 0 else None
        out = objckpt.restore(url, target, storage_options=options, stats=stats)
        proxy.set_corruption(0.0)
        assert np.asarray(out["w"]).tobytes() == np.asarray(tree["w"]).tobytes(), f"cycle {cycle}"
        assert out["step"] == cycle
        retried += stats.checksum_retries
    assert proxy.stats.corrupted > 0
    assert 0 < retried <= proxy.stats.corrupted  # a flip in the few bytes read before a piece costs nothing


@pytest.mark.parametrize("adopted", [True, False])
def test_a_blob_corrupted_at_rest_still_fails_saying_it_persisted(adopted, s3_store):
    so = s3_store.storage_options
    tree = _tree(1)
    objckpt.save(s3_store.url, tree, storage_options=so)
    (key,) = _blob_keys(s3_store.url, so)
    store = s3_store.open()
    data = bytearray(runtime.run_sync(store.get(key)))
    data[len(data) // 2] ^= 0x10
    runtime.run_sync(store.put(key, bytes(data)))
    stats = objckpt.TransferStats()
    with pytest.raises(objckpt.IntegrityError) as info:
        objckpt.restore(s3_store.url, tree if adopted else None, storage_options=so, stats=stats)
    message = str(info.value)
    assert key in message and "['w']" in message and "persisted over 5 reads" in message, message
    assert isinstance(info.value, objckpt.ChecksumMismatchError)
    assert stats.checksum_retries == 4


def test_a_manifest_flipped_in_flight_once_is_read_again(proxied_s3, s3_service):
    proxy, options = proxied_s3
    url = s3_service.url(f"manifest-flip/{uuid.uuid4().hex[:8]}")
    tree = _tree(2)
    objckpt.save(url, tree, storage_options=options)
    proxy.set_corruption(1.0, only=MANIFEST_KEY, limit=1, position=0)  # "{" → "z": no JSON at all
    stats = objckpt.TransferStats()
    out = objckpt.restore(url, tree, storage_options=options, stats=stats)
    assert np.asarray(out["w"]).tobytes() == np.asarray(tree["w"]).tobytes()
    assert proxy.stats.corrupted == 1 and stats.checksum_retries == 1


def test_a_manifest_malformed_at_rest_is_still_a_format_error(s3_store):
    store = s3_store.open()
    runtime.run_sync(store.put(MANIFEST_KEY, b"z not json"))
    with pytest.raises(objckpt.FormatError, match="over 5 reads"):
        objckpt.restore(s3_store.url, storage_options=s3_store.storage_options)


def test_verify_reads_a_piece_flipped_in_flight_again_and_finds_nothing(proxied_s3, s3_service):
    proxy, options = proxied_s3
    url = s3_service.url(f"verify-flip/{uuid.uuid4().hex[:8]}")
    objckpt.save(url, _tree(3), storage_options=options)
    proxy.set_corruption(1.0, only=".blob", limit=1, position=1 << 20)  # the blob's first read, inside w
    report = objckpt.verify(url, storage_options=options)
    assert report.ok, report
    assert proxy.stats.corrupted == 1 and report.checksum_retries == 1


def test_a_copy_reads_a_blob_flipped_in_flight_again(proxied_s3, s3_service, tmp_path):
    proxy, options = proxied_s3
    url = s3_service.url(f"copy-flip/{uuid.uuid4().hex[:8]}")
    tree = _tree(4)
    objckpt.save(url, tree, storage_options=options)
    proxy.set_corruption(1.0, only=".blob", limit=1, position=1 << 20)
    destination = str(tmp_path / "copy")
    objckpt.copy(url, destination, src_storage_options=options)
    assert proxy.stats.corrupted == 1
    out = objckpt.restore(destination, tree)
    assert np.asarray(out["w"]).tobytes() == np.asarray(tree["w"]).tobytes()
