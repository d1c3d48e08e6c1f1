"""One host stage on save (issue 78 item 2): a manager step due for both the local tier and the
store copies each box off the devices once (tests/test_device_reads.py counts the copies); here,
what the shared stage must not break: the store save stages its blobs from the local snapshot's
buffer before ``save`` returns, so the next local save may reuse that buffer at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_bit_exact
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.manager import tiers as tiers_module

KiB = 1 << 10


def _state(value: float) -> dict[str, jax.Array]:
    sharding = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))
    return {f"w{i}": jax.device_put(jnp.full((256, 256), value + i, jnp.float32), sharding) for i in range(8)}


def test_a_store_save_reading_the_local_snapshot_keeps_its_bytes_when_the_next_local_save_runs(
    s3_store: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 2 saves to both from one snapshot, whose bytes (objckpt's own) its store save sends in
    place, slowly (each PUT of a step 2 blob held 2 s); step 3 saves locally only, at once. Step 3's
    snapshot does not reuse the buffer step 2's uploads still send from, and the store's step 2
    holds step 2's values, not step 3's."""
    from objckpt.transfer.engine import TransferEngine

    put = TransferEngine.put

    async def slow(self: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        if "step_0000000002/" in f"{self.store.url}/{key}" and key.endswith(".blob"):
            await asyncio.sleep(2.0)
        return await put(self, key, *args, **kwargs)

    monkeypatch.setattr(TransferEngine, "put", slow)
    reused: list[bool] = []
    original = tiers_module.snapshot

    def watched(tree: Any, **kwargs: Any) -> Any:
        reused.append(kwargs.get("buffer") is not None)
        return original(tree, **kwargs)

    monkeypatch.setattr(tiers_module, "snapshot", watched)
    options = objckpt.Options(blob_size=16 * KiB, max_blob_size=16 * KiB)
    two, three = _state(2.0), _state(3.0)
    with objckpt.CheckpointManager(
        s3_store.url,
        storage_options=s3_store.storage_options,
        options=options,
        save_rules=objckpt.SavePolicy(save_on_steps=[2]),
        local=objckpt.LocalCopies(str(tmp_path / "local")),
    ) as mgr:
        mgr.save(2, two)
        mgr.save(3, three)
        mgr.wait()
        assert mgr.tier_status().local_steps == [2, 3]
    restored = objckpt.restore(f"{s3_store.url}/step_0000000002", two, storage_options=s3_store.storage_options)
    assert_tree_bit_exact(restored, two)
    assert reused == [False, False], "step 3's snapshot made its own buffer while step 2's uploads ran"
    with objckpt.CheckpointManager(
        s3_store.url, storage_options=s3_store.storage_options, local=objckpt.LocalCopies(str(tmp_path / "local"))
    ) as mgr:
        assert_tree_bit_exact(mgr.restore(3, three), three)
        assert mgr.tier_status().last_restore.tier == "local"
