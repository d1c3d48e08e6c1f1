"""objckpt calls JAX's current spelling where the user's JAX has it, the older one elsewhere
(:mod:`objckpt.core.jax_compat`), so a newer JAX finds no deprecated call of objckpt's making."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import objckpt
from objckpt.core import jax_compat

OBJCKPT = str(Path(objckpt.__file__).parent)


def test_single_device_sharding_places_a_whole_array_on_that_device() -> None:
    device = jax.devices()[-1]
    sharding = jax_compat.single_device_sharding(device)
    assert sharding.device_set == {device}
    x = jax.device_put(np.arange(12.0).reshape(3, 4), sharding)
    assert x.sharding.device_set == {device}
    assert [s.device for s in x.addressable_shards] == [device]


def test_the_newer_call_is_taken_where_jax_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []

    def make(device: object) -> object:
        made.append(device)
        return "made"

    monkeypatch.setattr(jax.sharding, "make_single_device_sharding", make, raising=False)
    device = jax.devices()[0]
    assert jax_compat.single_device_sharding(device) == "made"
    assert made == [device]


def test_an_older_jax_gets_the_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(jax.sharding, "make_single_device_sharding", raising=False)
    device = jax.devices()[0]
    sharding = jax_compat.single_device_sharding(device)
    assert type(sharding) is jax.sharding.SingleDeviceSharding and sharding.device_set == {device}


_SAVE_AND_RESTORE = """
import json, sys, warnings
import jax, jax.numpy as jnp, numpy as np
import objckpt
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    url = sys.argv[1]
    objckpt.save(url, {"w": jnp.arange(64.0).reshape(8, 8), "b": np.ones(5, np.float32)})
    got = objckpt.restore(url, {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32), "b": jax.ShapeDtypeStruct((5,), np.float32)})
    assert float(np.asarray(got["w"]).sum()) == 2016.0 and float(np.asarray(got["b"]).sum()) == 5.0
print(json.dumps([
    f"{w.filename}:{w.lineno}: {w.message}" for w in caught
    if issubclass(w.category, DeprecationWarning) and w.filename.startswith(sys.argv[2])
]))
"""


def test_a_save_and_a_restore_onto_targets_without_a_sharding_warn_of_nothing_deprecated(tmp_path: Path) -> None:
    # In a fresh process: JAX warns of a deprecated name once per process, so an earlier test
    # (or another module on this worker) could have used the warning up.
    done = subprocess.run(
        [sys.executable, "-c", _SAVE_AND_RESTORE, (tmp_path / "ckpt").as_uri(), OBJCKPT],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(OBJCKPT).parent)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []
