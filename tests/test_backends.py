"""The local storage servers: they start, answer, and never outlive their parent."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import backends
from backends import GCSService, S3Service, ServerStartError
from backends._process import pick_ports

REPO_ROOT = Path(__file__).resolve().parents[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # an HTTP error is still an answer
    except OSError:
        return False


def _port_open(url: str) -> bool:
    host, port = url.rsplit("/", 1)[-1].split(":")
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, int(port))) == 0


def _gone(pid: int) -> bool:
    """Dead, or a zombie nobody has reaped yet (it holds no ports then)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


# ---------------------------------------------------------------- services


@pytest.mark.s3
def test_s3_service(s3_service: S3Service) -> None:
    import s3fs

    assert s3_service.endpoint_url.startswith("http://127.0.0.1:")
    assert s3_service.url("a/b") == f"s3://{s3_service.bucket}/a/b"
    assert s3_service.env()["AWS_ENDPOINT_URL"] == s3_service.endpoint_url
    assert s3_service.secret_key not in repr(s3_service)
    fs = s3fs.S3FileSystem(**s3_service.storage_options(), skip_instance_cache=True)
    fs.pipe_file(f"{s3_service.bucket}/backend-test", b"hello")
    assert fs.cat_file(f"{s3_service.bucket}/backend-test") == b"hello"
    s3_service.make_bucket("second-bucket")
    s3_service.make_bucket("second-bucket")  # idempotent
    fs.pipe_file("second-bucket/k", b"other bucket")
    assert fs.cat_file("second-bucket/k") == b"other bucket"
    identities = Path(s3_service.data_dir or "") / "identities.json"
    assert stat.S_IMODE(identities.stat().st_mode) == 0o600


@pytest.mark.gcs
def test_gcs_service(gcs_service: GCSService) -> None:
    import gcsfs.core

    assert gcs_service.url("a") == f"gs://{gcs_service.bucket}/a"
    assert gcs_service.env()["STORAGE_EMULATOR_HOST"] == gcs_service.endpoint_url
    assert os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT") == "false"
    fs = gcsfs.core.GCSFileSystem(**gcs_service.storage_options(), skip_instance_cache=True)
    fs.pipe_file(f"{gcs_service.bucket}/backend-test", b"hello")
    assert fs.cat_file(f"{gcs_service.bucket}/backend-test") == b"hello"
    gcs_service.make_bucket("second-bucket")
    gcs_service.make_bucket("second-bucket")
    fs.pipe_file("second-bucket/k", b"other bucket")
    assert fs.cat_file("second-bucket/k") == b"other bucket"


@pytest.mark.gcs
def test_gcs_start_stop_cleans_up(tmp_path: Path) -> None:
    service = backends.start_gcs()
    data_dir, pid = service.data_dir, service.pid
    assert data_dir is not None and pid is not None and data_dir.exists()
    with service:
        assert _answers(service.endpoint_url + "/storage/v1/b")
    assert _gone(pid) and not data_dir.exists()
    assert not _port_open(service.endpoint_url)
    service.stop()  # idempotent

    kept = tmp_path / "kept"
    with backends.start_gcs(kept, bucket="mine") as service:
        assert service.bucket == "mine"
    assert kept.exists(), "a caller's data dir is never removed"


def test_pick_ports_with_companions() -> None:
    ports = pick_ports(4, companion_offset=10000)
    assert len(set(ports)) == 4
    for port in ports:
        for p in (port, port + 10000):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", p))  # still free


def test_failed_start_shows_log_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "weed"
    fake.write_text("#!/bin/sh\necho 'fatal: pretend the disk is full' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("OBJCKPT_WEED_BIN", str(fake))
    with pytest.raises(ServerStartError, match="pretend the disk is full"):
        backends.start_s3(tmp_path / "data", timeout_s=10)


# ---------------------------------------------------------------- launcher


class Launcher:
    """``python -m backends.launcher`` as a subprocess, killed by PID on teardown."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "backends.launcher", *args],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def endpoints(self, timeout: float = 90) -> dict[str, Any]:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not line or not line[0]:
            self.kill()
            raise AssertionError(f"launcher printed nothing; stderr:\n{self.proc.stderr.read()}")  # type: ignore[union-attr]
        return json.loads(line[0])  # type: ignore[no-any-return]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def launcher() -> Any:
    started: list[Launcher] = []

    def start(*args: str) -> Launcher:
        started.append(Launcher(*args))
        return started[-1]

    yield start
    for item in started:
        item.kill()


@pytest.mark.s3
@pytest.mark.gcs
def test_launcher_prints_json_and_stops_on_sigterm(launcher: Any, tmp_path: Path) -> None:
    run = launcher("--data-dir", str(tmp_path))
    info = run.endpoints()
    s3, gcs = info["s3"], info["gcs"]
    assert _answers(s3["endpoint_url"])
    assert _answers(gcs["endpoint_url"] + "/storage/v1/b")
    assert set(s3["env"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"}
    assert s3["url"] == f"s3://{s3['bucket']}/"
    assert gcs["storage_options"]["token"] == "anon"

    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=30) == 0
    assert _wait(lambda: _gone(s3["pid"]) and _gone(gcs["pid"]), 10)
    assert not _port_open(s3["endpoint_url"]) and not _port_open(gcs["endpoint_url"])


@pytest.mark.gcs
def test_servers_die_when_launcher_is_killed(launcher: Any, tmp_path: Path) -> None:
    """SIGKILL runs no cleanup at all: the parent-death signal must do it."""
    run = launcher("--no-s3", "--data-dir", str(tmp_path))
    info = run.endpoints()
    pid = info["gcs"]["pid"]
    assert not _gone(pid)
    run.proc.kill()
    run.proc.wait(timeout=30)
    assert _wait(lambda: _gone(pid), 10), "server outlived its SIGKILLed parent"
