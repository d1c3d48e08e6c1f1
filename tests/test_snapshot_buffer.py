"""A local-tier manager copies each local save into the buffer of the one before, once that one is
written (Options.keep_snapshot_buffer): no fresh pages to fault in while training waits, and every
step still restores bit-exact from the local tier."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import objckpt
from objckpt.manager import tiers as tiers_module


def _tree(step: int) -> dict:
    return {"w": jnp.arange(4096.0) + step, "b": jnp.full((3, 5), step, jnp.int32)}


@pytest.fixture
def buffers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The address of each local save's buffer, in order."""
    seen: list[int] = []
    snapshot = tiers_module.snapshot

    def recorded(*args, **kwargs):
        snap = snapshot(*args, **kwargs)
        seen.append(snap.buffer.ctypes.data)
        return snap

    monkeypatch.setattr(tiers_module, "snapshot", recorded)
    return seen


@pytest.mark.parametrize("keep", [True, False])
def test_local_saves_reuse_the_last_ones_buffer_and_restore_exact(tmp_path, buffers, keep: bool) -> None:
    options = objckpt.Options(keep_snapshot_buffer=keep)
    local = objckpt.LocalCopies(tmp_path / "local", keep_last=3)
    kwargs = dict(local=local, save_rules=objckpt.SavePolicy(save_interval_steps=1000), options=options)
    mgr = objckpt.CheckpointManager(str(tmp_path / "root"), **kwargs)
    for step in (1, 2, 3):
        assert mgr.save(step, _tree(step))
        mgr.wait()
    mgr.close()
    assert len(buffers) == 3
    if keep:  # one buffer, filled again each time
        assert len(set(buffers)) == 1
    else:
        assert len(set(buffers)) >= 2
    restarted = objckpt.CheckpointManager(str(tmp_path / "root"), **kwargs)
    try:
        # each step's own bytes, though one buffer held all three in turn (newest first: a restore
        # retires the local steps above the one it restores)
        for step in (3, 2, 1):
            got = restarted.restore(step, _tree(0))
            assert restarted.tier_status().last_restore.tier == "local"
            for k, v in _tree(step).items():
                assert np.asarray(got[k]).tobytes() == np.asarray(v).tobytes(), (step, k)
    finally:
        restarted.close()


def test_a_buffer_too_small_or_none_is_not_used() -> None:
    from objckpt.saving.local_snapshot import snapshot

    args = dict(root="file:///r", step=1, save_id="s", process_index=0, process_count=1, metadata={})
    small = np.zeros(8, np.uint8)
    snap = snapshot(_tree(1), buffer=small, **args)
    assert snap.buffer.ctypes.data != small.ctypes.data and snap.buffer.size >= 4096 * 4
    big = np.zeros(1 << 20, np.uint8)
    assert snapshot(_tree(1), buffer=big, **args).buffer.ctypes.data == big.ctypes.data
