"""Shared fixtures: local S3/GCS servers and fresh store roots of every kind.

Any test that needs "somewhere to store a checkpoint" takes ``any_store``
(parametrized over memory, local disk, S3 on SeaweedFS and GCS on
fake-gcs-server) or one kind directly (``memory_store``, ``local_store``,
``s3_store``, ``gcs_store``). Each gives a :class:`StoreTarget` with a fresh,
unique ``.url`` and the ``.storage_options`` to pass along with it.

The servers start once per session, only when a test first needs them (under
pytest-xdist, once per worker: each worker is a session with servers on free ports).
Select kinds with markers: ``-m "not s3 and not gcs"`` runs without servers.
``-m quick`` is the inner-loop tier (``./tests/run.sh --quick``): see :data:`QUICK_MODULES`.

The real cloud path has kinds of its own: ``s3-https`` and ``gcs-https``
(the same servers behind a TLS front whose test CA the options trust),
``s3-imds`` (no keys anywhere: credentials from an emulated EC2 instance
metadata service) and ``gcs-metadata`` (tokens from an emulated GCE metadata
server, checked by a proxy that refuses any other bearer). ``cloud_env``
gives a test the bare environment of a fresh cloud VM.
"""

from __future__ import annotations

import ast
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
from backends import CredentialServer, GCSService, S3Service, TestCA, TlsFront  # noqa: E402
from backends.proxy import FaultProxy  # noqa: E402

STORE_KINDS = ("memory", "local", "s3", "gcs")
# The quick tier (``-m quick``): these modules' tests that need no server (pure planning, the
# format, the import graph) plus QUICK_TESTS, one end-to-end save/restore per store kind.
# tests/test_test_tiers.py checks that every name here still names a test.
QUICK_MODULES = frozenset(
    {
        "test_architecture.py",
        "test_errors.py",
        "test_format.py",
        "test_format_v1_compat.py",
        "test_hardening_format.py",
        "test_layouts_manifest_io.py",
        "test_plan.py",
        "test_registry.py",
        "test_tree.py",
    }
)
QUICK_TESTS = frozenset({"test_roundtrip.py::test_round_trip_every_dtype_and_sharding"})
# Modules with module-scoped fixtures cheap enough to set up in each worker (test_cli.py: an
# environment dict and one small save) and long enough to need spreading over the workers.
SPREAD_MODULES = frozenset({"test_cli.py"})
# Modules with the longest tests (minutes of multi-process and fault-injection cycles): under
# xdist they are handed out first, so that no worker starts one while the others run dry.
LONG_MODULES = frozenset(
    {
        "test_crash_safety.py",
        "test_docs.py",
        "test_faults.py",
        "test_matrix.py",
        "test_multihost.py",
        "test_resume_sigkill.py",
        "test_tiers_local.py",
    }
)
# Tests that hold the machine to a wall-clock bound of a second or two: ./tests/run.sh runs them
# (``-m serial``) after the others, one at a time, not beside busy xdist workers.
SERIAL_TESTS = frozenset(
    {
        "test_gcs_auth.py::test_every_refresh_request_has_a_timeout",
        "test_no_credentials.py::test_gcs_without_credentials_fails_at_once_listing_the_sources",
        "test_no_credentials.py::test_s3_without_credentials_fails_at_once_listing_the_sources",
        "test_proxy.py::test_each_round_trip_takes_the_latency",
        "test_s3_stream.py::test_a_read_given_up_hands_nothing_over_after_it_returns",
        "test_watchdog.py::test_a_stalled_cycle_fails_within_its_budget_naming_the_last_progress",
        "test_watchdog.py::test_slow_cycles_that_keep_progressing_outlast_the_budget_without_failing",
    }
)
# The example plugin is a separate package with its own tests, which need it installed:
# test_storage_conformance.py runs them in a pytest of their own, as the plugin's repository would.
collect_ignore = ["plugin_example"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "s3: needs the local S3 server (SeaweedFS)")
    config.addinivalue_line("markers", "gcs: needs the local GCS server (fake-gcs-server)")


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests by the servers they need, however they reach them; mark the quick and serial sets."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & {"s3_service", "s3_store", "s3_tls", "aws_metadata"}:
            item.add_marker(pytest.mark.s3)
        if names & {"gcs_service", "gcs_store", "gcs_tls", "gcs_bearer_proxy"}:
            item.add_marker(pytest.mark.gcs)
        if _is_quick(item):
            item.add_marker(pytest.mark.quick)
        if _test_name(item) in SERIAL_TESTS:
            item.add_marker(pytest.mark.serial)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects, and orders, alike
        items.sort(key=lambda item: item.path.name not in LONG_MODULES)


