"""No credentials anywhere: a clear error within seconds, naming the URL and the sources tried.

Each case runs in a subprocess whose environment holds no credentials, no profile
files (HOME and the AWS file variables point into an empty temporary directory) and
metadata endpoints pointed at a closed loopback port (never 169.254.169.254).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLOSED = "127.0.0.1:9"

_SCRIPT = r"""
import json, sys, time
import numpy as np
import objckpt

save = objckpt.save  # imported now (objckpt's names load on first use), not in the timing
for url, options in json.loads(sys.argv[1]):
    started = time.monotonic()
    try:
        save(url, {"w": np.zeros(4, np.float32)}, storage_options=options)
        outcome = {"error": None}
    except Exception as exc:
        outcome = {"error": type(exc).__name__, "permission": isinstance(exc, PermissionError),
                   "message": str(exc)}
    outcome["seconds"] = time.monotonic() - started
    print(json.dumps(outcome), flush=True)
"""


def _clean_env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(REPO),
        "JAX_PLATFORMS": "cpu",
        "HOME": str(home),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-credentials"),
        "AWS_CONFIG_FILE": str(home / "no-config"),
        "AWS_METADATA_ENDPOINT": f"http://{CLOSED}",
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://{CLOSED}",
        "GCE_METADATA_HOST": CLOSED,
        "GCE_METADATA_IP": CLOSED,
    }
    env.update(extra)
    return env


def _run(cases: list[tuple[str, dict]], env: dict[str, str]) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(cases)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_s3_without_credentials_fails_at_once_listing_the_sources(s3_service, tmp_path):
    env = _clean_env(tmp_path, AWS_ENDPOINT_URL=s3_service.endpoint_url, AWS_REGION=s3_service.region)
    url = s3_service.url("no-credentials")
    native, fsspec, anonymous = _run([(url, {}), (url, {"objckpt_backend": "fsspec"}), (url, {"anon": True})], env)
    for outcome in (native, fsspec):
        message = outcome["message"]
        assert outcome["error"] == "StorePermissionError" and outcome["permission"], outcome
        assert f"no credentials found for {url}" in message
        for source in ("environment variables", "credentials file", "profile 'default'", "web identity"):
            assert source in message, message
        assert "container credentials" in message and f"instance metadata at http://{CLOSED}" in message
        assert str(tmp_path / "no-credentials") in message
        assert "169.254.169.254" not in message
        assert outcome["seconds"] < 2.0, outcome
    # Explicit anonymous access skips the check: the request reaches the server, which decides.
    assert "no credentials found" not in (anonymous["message"] or ""), anonymous


def test_gcs_without_credentials_fails_at_once_listing_the_sources(tmp_path):
    url = "gs://objckpt-no-such-bucket/ckpt"
    (outcome,) = _run([(url, {})], _clean_env(tmp_path))
    message = outcome["message"]
    assert outcome["error"] == "StorePermissionError" and outcome["permission"], outcome
    assert f"no credentials found for {url}" in message
    assert "GOOGLE_APPLICATION_CREDENTIALS" in message and "application_default_credentials.json" in message
    assert f"metadata server at {CLOSED}" in message and "'token': 'anon'" in message
    assert outcome["seconds"] < 2.0, outcome


def test_gcs_anonymous_emulator_access_needs_no_credentials(gcs_service, tmp_path):
    """``token="anon"`` (what the emulator tests use) and ``STORAGE_EMULATOR_HOST`` skip the check."""
    env = _clean_env(tmp_path, **gcs_service.env())
    cases = [
        (gcs_service.url("anon-explicit"), gcs_service.storage_options()),
        (gcs_service.url("anon-emulator"), {}),
        (gcs_service.url("anon-native"), {"objckpt_backend": "obstore"}),
    ]
    explicit, emulator, native = _run(cases, env)
    assert explicit["error"] is None, explicit
    assert emulator["error"] is None, emulator
    # obstore's GCS writes are refused by the emulator for another reason (see registry's doc).
    assert "no credentials found" not in (native["message"] or ""), native


def test_a_metadata_service_that_answered_is_asked_once_per_process(monkeypatch, tmp_path):
    """Credentials from instance metadata: the first store opened asks the service once
    (one short request), every later one asks it nothing."""
    import http.server
    import threading

    from objckpt.storage.auth import credentials

    requests: list[str] = []

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            requests.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(credentials, "_ANSWERED", set())
    monkeypatch.setenv("HOME", str(tmp_path))  # no gcloud or gcsfs credential files
    host = f"127.0.0.1:{server.server_address[1]}"
    environ = {"GCE_METADATA_HOST": host, "CLOUDSDK_CONFIG": str(tmp_path)}
    try:
        for _ in range(3):
            credentials.check_gcs_credentials("gs://bucket/x", {}, environ)
    finally:
        server.shutdown()
    assert requests == ["/computeMetadata/v1/"]
    closed = {"GCE_METADATA_HOST": CLOSED, "CLOUDSDK_CONFIG": str(tmp_path)}
    try:
        credentials.check_gcs_credentials("gs://bucket/x", {}, closed)
    except PermissionError as e:
        assert "no credentials found" in str(e)
    else:
        raise AssertionError("a closed metadata port must not count as an answer")
