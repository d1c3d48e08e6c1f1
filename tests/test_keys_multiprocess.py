"""Typed PRNG keys on a mesh that spans processes (2 real JAX processes x 2 CPU devices).

Every Flax NNX model's state holds such keys (``nnx.Rngs``): a multi-process job
resumes only if its keys, replicated or sharded over the processes, restore onto
the sharding they were saved with, onto abstract targets (``jax.ShapeDtypeStruct``
with a key dtype), onto another mesh and onto one process's own devices, bit for
bit. tests/keys_worker.py saves and restores; this file starts it on a local
directory (``file://``) and on the local S3.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from tests.multiprocess import run_processes

WORKER = Path(__file__).with_name("keys_worker.py")


def _restores_every_target(url, storage_options):
    stderr: list[str] = []
    job = {"kind": "keys", "url": url, "storage_options": storage_options}
    results = run_processes(2, job, devices_per_process=2, worker=WORKER, stderr=stderr)
    for p, r in enumerate(results):
        assert r is not None, f"process {p} failed: {stderr[p][-3000:]}"
        assert len(r) == 5, r
        for target, mismatches in r.items():
            assert mismatches == [], f"process {p}, target {target}: {mismatches}"


@pytest.mark.slow
def test_keys_across_processes_on_a_local_directory(tmp_path):
    _restores_every_target(f"file://{tmp_path}/ckpt", {})


@pytest.mark.slow
@pytest.mark.s3
def test_keys_across_processes_on_s3(s3_store):
    _restores_every_target(s3_store.url, s3_store.storage_options)


def test_a_key_target_of_another_shape_or_a_sharding_that_does_not_fit_is_refused(local_store):
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    keys = jax.random.split(jax.random.key(3, impl="rbg"), 6)
    objckpt.save(local_store.url, {"rng": keys})
    wrong = jax.ShapeDtypeStruct((4,), keys.dtype, sharding=NamedSharding(mesh, P()))
    with pytest.raises(objckpt.TargetMismatchError) as e:
        objckpt.restore(local_store.url, {"rng": wrong})
    assert "leaf ['rng']: target shape (4,) does not match the saved rbg keys' shape (6,)" in str(e.value)
    unfit = jax.ShapeDtypeStruct((6,), keys.dtype, sharding=NamedSharding(mesh, P("d")))  # 6 keys on 4 devices
    with pytest.raises(objckpt.TargetMismatchError) as e:
        objckpt.restore(local_store.url, {"rng": unfit})
    assert "leaf ['rng']: sharding" in str(e.value) and "does not fit the saved keys' shape (6,)" in str(e.value)
    fits = jax.ShapeDtypeStruct(
        (6,), keys.dtype, sharding=NamedSharding(Mesh(np.array(jax.devices()[:2]), ("d",)), P("d"))
    )
    out = objckpt.restore(local_store.url, {"rng": fits})["rng"]
    assert out.sharding == fits.sharding and str(jax.random.key_impl(out)) == str(jax.random.key_impl(keys))
    assert np.asarray(jax.random.key_data(out)).tobytes() == np.asarray(jax.random.key_data(keys)).tobytes()
