"""A configured endpoint where nothing listens: a clear error within 2 s, on every path.

``endpoint_url`` (top level or in ``client_kwargs``), ``AWS_ENDPOINT_URL``,
``AWS_ENDPOINT_URL_S3`` and ``STORAGE_EMULATOR_HOST`` pointed at a closed
loopback port: ``objckpt.restore``, ``objckpt.save`` and the command line
fail with :class:`~objckpt.errors.EndpointRefusedError` saying "connection
refused", the ``host:port`` and the setting, through obstore, s3fs and gcsfs
alike, instead of 10 retries of an ``error sending request``. An endpoint
that answered once and then refuses (a server restarting) is retried as
before.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import objckpt
from backends.proxy import FaultProxy
from objckpt.errors import EndpointRefusedError, StoreError

_SCRIPT = Path(sys.executable).with_name("objckpt")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "objckpt.cli"]
LIMIT_S = 2.0
_ENDPOINT_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: (id, URL scheme, storage options, environment, the setting the message must name), at {port}.
CASES: list[tuple[str, str, dict[str, Any], dict[str, str], str]] = [
    ("obstore-option", "s3", {"endpoint_url": "http://127.0.0.1:{port}", "objckpt_backend": "obstore"}, {},
     "storage_options['endpoint_url']"),
    ("s3fs-client-kwargs", "s3", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:{port}"},
                                  "objckpt_backend": "fsspec"}, {},
     "storage_options['client_kwargs']['endpoint_url']"),
    ("auto-AWS_ENDPOINT_URL", "s3", {}, {"AWS_ENDPOINT_URL": "http://127.0.0.1:{port}"}, "AWS_ENDPOINT_URL"),
    ("s3fs-AWS_ENDPOINT_URL_S3", "s3", {"objckpt_backend": "fsspec"},
     {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:{port}"}, "AWS_ENDPOINT_URL_S3"),
    ("gcsfs-option", "gs", {"endpoint_url": "http://127.0.0.1:{port}", "token": "anon"}, {},
     "storage_options['endpoint_url']"),
    ("gcsfs-STORAGE_EMULATOR_HOST", "gs", {}, {"STORAGE_EMULATOR_HOST": "127.0.0.1:{port}"}, "STORAGE_EMULATOR_HOST"),
    ("obstore-gcs-option", "gs", {"endpoint_url": "http://127.0.0.1:{port}", "token": "anon",
                                  "objckpt_backend": "obstore"}, {}, "storage_options['endpoint_url']"),
]  # fmt: skip


def _fill(value: Any, port: int) -> Any:
    if isinstance(value, dict):
        return {k: _fill(v, port) for k, v in value.items()}
    return value.replace("{port}", str(port)) if isinstance(value, str) else value


def _setup(case: tuple, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, Any], str, int]:
    _, scheme, options, env, setting = case
    port = _closed_port()
    for name in _ENDPOINT_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDREFUSEDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-secret-refused-test")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    for name, value in _fill(env, port).items():
        monkeypatch.setenv(name, value)
    return f"{scheme}://bucket-{uuid.uuid4().hex[:8]}/ckpt", _fill(options, port), setting, port


def _says_refused(error: BaseException, setting: str, port: int) -> None:
    text = str(error)
    assert isinstance(error, EndpointRefusedError) and isinstance(error, ConnectionRefusedError), repr(error)
    assert isinstance(error, StoreError)
    assert "connection refused" in text and f"127.0.0.1:{port}" in text and setting in text, text
    assert "attempts" not in text, text  # not retried


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_restore_and_save_fail_within_two_seconds_naming_the_endpoint_and_setting(case, monkeypatch) -> None:
    url, options, setting, port = _setup(case, monkeypatch)
    tree = {"w": np.arange(16, dtype=np.float32)}
    with pytest.raises(EndpointRefusedError):  # the first call loads the client libraries: not timed
        objckpt.restore(url, storage_options=options)
    for call in (lambda: objckpt.restore(url, storage_options=options),
                 lambda: objckpt.save(url, tree, storage_options=options)):  # fmt: skip
        started = time.monotonic()
        with pytest.raises(EndpointRefusedError) as caught:
            call()
        elapsed = time.monotonic() - started
        _says_refused(caught.value, setting, port)
        assert elapsed < LIMIT_S, f"{elapsed:.2f} s"


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5]], ids=[CASES[i][0] for i in (0, 1, 5)])
def test_the_cli_fails_within_two_seconds_naming_the_endpoint_and_setting(case, monkeypatch, capsys) -> None:
    from objckpt.cli import main

    url, options, setting, port = _setup(case, monkeypatch)
    flags = [arg for key, value in options.items() for arg in ("-o", f"{key}={json.dumps(value)}")]
    main(["ls", url, "--no-progress", *flags])  # loads the client libraries: not timed
    capsys.readouterr()
    started = time.monotonic()
    status = main(["ls", url, "--no-progress", *flags])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert status == 1, err
    assert "connection refused" in err and f"127.0.0.1:{port}" in err and setting in err, err
    assert elapsed < LIMIT_S, f"{elapsed:.2f} s"


def test_the_cli_in_its_own_process_says_connection_refused(monkeypatch) -> None:
    url, options, setting, port = _setup(CASES[2], monkeypatch)
    done = subprocess.run(
        [*CLI, "verify", url, "--no-progress"],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "connection refused" in done.stderr and f"127.0.0.1:{port}" in done.stderr, done.stderr[-2000:]
    assert "AWS_ENDPOINT_URL" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.s3
def test_an_endpoint_that_answered_once_is_retried_when_it_refuses(s3_service, monkeypatch) -> None:
    """A server that goes away after answering (a restart) is a transient fault, retried as before."""
    for name in _ENDPOINT_VARS:
        monkeypatch.delenv(name, raising=False)
    options = s3_service.storage_options()
    host, port = s3_service.endpoint_url.rsplit("/", 1)[1].rsplit(":", 1)
    retry = objckpt.Options(retry=objckpt.RetryConfig(max_attempts=3, max_backoff=0.05))
    tree = {"w": np.arange(16, dtype=np.float32)}
    with FaultProxy(host, int(port)) as door:
        through = {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": door.endpoint_url}}
        url = s3_service.url(f"refused-{uuid.uuid4().hex[:8]}/ckpt")
        objckpt.save(url, tree, storage_options=through)
    with pytest.raises(StoreError) as caught:
        objckpt.restore(url, storage_options=through, options=retry)
    assert not isinstance(caught.value, EndpointRefusedError), caught.value
    assert "after 3 attempts" in str(caught.value), caught.value
