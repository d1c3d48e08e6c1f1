"""Hardening 5 (issue 77), the storage items: a store that never answers, ``NO_PROXY`` written as
networks, and an S3 refusal that echoes the session token.

* Item 14: a loopback server that accepts connections and never answers. A request fails within
  ``RetryConfig.deadline`` (every attempt cut to what is left of it), with an error saying the
  server never answered within N s, after a warning at the first timed-out attempt naming the
  endpoint; the store's own timeout, shorter than an attempt's, counts as a timeout too.
* Item 15: ``NO_PROXY=127.0.0.0/8`` with a proxy set: obstore goes direct, so the endpoint
  pre-check probes, and a closed port is ``EndpointRefusedError`` at once, not ten attempts.
* Item 16: a fake S3 that answers every request 403 ``SignatureDoesNotMatch`` with a body echoing
  the canonical request (``x-amz-security-token`` in clear and in hex, as AWS does): the session
  token (from the environment, or from a profile) shows nowhere in the error's traceback, its
  cause chain included, nor in ``objckpt --debug``'s output.
"""

from __future__ import annotations

import http.server
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import objckpt
from objckpt.errors import EndpointRefusedError, StoreError, StorePermissionError

_SCRIPT = Path(sys.executable).with_name("objckpt")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "objckpt.cli"]
_ENDPOINT_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST")
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
KEY, SECRET = "AKIDHARDENINGFIVE", "not-a-secret-hardening-five"


class Listener:
    """A loopback TCP server that accepts every connection, reads what comes, and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._open.append(conn)  # held open, never written to

    def close(self) -> None:
        self.sock.close()
        for conn in self._open:
            conn.close()


@pytest.fixture
def silent() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (*_ENDPOINT_VARS, *_PROXY_VARS, "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("HOME", str(tmp_path))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------ item 14: a server that never answers


def _silent_restore(port: int, attempt_s: float, deadline: float, **store: object) -> tuple[float, StoreError]:
    """Restore from the silent server at ``port``: Options.request_timeout ``attempt_s``, ``store`` its options."""
    options = objckpt.Options(request_timeout=attempt_s, retry=objckpt.RetryConfig(deadline=deadline))
    started = time.monotonic()
    with pytest.raises(StoreError) as caught:
        objckpt.restore(
            f"s3://bucket-{uuid.uuid4().hex[:8]}/ckpt",
            storage_options={"endpoint_url": f"http://127.0.0.1:{port}", **store},
            options=options,
        )
    return time.monotonic() - started, caught.value


def _load_the_clients() -> None:
    """One restore from a closed port (refused at once), so that a timed call opens no library."""
    with pytest.raises(EndpointRefusedError):
        objckpt.restore("s3://bucket/ckpt", storage_options={"endpoint_url": f"http://127.0.0.1:{_closed_port()}"})


@pytest.mark.serial
def test_a_server_that_never_answers_fails_within_the_deadline_saying_so(silent, aws_env, caplog) -> None:
    """request_timeout=3 against a 2 s deadline: the one attempt is cut to 2 s (before: 3 s, and
    an error naming neither the endpoint nor the silence)."""
    _load_the_clients()
    with caplog.at_level(logging.WARNING, logger="objckpt"):
        elapsed, error = _silent_restore(silent.port, 3, 2)
    text = str(error)
    assert elapsed < 2 + 0.75, f"{elapsed:.2f} s: {text}"
    assert f"127.0.0.1:{silent.port}" in text and "never answered within 2 s" in text, text
    assert silent.accepted >= 2


@pytest.mark.serial
def test_the_first_timed_out_attempt_warns_naming_the_endpoint_and_retries_double_within_the_deadline(
    silent, aws_env, caplog
) -> None:
    """Attempts of 1 s, then 2 s, then what is left of 4 s: the warning comes after the first."""
    _load_the_clients()
    with caplog.at_level(logging.WARNING, logger="objckpt"):
        started = time.time()
        elapsed, error = _silent_restore(silent.port, 1, 4)
    warnings = [r for r in caplog.records if f"127.0.0.1:{silent.port}" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    message = warnings[0].getMessage()
    assert warnings[0].levelno == logging.WARNING and "did not answer within 1 s" in message, message
    assert "storage_options['endpoint_url']" in message, message
    assert warnings[0].created - started < 1 + 0.9, "the warning waited past the first attempt"
    assert elapsed < 4 + 0.75, f"{elapsed:.2f} s: {error}"
    assert "never answered within 2 s" in str(error) and "after 3 attempts" in str(error), error


def test_the_stores_own_timeout_is_a_timeout_too(silent, aws_env) -> None:
    """The store's timeout (1 s) shorter than an attempt's (5 s): each attempt ends on it, and the
    error still says the server never answered, not obstore's "error sending request"."""
    _, error = _silent_restore(silent.port, 5, 3, request_timeout=1)
    text = str(error)
    assert "never answered within 1 s" in text and f"127.0.0.1:{silent.port}" in text, text
    assert "error sending request" not in text, text