def _test_name(item: pytest.Item) -> str:
    """``module.py::function``, without the parameters."""
    return f"{item.path.name}::{getattr(item, 'originalname', item.name)}"


def _is_quick(item: pytest.Item) -> bool:
    if _test_name(item) in QUICK_TESTS:
        return True
    needs_server = item.get_closest_marker("s3") or item.get_closest_marker("gcs")
    return item.path.name in QUICK_MODULES and not needs_server


def modules_sharing_a_fixture() -> frozenset[str]:
    """The test modules that define a module-, class- or package-scoped fixture.

    Such a fixture (a server of its own, a child process, a saved checkpoint) is set up once
    in each worker that runs one of its tests. Read from the source, since the xdist
    controller schedules node ids before any worker has collected.
    """
    found = set()
    for path in Path(__file__).parent.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("pytest.fixture", "fixture"):
                scopes = [kw.value for kw in node.keywords if kw.arg == "scope"]
                if any(isinstance(v, ast.Constant) and v.value in ("module", "class", "package") for v in scopes):
                    found.add(path.name)
    return frozenset(found)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` as ./tests/run.sh asks for it: each test is its own unit of work,
    except that a module sharing a module-scoped fixture goes to one worker whole, so that the
    fixture is set up once, as in a serial run (but for SPREAD_MODULES). (pytest-xdist's own ``xdist_group`` marks no
    longer reach its scheduler under pytest 9.2: it rewrites a node id attribute pytest 9.2
    no longer reads.)"""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    grouped = modules_sharing_a_fixture() - SPREAD_MODULES

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if Path(path).name in grouped else nodeid

    return ModuleFixtureScheduling(config, log)


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


# ------------------------------------------------------------------ the real cloud path


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    """A test certificate authority; its ``ca_file`` is what clients are told to trust."""
    return TestCA.create(tmp_path_factory.mktemp("ca"))


def _host_port(endpoint_url: str) -> tuple[str, int]:
    host, port = endpoint_url.rsplit("/", 1)[1].rsplit(":", 1)
    return host, int(port)


@pytest.fixture(scope="session")
def s3_tls(s3_service: S3Service, test_ca: TestCA) -> Iterator[TlsFront]:
    """HTTPS in front of the S3 server, with a certificate from ``test_ca``."""
    with TlsFront(*_host_port(s3_service.endpoint_url), test_ca) as front:
        yield front


@pytest.fixture(scope="session")
def gcs_tls(gcs_service: GCSService, test_ca: TestCA) -> Iterator[TlsFront]:
    """HTTPS in front of the GCS emulator, with a certificate from ``test_ca``."""
    with TlsFront(*_host_port(gcs_service.endpoint_url), test_ca) as front:
        yield front


@pytest.fixture(scope="session")
def aws_metadata(s3_service: S3Service) -> Iterator[CredentialServer]:
    """Emulated AWS credential services (IMDSv2, container, STS) serving the S3 server's keys."""
    with CredentialServer(aws_keys=[(s3_service.access_key, s3_service.secret_key)]) as server:
        yield server


@pytest.fixture(scope="session")
def gce_metadata() -> Iterator[CredentialServer]:
    """An emulated GCE metadata server (and OAuth/STS endpoints) issuing Google access tokens."""
    with CredentialServer() as server:
        yield server


@pytest.fixture(scope="session")
def gcs_bearer_proxy(gcs_service: GCSService, gce_metadata: CredentialServer) -> Iterator[FaultProxy]:
    """The GCS emulator behind a proxy that refuses (401) every bearer ``gce_metadata`` did not issue."""
    with FaultProxy(*_host_port(gcs_service.endpoint_url)) as proxy:
        proxy.require_bearer(gce_metadata.valid_bearer)
        yield proxy


_CLOUD_PREFIXES = (
    "AWS_",
    "GOOGLE_",
    "GCE_",
    "CLOUDSDK_",
    "STORAGE_EMULATOR_HOST",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
)


@pytest.fixture
def cloud_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[..., dict[str, str]]:
    """``apply(**env)``: the environment of a fresh cloud VM, plus ``env``.

    No ``AWS_*``/Google/CA variables and an empty ``HOME`` (so no shared
    credential files), metadata services pointed at a closed port unless
    ``env`` names one. Returns the whole environment, for subprocesses.
    """
    for name in list(os.environ):
        if name.startswith(_CLOUD_PREFIXES):
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    closed = {
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:9",
        "GCE_METADATA_HOST": "127.0.0.1:9",
        "GCE_METADATA_IP": "127.0.0.1:9",
    }

    def apply(**env: str) -> dict[str, str]:
        for name, value in {**closed, **env}.items():
            monkeypatch.setenv(name, value)
        _point_google_auth_at(os.environ["GCE_METADATA_HOST"], monkeypatch)
        return dict(os.environ)

    return apply


def _point_google_auth_at(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """google-auth reads ``GCE_METADATA_HOST`` once, when its metadata module is imported."""
    from google.auth.compute_engine import _metadata

    monkeypatch.setattr(_metadata, "_GCE_METADATA_HOST", host)


def _s3_endpoint_options(s3: S3Service, endpoint_url: str) -> dict[str, Any]:
    """s3fs options that reach ``endpoint_url`` with no credentials in them."""
    return {
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": s3.region},
        "config_kwargs": {"s3": {"addressing_style": "path"}},
    }


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
        if kind == "s3-https":
            s3 = request.getfixturevalue("s3_service")
            front: TlsFront = request.getfixturevalue("s3_tls")
            ca: TestCA = request.getfixturevalue("test_ca")
            options = s3.storage_options()
            options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": front.endpoint_url}
            options["client_kwargs"]["verify"] = str(ca.ca_file)
            return StoreTarget(kind, s3.url(name), options, secrets=(s3.secret_key,))
        if kind == "gcs-https":
            gcs = request.getfixturevalue("gcs_service")
            front = request.getfixturevalue("gcs_tls")
            ca = request.getfixturevalue("test_ca")
            options = {**gcs.storage_options(), "endpoint_url": front.endpoint_url, "ca_bundle": str(ca.ca_file)}
            return StoreTarget(kind, gcs.url(name), options)
        if kind == "s3-imds":
            s3 = request.getfixturevalue("s3_service")
            imds: CredentialServer = request.getfixturevalue("aws_metadata")
            request.getfixturevalue("cloud_env")(**imds.imds_env())
            return StoreTarget(kind, s3.url(name), _s3_endpoint_options(s3, s3.endpoint_url), (s3.secret_key,))
        if kind == "gcs-metadata":
            gcs = request.getfixturevalue("gcs_service")
            gce: CredentialServer = request.getfixturevalue("gce_metadata")
            proxy: FaultProxy = request.getfixturevalue("gcs_bearer_proxy")
            request.getfixturevalue("cloud_env")(**gce.gce_env())
            return StoreTarget(kind, gcs.url(name), {"endpoint_url": proxy.endpoint_url, "token": "cloud"})
        raise ValueError(f"unknown store kind {kind!r}")

    return make


@pytest.fixture(scope="module")
def module_store_target_factory(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], StoreTarget]:
    """``store_target_factory`` for a module-scoped fixture (a checkpoint a module builds once and
    many of its tests read): the kinds that need no function-scoped fixture (memory, local, s3, gcs,
    s3-https, gcs-https)."""
    return store_target_factory.__wrapped__(request, tmp_path_factory)  # type: ignore[attr-defined]


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
