"""CheckpointManager's settings grouped by concern, and the keywords it took before (issue 78 item 4).

The old keywords still work for one release: each warns, naming its new place, and does what
it did. Mixing one with its group is refused; a keyword that never was one is a TypeError.
"""

from __future__ import annotations

import inspect
import warnings

import jax.numpy as jnp
import pytest

import objckpt


def _state(step):
    return {"w": jnp.full((8, 4), step, jnp.float32), "step": step}


def _manager(url, **kwargs):
    """A manager made with ``kwargs``, and the messages of the DeprecationWarnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = objckpt.CheckpointManager(url, **kwargs)
    return mgr, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def test_at_most_twelve_parameters_grouped_by_concern():
    params = inspect.signature(objckpt.CheckpointManager).parameters
    assert len(params) <= 12, list(params)
    assert {"save_rules", "retention", "local", "replicas"} <= set(params)


def test_old_save_rule_keywords_warn_and_still_choose_the_steps(s3_store):
    mgr, warned = _manager(s3_store.url, storage_options=s3_store.storage_options, save_interval_steps=3, final_step=4)
    assert warned == [
        "save_interval_steps= is deprecated: use save_rules=objckpt.SavePolicy(save_interval_steps=...)",
        "final_step= is deprecated: use save_rules=objckpt.SavePolicy(final_step=...)",
    ]
    with mgr:
        for step in range(5):
            mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.steps() == [0, 3, 4]
        assert mgr.save_policy == objckpt.SavePolicy(save_interval_steps=3, final_step=4)


def test_old_retention_keywords_warn_and_still_delete(s3_store):
    mgr, warned = _manager(s3_store.url, storage_options=s3_store.storage_options, keep_last=2, gc_grace_seconds=5)
    assert warned == [
        "keep_last= is deprecated: use retention=objckpt.Retention(keep_last=...)",
        "gc_grace_seconds= is deprecated: use retention=objckpt.Retention(gc_grace_seconds=...)",
    ]
    with mgr:
        for step in range(4):
            mgr.save(step, _state(step), wait=True)
        assert mgr.steps() == [2, 3]
        assert mgr.retention.gc_grace_seconds == 5 and mgr.policies == [objckpt.KeepLast(2)]


def test_old_local_keywords_warn_and_still_set_the_local_copies(s3_store, tmp_path):
    local = str(tmp_path / "local")
    mgr, warned = _manager(
        s3_store.url, storage_options=s3_store.storage_options, local=local, local_keep_last=1, local_interval_steps=2
    )
    assert warned == [
        "local_keep_last= is deprecated: use local=objckpt.LocalCopies(keep_last=...)",
        "local_interval_steps= is deprecated: use local=objckpt.LocalCopies(interval_steps=...)",
    ]
    with mgr:
        for step in range(5):
            mgr.save(step, _state(step), force=step == 0)
        mgr.wait()
        assert mgr.tier_status().local_steps == [4]  # every 2nd step saved locally, the newest one kept


def test_old_replication_timeout_warns_and_still_applies(s3_store, store_target_factory):
    replica = store_target_factory("s3")
    mgr, warned = _manager(
        s3_store.url, storage_options=s3_store.storage_options, replicas=[replica.url], replication_timeout=42.0
    )
    assert warned == ["replication_timeout= is deprecated: use replicas=objckpt.Replication(timeout=...)"]
    with mgr:
        assert mgr._replication_timeout == 42.0 and [r.url for r in mgr.replicas] == [replica.url]
        mgr.save(1, _state(1), wait=True)
    with objckpt.CheckpointManager(replica.url, storage_options=replica.storage_options) as copy:
        assert copy.steps() == [1]


def test_new_spelling_warns_nothing_and_bare_values_still_work(s3_store, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr = objckpt.CheckpointManager(
            s3_store.url,
            storage_options=s3_store.storage_options,
            save_rules=objckpt.SavePolicy(save_on_steps=[2]),
            retention=objckpt.Retention(keep_last=1),
            local=str(tmp_path / "local"),
            replicas=[],
        )
    with mgr:
        for step in range(3):
            mgr.save(step, _state(step), wait=True)
        assert mgr.steps() == [2]
        assert mgr.tier_status().local_steps == [1, 2]


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"retention": objckpt.Retention(keep_last=1), "keep_last": 2}, ("keep_last=", "retention=")),
        ({"save_rules": objckpt.SavePolicy(), "continuous": True}, ("continuous=", "save_rules=")),
        ({"local": objckpt.LocalCopies("/tmp/never"), "peers": 0}, ("peers=", "local=")),
        ({"replicas": objckpt.Replication(), "replication_timeout": 1}, ("replication_timeout=", "replicas=")),
    ],
)
def test_an_old_keyword_beside_its_group_is_refused(memory_store, kwargs, names):
    with pytest.raises(ValueError, match="CheckpointManager") as caught:
        objckpt.CheckpointManager(memory_store.url, **kwargs)
    assert all(name in str(caught.value) for name in names)


def test_an_unknown_keyword_is_a_type_error_naming_it(memory_store):
    with pytest.raises(TypeError, match="'keep_lats'"):
        objckpt.CheckpointManager(memory_store.url, keep_lats=2)
    with pytest.raises(TypeError, match="retention=.*Retention"):
        objckpt.CheckpointManager(memory_store.url, retention={"keep_last": 2})


def test_settings_are_checked_where_they_are_written():
    with pytest.raises(ValueError, match="keep_every must be positive"):
        objckpt.Retention(keep_every=0)
    with pytest.raises(ValueError, match="keep_best needs best_metric"):
        objckpt.Retention(keep_best=1)
    with pytest.raises(ValueError, match="interval_steps and keep_last must be at least 1"):
        objckpt.LocalCopies("/tmp/x", keep_last=0)
    with pytest.raises(ValueError, match="peers must be 0 or 1"):
        objckpt.LocalCopies("/tmp/x", peers=2)
