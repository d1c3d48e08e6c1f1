"""Every row of docs/ERRORS.md: the user's mistake, the error type, and what its message names."""

from __future__ import annotations

import copy
import logging
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.errors import BucketNotFoundError
from objckpt.storage import from_url, register_store
from objckpt.transfer import runtime

FAST = objckpt.Options(request_timeout=5, retry=objckpt.RetryConfig(deadline=4, max_backoff=0.5))
TREE = {"params": {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}, "step": 1, "name": "run"}


def test_no_such_checkpoint(any_store):
    with pytest.raises(objckpt.CheckpointNotFoundError, match="no committed checkpoint at") as info:
        objckpt.restore(any_store.url, storage_options=any_store.storage_options)
    assert any_store.url.split("://")[-1].split("/")[-1] in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


def test_wrong_bucket(gcs_service):
    url = "gs://no-such-bucket-objckpt/ckpt"
    with pytest.raises(FileNotFoundError, match="no-such-bucket-objckpt.*bucket"):
        objckpt.save(url, TREE, storage_options=gcs_service.storage_options(), options=FAST)
    with pytest.raises(BucketNotFoundError, match="bucket 'no-such-bucket-objckpt' does not exist"):
        objckpt.restore(url, storage_options=gcs_service.storage_options(), options=FAST)


def test_wrong_credentials(s3_service):
    options = dict(copy.deepcopy(s3_service.storage_options()), secret="not-the-secret")
    with pytest.raises(PermissionError) as info:
        objckpt.save(s3_service.url("wrong-creds"), TREE, storage_options=options, options=FAST)
    assert isinstance(info.value, objckpt.StoreError)
    assert "s3://" in str(info.value) and "not-the-secret" not in str(info.value)


def test_missing_credentials(s3_service, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    options = {k: v for k, v in copy.deepcopy(s3_service.storage_options()).items() if k not in ("key", "secret")}
    with pytest.raises(objckpt.StoreError, match="s3://"):
        objckpt.save(s3_service.url("no-creds"), TREE, storage_options=options, options=FAST)


def test_target_structure_mismatch(memory_store):
    objckpt.save(memory_store.url, TREE)
    with pytest.raises(
        objckpt.TargetMismatchError, match=r"\['name'\].*\['params'\]\['b'\]|\['params'\]\['b'\].*\['name'\]"
    ):
        objckpt.restore(memory_store.url, {"params": {"w": None}, "step": 0})


def test_target_shape_mismatch(memory_store):
    objckpt.save(memory_store.url, TREE)
    target = dict(TREE, params={"w": jax.ShapeDtypeStruct((4, 8), jnp.float32), "b": None})
    with pytest.raises(objckpt.TargetMismatchError, match=r"\['params'\]\['w'\].*\(4, 8\).*\(8, 4\)"):
        objckpt.restore(memory_store.url, target)


def test_target_dtype_is_a_cast_but_a_kind_mismatch_is_an_error(memory_store):
    objckpt.save(memory_store.url, TREE)
    target = dict(TREE, params={"w": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16), "b": None})
    assert objckpt.restore(memory_store.url, target)["params"]["w"].dtype == jnp.bfloat16
    target = dict(TREE, name=jax.ShapeDtypeStruct((3,), jnp.uint8))
    with pytest.raises(objckpt.TargetMismatchError, match=r"\['name'\].*str"):
        objckpt.restore(memory_store.url, target)


def test_sharding_that_does_not_fit(memory_store):
    objckpt.save(memory_store.url, TREE)
    bad = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))  # 4 elements over 8 devices
    target = dict(TREE, params={"w": None, "b": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=bad)})
    with pytest.raises(objckpt.TargetMismatchError, match=r"\['params'\]\['b'\].*does not fit"):
        objckpt.restore(memory_store.url, target)


