"""Shared fixtures: local S3/GCS servers and fresh store roots of every kind.

Any test that needs "somewhere to store a checkpoint" takes ``any_store``
(parametrized over memory, local disk, S3 on SeaweedFS and GCS on
fake-gcs-server) or one kind directly (``memory_store``, ``local_store``,
``s3_store``, ``gcs_store``). Each gives a :class:`StoreTarget` with a fresh,
unique ``.url`` and the ``.storage_options`` to pass along with it.

The servers start once per session, only when a test first needs them.
Select kinds with markers: ``-m "not s3 and not gcs"`` runs without servers.
"""

from __future__ import annotations

import os

# 8 CPU devices for sharding tests; must be set before JAX is first imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Tests that leave out credentials must never make a client probe a cloud metadata server
# (169.254.169.254 is off limits here): point every SDK's metadata endpoint at a closed loopback port.
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")
os.environ.setdefault("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9")
os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:9")
os.environ.setdefault("GCE_METADATA_IP", "127.0.0.1:9")

import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `backends` lives at the repo root, not in the package
    sys.path.insert(0, str(REPO_ROOT))

import backends  # noqa: E402  (also sets GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false before gcsfs loads)
from backends import GCSService, S3Service  # noqa: E402

STORE_KINDS = ("memory", "local", "s3", "gcs")
# The example plugin is a separate package with its own tests, which need it installed:
# test_storage_conformance.py runs them in a pytest of their own, as the plugin's repository would.
collect_ignore = ["plugin_example"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "s3: needs the local S3 server (SeaweedFS)")
    config.addinivalue_line("markers", "gcs: needs the local GCS server (fake-gcs-server)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests by the servers they need, however they reach them."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & {"s3_service", "s3_store"}:
            item.add_marker(pytest.mark.s3)
        if names & {"gcs_service", "gcs_store"}:
            item.add_marker(pytest.mark.gcs)


@dataclass(frozen=True)
class StoreTarget:
    """A fresh store root: what to pass to ``from_url`` / ``objckpt.save``.

    ``secrets`` lists credential strings that must never appear in a URL,
    ``repr`` or error message.
    """

    kind: str
    url: str
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    secrets: tuple[str, ...] = field(default=(), repr=False)

    def open(self, **extra: Any) -> Any:
        """``from_url(self.url, **self.storage_options, **extra)``."""
        from objckpt.storage import from_url

        return from_url(self.url, **{**self.storage_options, **extra})


def _unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(autouse=True)
def _fresh_throttle_memory() -> Iterator[None]:
    """Every test starts with full windows: what one test's throttled bucket taught the
    process (objckpt.transfer.throttle.MEMORY) must not slow the next test on the same bucket."""
    from objckpt.transfer import throttle

    throttle.MEMORY.clear()
    yield
    throttle.MEMORY.clear()


@pytest.fixture(scope="session")
def s3_service() -> Iterator[S3Service]:
    """SeaweedFS with an S3 gateway, for the whole session."""
    service = backends.start_s3()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="session")
def gcs_service() -> Iterator[GCSService]:
    """fake-gcs-server, for the whole session."""
    service = backends.start_gcs()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture
def store_target_factory(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], StoreTarget]:
    """``factory(kind)`` → a fresh, empty :class:`StoreTarget` of that kind."""

    def make(kind: str) -> StoreTarget:
        name = _unique()
        if kind == "memory":
            return StoreTarget("memory", f"memory://objckpt-tests/{name}")
        if kind == "local":
            return StoreTarget("local", str(tmp_path_factory.mktemp("store") / name))
        if kind == "s3":
            s3: S3Service = request.getfixturevalue("s3_service")
            return StoreTarget("s3", s3.url(name), s3.storage_options(), secrets=(s3.secret_key,))
        if kind == "gcs":
            gcs: GCSService = request.getfixturevalue("gcs_service")
            return StoreTarget("gcs", gcs.url(name), gcs.storage_options())
        raise ValueError(f"unknown store kind {kind!r}")

    return make


def _kind_params(kinds: tuple[str, ...]) -> list[Any]:
    marks = {"s3": pytest.mark.s3, "gcs": pytest.mark.gcs}
    return [pytest.param(k, id=k, marks=[marks[k]] if k in marks else []) for k in kinds]


@pytest.fixture(params=_kind_params(STORE_KINDS))
def any_store(request: pytest.FixtureRequest, store_target_factory: Callable[[str], StoreTarget]) -> StoreTarget:
    """A fresh store root of each kind in turn: memory, local, s3, gcs."""
    return store_target_factory(request.param)


@pytest.fixture
def memory_store(store_target_factory: Callable[[str], StoreTarget]) -> StoreTarget:
    return store_target_factory("memory")


@pytest.fixture
def local_store(store_target_factory: Callable[[str], StoreTarget]) -> StoreTarget:
    return store_target_factory("local")


@pytest.fixture
def s3_store(store_target_factory: Callable[[str], StoreTarget]) -> StoreTarget:
    return store_target_factory("s3")


@pytest.fixture
def gcs_store(store_target_factory: Callable[[str], StoreTarget]) -> StoreTarget:
    return store_target_factory("gcs")