def test_the_transfer_engines_requests_name_the_endpoint_too(silent, aws_env) -> None:
    from objckpt.storage import from_url
    from objckpt.transfer import runtime
    from objckpt.transfer.engine import TransferEngine

    store = from_url("s3://bucket/engine", endpoint_url=f"http://127.0.0.1:{silent.port}")
    retry = objckpt.RetryConfig(deadline=1.5)

    async def put() -> None:
        engine = TransferEngine(store, max_concurrency=2, request_timeout=0.5, retry=retry, adaptive=False)
        await engine.put("blob", b"x" * 1024)

    try:
        with pytest.raises(StoreError) as caught:
            runtime.run_sync(put())
    finally:
        runtime.run_sync(store.close())
    text = str(caught.value)
    assert f"the server at 127.0.0.1:{silent.port}" in text and "never answered within" in text, text


# ------------------------------------------------------------------ item 15: NO_PROXY as networks


@pytest.mark.serial
@pytest.mark.parametrize("no_proxy", ["127.0.0.0/8", "example.com, 127.0.0.1/32"])
def test_no_proxy_networks_are_matched_as_obstore_matches_them(no_proxy, aws_env, monkeypatch) -> None:
    """A proxy that counts connections, NO_PROXY naming the endpoint's network: obstore goes
    direct, so a closed endpoint port is refused at once (before: 10 attempts, 14-18 s)."""
    proxy = Listener()
    port = _closed_port()
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("NO_PROXY", no_proxy)
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "objckpt_backend": "obstore"}
    fast = objckpt.Options(retry=objckpt.RetryConfig(max_attempts=2, max_backoff=0.05))
    url = f"s3://bucket-{uuid.uuid4().hex[:8]}/ckpt"
    try:
        for call in (
            lambda: objckpt.restore(url, storage_options=options, options=fast),
            lambda: objckpt.save(url, {"w": np.arange(4)}, storage_options=options, options=fast),
        ):
            started = time.monotonic()
            with pytest.raises(StoreError) as caught:
                call()
            elapsed = time.monotonic() - started
            assert isinstance(caught.value, EndpointRefusedError), caught.value
            assert f"127.0.0.1:{port}" in str(caught.value) and elapsed < 2.0, (elapsed, caught.value)
        assert proxy.accepted == 0
    finally:
        proxy.close()


def test_the_streamed_reader_beside_obstore_matches_no_proxy_networks_too(monkeypatch) -> None:
    from objckpt.storage.http.s3 import S3RangeReader

    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "10.0.0.0/8,127.0.0.0/8")
    reader = S3RangeReader(endpoint="http://127.0.0.1:9000", bucket="b", region="us-east-1", signer=None)
    assert reader._proxy is None
    monkeypatch.setenv("NO_PROXY", "10.0.0.0/8")
    assert S3RangeReader(endpoint="http://127.0.0.1:9000", bucket="b", region="us-east-1", signer=None)._proxy