def test_scheme_without_installed_store_names_the_package(monkeypatch):
    for module in ("s3fs", "obstore", "obstore.store"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(objckpt.StoreNotAvailableError, match="pip install s3fs"):
        from_url("s3://bucket/ckpt")
    with pytest.raises(objckpt.StoreNotAvailableError, match="'nosuch'.*register_store"):
        from_url("nosuch://bucket/ckpt")


def test_store_without_create_if_absent_is_refused():
    def factory(url, **options):  # a third-party store that cannot create-if-absent
        store = from_url(url.replace("nocreate://", "memory://"), **options)
        store.supports_create = False
        return store

    register_store("nocreate", factory)
    with pytest.raises(objckpt.StoreError, match="objckpt-tests/nocreate.*only-if-absent"):
        objckpt.save("nocreate://objckpt-tests/nocreate", TREE)
    assert runtime.run_sync(from_url("memory://objckpt-tests/nocreate").list()) == []  # nothing written


def test_unsupported_leaf_names_its_path(memory_store):
    with pytest.raises(TypeError, match=r"\['params'\]\['fn'\].*function"):
        objckpt.save(memory_store.url, {"params": {"fn": lambda x: x}})


def test_relative_path_is_refused():
    with pytest.raises(ValueError, match="relative/ckpt"):
        objckpt.save("relative/ckpt", TREE)


def test_credentials_never_appear_in_manifests_logs_errors_or_reprs(s3_service, caplog):
    """Save and fail with secret-bearing options, then grep everything written and logged."""
    options = s3_service.storage_options()
    secrets = [s3_service.secret_key, s3_service.access_key]
    url = s3_service.url("secret-check")
    caplog.set_level(logging.DEBUG, logger="objckpt")
    objckpt.save(url, TREE, storage_options=options)
    objckpt.restore(url, storage_options=options)
    texts = [caplog.text, repr(from_url(url, **options)), str(from_url(url, **options).url)]
    store = from_url(url, **options)
    for obj in runtime.run_sync(store.list()):
        texts.append(runtime.run_sync(store.get(obj.key)).decode("latin-1"))
    texts.append(str(objckpt.inspect(url, storage_options=options)))
    for failing in (
        lambda: objckpt.save(url, TREE, storage_options=options),
        lambda: objckpt.restore(url, {"x": None}, storage_options=options),
        lambda: objckpt.save(
            s3_service.url("bad"), TREE, storage_options=dict(options, secret=secrets[0] + "x"), options=FAST
        ),
    ):
        with pytest.raises(Exception) as info:
            failing()
        texts.append(str(info.value))
        texts.append(repr(info.value))
    blob = "\n".join(texts)
    for secret in secrets:
        assert secret not in blob


def test_every_documented_error_is_exported():
    """Each error class docs/ERRORS.md names, and each of objckpt.errors, is ``objckpt.<Name>``
    and in ``objckpt.__all__``: a user catches what the table promises without knowing our modules."""
    import builtins
    import inspect
    import pathlib
    import re

    import objckpt.errors

    text = (pathlib.Path(__file__).parent.parent / "docs" / "ERRORS.md").read_text()
    documented = {name for name in re.findall(r"`(?:objckpt\.)?([A-Z]\w*Error)`", text) if not hasattr(builtins, name)}
    defined = {
        name
        for name, cls in vars(objckpt.errors).items()
        if inspect.isclass(cls) and issubclass(cls, objckpt.ObjckptError)
    }
    assert documented <= defined, f"ERRORS.md names classes objckpt.errors lacks: {sorted(documented - defined)}"
    assert {"BucketNotFoundError", "PeerCopyUnavailableError", "ThrottledError"} <= documented
    for name in sorted(defined):
        assert getattr(objckpt, name) is getattr(objckpt.errors, name), name
    assert sorted(defined - set(objckpt.__all__)) == []


def test_credentials_that_lapse_as_botocore_refreshes_them_are_retried_not_fatal():
    """botocore's "refreshed credentials are still expired" (a refresh that met the source's rotation)
    is transient, so the engine retries it; other RuntimeErrors stay a plain StoreError."""
    from objckpt.errors import StoreError, TransientStoreError
    from objckpt.storage.errors import map_error

    lapsed = RuntimeError("Credentials were refreshed, but the refreshed credentials are still expired.")
    assert isinstance(map_error(lapsed, "put s3://b/k"), TransientStoreError)
    assert type(map_error(RuntimeError("something else"), "put s3://b/k")) is StoreError