# ------------------------------------------------------- item 16: a refusal echoing the session token

TOKEN = "IQoJb3JpZ2luX2VjEHardeningFiveSessionToken" + "x" * 40


class _EchoingRefusal(http.server.BaseHTTPRequestHandler):
    """Every request but a HEAD: 403 SignatureDoesNotMatch with the canonical request echoed, as AWS does."""

    def _refuse(self) -> None:
        if self.command == "HEAD":  # no body to echo in: "not found", so a save goes on to one that has
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        headers = "".join(f"{k.lower()}:{v}\n" for k, v in sorted(self.headers.items()))
        canonical = f"{self.command}\n{self.path}\n\n{headers}"
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SignatureDoesNotMatch</Code>'
            "<Message>The request signature we calculated does not match the signature you provided.</Message>"
            f"<StringToSign>AWS4-HMAC-SHA256</StringToSign><CanonicalRequest>{canonical}</CanonicalRequest>"
            f"<CanonicalRequestBytes>{' '.join(f'{b:02x}' for b in canonical.encode())}</CanonicalRequestBytes>"
            "<RequestId>0</RequestId></Error>"
        ).encode()
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _refuse

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EchoingRefusal)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(params=["environment", "profile"])
def session_token(request, aws_env, monkeypatch, tmp_path) -> None:
    """AWS_SESSION_TOKEN beside the keys, or a profile of a shared credentials file holding all three."""
    if request.param == "environment":
        monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
        return
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[h5]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\naws_session_token = {TOKEN}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "h5")


def _leaks(text: str) -> list[str]:
    """The token's spellings found in ``text``: as is, and as the hex bytes AWS echoes."""
    spaced = " ".join(f"{b:02x}" for b in TOKEN.encode()[:24])
    return [s for s in (TOKEN, TOKEN[:24], spaced) if s in text]


@pytest.mark.parametrize("call", ["restore", "save"])
def test_the_session_token_echoed_by_a_refusal_is_in_no_traceback(call, refusing, session_token) -> None:
    url = f"s3://bucket-{uuid.uuid4().hex[:8]}/ckpt"
    options = {"endpoint_url": refusing}
    with pytest.raises(StorePermissionError) as caught:
        if call == "restore":
            objckpt.restore(url, storage_options=options)
        else:
            objckpt.save(url, {"w": np.arange(4)}, storage_options=options)
    error = caught.value
    assert "SignatureDoesNotMatch" in str(error), error
    chain, cur = [], error.__cause__ or error.__context__
    while cur is not None and len(chain) < 8:
        chain.append(f"{cur!r} {cur}")
        cur = cur.__cause__ or cur.__context__
    assert chain, "the cause is kept (redacted), not dropped"
    shown = "".join(traceback.format_exception(error)) + "".join(chain)
    assert _leaks(shown) == [], shown[-3000:]


def test_objckpt_debug_prints_its_traceback_through_the_redaction(refusing, session_token) -> None:
    done = subprocess.run(
        [*CLI, "--debug", "ls", f"s3://bucket-{uuid.uuid4().hex[:8]}/ckpt", "-o", f"endpoint_url={refusing}"],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" in done.stderr and "SignatureDoesNotMatch" in done.stderr, done.stderr[-3000:]
    assert _leaks(done.stdout + done.stderr) == [], done.stderr[-3000:]


def test_objckpt_debug_redacts_what_any_error_carries(aws_env, monkeypatch, capsys) -> None:
    """Whatever a failing command's exception says (a client library's text, say), ``--debug``
    prints its traceback through the redaction: here the session token of the environment."""
    import objckpt.cli._commands as commands
    from objckpt.cli import main

    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)

    def failing(args: object) -> int:
        raise RuntimeError(f"the server said: <Token-0>{TOKEN}</Token-0>")

    monkeypatch.setattr(commands, "cmd_ls", failing)
    assert main(["--debug", "ls", "s3://bucket/ckpt", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: the server said: <Token-0>***</Token-0>" in err, err
    assert _leaks(err) == [], err
