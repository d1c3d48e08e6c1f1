"""Emulated cloud credential services, so the SDKs' own credential chains run in tests.

On a cloud machine objckpt gets no keys from its user: botocore finds them at
the EC2 instance metadata service (IMDSv2), the ECS/EKS container endpoint, STS
(a web identity token, or a profile that assumes a role) and google-auth at
the GCE metadata server, Google's OAuth token endpoint (a service-account key
or an ``authorized_user`` file) or Google's STS (workload identity
federation). :class:`CredentialServer` answers all of these on one loopback
port, the way those services do, so a test points the standard variables
(:meth:`~CredentialServer.imds_env`, :meth:`~CredentialServer.gce_env`, ...) at
it and lets the real client libraries resolve credentials.

Credentials rotate: generation ``g = int((now - start) / lifetime_s)`` serves
``aws_keys[g % len(aws_keys)]`` expiring at the end of the generation, and a
fresh Google access token. A short ``lifetime_s`` makes a test see a refresh;
:meth:`~CredentialServer.expired_access_keys` and
:meth:`~CredentialServer.valid_bearer` feed
:class:`backends.proxy.FaultProxy`'s identity checks, which refuse stale
credentials in front of SeaweedFS and fake-gcs-server.

The services' wire formats are written out here by hand (no library serves
them); JWT assertions are checked with google-auth and keys made with
``cryptography``.

    with CredentialServer(aws_keys=make_aws_keys(2), lifetime_s=2) as creds:
        os.environ.update(creds.imds_env())
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

REGION = "us-east-1"
SERVICE_ACCOUNT_EMAIL = "objckpt-test@project.iam.gserviceaccount.com"
PROJECT_ID = "objckpt-test"
SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
_ACCOUNT_ID = "123456789012"
_STS_NS = "https://sts.amazonaws.com/doc/2011-06-15/"
_GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"
_JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
_TOKEN_EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"
_ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"
_JWT_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:jwt"
_AUDIENCE = f"//iam.googleapis.com/projects/{_ACCOUNT_ID}/locations/global/workloadIdentityPools/objckpt-test/providers/objckpt-test"
_BODY_LIMIT = 1 << 20  # a request body longer than this is refused
_SOCKET_TIMEOUT_S = 10.0
_IMDS_TOKEN_MAX_TTL_S = 21600


def make_aws_keys(n: int) -> list[tuple[str, str]]:
    """``n`` random (access key id, secret key) pairs, shaped like AWS's (20 and 40 characters)."""
    return [("OBJCKPT" + secrets.token_hex(7).upper()[:13], secrets.token_urlsafe(30)) for _ in range(n)]


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:12]


def _iso(timestamp: float) -> str:
    """RFC 3339 in UTC with milliseconds: whole seconds would move a short test expiry up to
    a second early, so a client could be served keys already expired."""
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


class CredentialServer:
    """IMDSv2, ECS container credentials, AWS STS, GCE metadata, OAuth and Google STS on one port.

    Args:
        aws_keys: The (access key id, secret) pairs served in turn, one per generation.
        lifetime_s: How long a generation's credentials live.
        session_tokens: Serve a random session token with the AWS keys. Off by
            default, and the served ``Token``/``SessionToken`` is then empty:
            SeaweedFS accepts only session tokens that its own STS issued, so
            temporary keys meant for it must carry none (botocore signs without
            ``X-Amz-Security-Token`` when the token is empty).
        web_identity_token: The token that AssumeRoleWithWebIdentity and the
            Google token exchange accept (what a Kubernetes projected token holds).
        role_arn: The role that is assumed (its last part is the IMDS role name).
        container_auth_token: When set, the ECS endpoint requires this
            ``Authorization`` header (``AWS_CONTAINER_AUTHORIZATION_TOKEN``).
        aws_expiry_padding_s: Added to the ``Expiration`` the AWS services
            report. Real AWS credentials live 15 minutes at least, and botocore
            refuses fresh ones that lapse within 10 (its mandatory refresh
            window); a test that rotates keys every few seconds reports them
            ~10.5 minutes longer-lived, which keeps botocore in its advisory
            window (it refreshes on every use), and revokes each key at its
            real rotation.
    """

    def __init__(
        self,
        *,
        aws_keys: Sequence[tuple[str, str]] = (),
        lifetime_s: float = 3600.0,
        session_tokens: bool = False,
        web_identity_token: str = "test-web-identity-token",
        role_arn: str = f"arn:aws:iam::{_ACCOUNT_ID}:role/objckpt-test",
        container_auth_token: str | None = None,
        aws_expiry_padding_s: float = 0.0,
    ) -> None:
        if lifetime_s <= 0:
            raise ValueError(f"bad lifetime_s: {lifetime_s}")
        self._aws_keys = list(aws_keys)
        self.lifetime_s = lifetime_s
        self.session_tokens = session_tokens
        self._web_identity_token = web_identity_token
        self.role_arn = role_arn
        self.role_name = role_arn.rsplit("/", 1)[-1]
        self._container_auth_token = container_auth_token
        self.aws_expiry_padding_s = aws_expiry_padding_s
        self.issued: list[tuple[str, str]] = []  # (kind, access key id or sha256(token)[:12])
        self.fetches: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._start = time.time()
        self._session_token_of: dict[int, str] = {}  # generation -> AWS session token
        self._bearer_of: dict[tuple[str, int], str] = {}  # (kind, generation) -> Google access token
        self._bearer_expiry: dict[str, float] = {}  # Google access token -> when it expires
        self._imds_tokens: dict[str, float] = {}  # IMDSv2 session token -> when it expires
        self._sa_keys: dict[str, str] = {}  # service-account private_key_id -> public key PEM
        self._refresh_tokens: dict[str, tuple[str, str]] = {}  # refresh token -> (client id, client secret)
        self._source_keys: set[str] = set()  # access keys of written profiles, allowed to AssumeRole
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:  # keys and tokens stay out
        return f"CredentialServer(url={self.url!r}, lifetime_s={self.lifetime_s}, aws_keys={len(self._aws_keys)})"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> CredentialServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.credentials = self  # type: ignore[attr-defined]
        self._server = server
        self._start = time.time()
        self._thread = threading.Thread(target=server.serve_forever, name="credential-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> CredentialServer:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server is not None else 0

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    # ------------------------------------------------------------------ what is served

    def _generation(self, now: float) -> int:
        return int((now - self._start) / self.lifetime_s)

    def _generation_end(self, generation: int) -> float:
        return self._start + (generation + 1) * self.lifetime_s

    def seconds_to_rotation(self) -> float:
        """Seconds until the next generation's credentials are served (a test that sleeps this
        long plus a margin lands well inside a generation, never on its boundary)."""
        now = time.time()
        return self._generation_end(self._generation(now)) - now

    def current_aws_key(self) -> str:
        """The access key id served now."""
        if not self._aws_keys:
            raise LookupError("this server has no AWS keys")
        return self._aws_keys[self._generation(time.time()) % len(self._aws_keys)][0]

    def expired_access_keys(self) -> list[str]:
        """Access keys served in past generations that are not the one served now."""
        if not self._aws_keys:
            return []
        now = self._generation(time.time())
        current = self._aws_keys[now % len(self._aws_keys)][0]
        past = {self._aws_keys[g % len(self._aws_keys)][0] for g in range(min(now, len(self._aws_keys)))}
        return sorted(past - {current})

    def valid_bearer(self, token: str, *, grace_s: float = 0.0) -> bool:
        """True if this server issued the Google access ``token`` and it has not expired
        (``grace_s`` ago: a request sent just before expiry may arrive just after)."""
        with self._lock:
            expiry = self._bearer_expiry.get(token)
        return expiry is not None and expiry + grace_s > time.time()

    def _aws_credentials(self, kind: str) -> dict[str, str] | None:
        """This generation's AWS credentials (recorded as issued to ``kind``); None without keys."""
        if not self._aws_keys:
            return None
        now = time.time()
        generation = self._generation(now)
        key, secret = self._aws_keys[generation % len(self._aws_keys)]
        with self._lock:
            token = ""
            if self.session_tokens:
                token = self._session_token_of.setdefault(generation, secrets.token_urlsafe(48))
            self.fetches[kind] += 1
            self.issued.append((kind, key))
        return {
            "AccessKeyId": key,
            "SecretAccessKey": secret,
            "Token": token,
            "Expiration": _iso(self._generation_end(generation) + self.aws_expiry_padding_s),
        }

    def _google_token(self, kind: str) -> dict[str, Any]:
        """This generation's access token for ``kind`` (recorded as issued), as an OAuth token response."""
        now = time.time()
        generation = self._generation(now)
        end = self._generation_end(generation)
        with self._lock:
            token = self._bearer_of.get((kind, generation))
            if token is None:
                token = "ya29.objckpt-" + secrets.token_urlsafe(32)
                self._bearer_of[(kind, generation)] = token
                self._bearer_expiry[token] = end
            self.fetches[kind] += 1
            self.issued.append((kind, _digest(token)))
        return {"access_token": token, "expires_in": max(1, int(end - now)), "token_type": "Bearer"}

    def _new_imds_token(self, ttl_s: int) -> str:
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._imds_tokens[token] = time.time() + ttl_s
        return token

    def _imds_token_valid(self, token: str | None) -> bool:
        with self._lock:
            expiry = self._imds_tokens.get(token or "")
        return expiry is not None and expiry > time.time()

    # ------------------------------------------------------------------ client configuration

    def imds_env(self) -> dict[str, str]:
        """botocore's variables for an EC2 instance metadata service at this server."""
        return {"AWS_EC2_METADATA_SERVICE_ENDPOINT": self.url, "AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE": "IPv4"}

    def ecs_env(self) -> dict[str, str]:
        """botocore's variables for ECS/EKS container credentials at this server."""
        env = {"AWS_CONTAINER_CREDENTIALS_FULL_URI": f"{self.url}/ecs/credentials"}
        if self._container_auth_token is not None:
            env["AWS_CONTAINER_AUTHORIZATION_TOKEN"] = self._container_auth_token
        return env

    def web_identity_env(self, token_file: Path) -> dict[str, str]:
        """Write the web identity token to ``token_file``; botocore's variables to assume the role with it."""
        _write_private(Path(token_file), self._web_identity_token)
        return {
            "AWS_WEB_IDENTITY_TOKEN_FILE": str(token_file),
            "AWS_ROLE_ARN": self.role_arn,
            "AWS_ROLE_SESSION_NAME": "objckpt-test",
            "AWS_ENDPOINT_URL_STS": self.url,
        }

    def gce_env(self) -> dict[str, str]:
        """google-auth's variables for a GCE metadata server at this server.

        google-auth reads ``GCE_METADATA_HOST`` when ``google.auth.compute_engine._metadata``
        is first imported (``GCE_METADATA_IP``, used for the ping, on each call), so set
        these before that import or patch the module's ``_GCE_METADATA_HOST`` too.
        """
        return {"GCE_METADATA_HOST": self.host, "GCE_METADATA_IP": self.host}

    def write_service_account_json(self, path: Path) -> Path:
        """A service-account key file (a new RSA key) whose token_uri is this server."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        private_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()
        public_pem = (
            key.public_key()
            .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
            .decode()
        )
        key_id = secrets.token_hex(20)
        with self._lock:
            self._sa_keys[key_id] = public_pem
        info = {
            "type": "service_account",
            "project_id": PROJECT_ID,
            "private_key_id": key_id,
            "private_key": private_pem,
            "client_email": SERVICE_ACCOUNT_EMAIL,
            "client_id": "100000000000000000001",
            "token_uri": f"{self.url}/token",
        }
        _write_private(Path(path), json.dumps(info))
        return Path(path)

    def write_authorized_user_json(self, path: Path) -> Path:
        """An ``authorized_user`` file (what ``gcloud auth application-default login`` writes).

        Its ``token_uri`` names this server, but google-auth's
        ``Credentials.from_authorized_user_info`` always uses Google's endpoint:
        callers redirect the loaded credentials with ``.with_token_uri(server.url + "/token")``.
        """
        client_id = secrets.token_hex(8) + ".apps.googleusercontent.com"
        client_secret = secrets.token_urlsafe(18)
        refresh_token = "1//objckpt-" + secrets.token_urlsafe(32)
        with self._lock:
            self._refresh_tokens[refresh_token] = (client_id, client_secret)
        info = {
            "type": "authorized_user",
            "client_id": client_id,
            "client_secret": client_secret,
            "refresh_token": refresh_token,
            "token_uri": f"{self.url}/token",
        }
        _write_private(Path(path), json.dumps(info))
        return Path(path)

    def write_external_account_json(self, path: Path, subject_token_file: Path) -> Path:
        """A workload identity federation file whose subject token (written too) this server exchanges."""
        _write_private(Path(subject_token_file), self._web_identity_token)
        info = {
            "type": "external_account",
            "audience": _AUDIENCE,
            "subject_token_type": _JWT_TOKEN_TYPE,
            "token_url": f"{self.url}/v1/token",
            "credential_source": {"file": str(subject_token_file)},
        }
        _write_private(Path(path), json.dumps(info))
        return Path(path)

    def write_aws_profile(
        self, directory: Path, profile: str, *, source_key: str, source_secret: str
    ) -> dict[str, str]:
        """``config`` and ``credentials`` files for ``profile``, which assumes ``role_arn`` from static keys.

        Returns the variables that make botocore use them and this server as STS.
        """
        directory = Path(directory)
        source = f"{profile}-source"
        with self._lock:
            self._source_keys.add(source_key)
        _write_private(
            directory / "config",
            f"[profile {profile}]\nrole_arn = {self.role_arn}\nsource_profile = {source}\n"
            f"role_session_name = objckpt-test\nregion = {REGION}\n\n[profile {source}]\nregion = {REGION}\n",
        )
        _write_private(
            directory / "credentials",
            f"[{source}]\naws_access_key_id = {source_key}\naws_secret_access_key = {source_secret}\n",
        )
        return {
            "AWS_CONFIG_FILE": str(directory / "config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(directory / "credentials"),
            "AWS_PROFILE": profile,
            "AWS_ENDPOINT_URL_STS": self.url,
        }


# ---------------------------------------------------------------------- the wire


class _Handler(BaseHTTPRequestHandler):
    """Routes each request to the service it belongs to, by method and path."""

    protocol_version = "HTTP/1.1"
    timeout = _SOCKET_TIMEOUT_S
    server_version = "objckpt-credentials"

    @property
    def creds(self) -> CredentialServer:
        return self.server.credentials  # type: ignore[attr-defined, no-any-return]

    def log_message(self, format: str, *args: Any) -> None:
        pass  # tokens travel in paths and headers

    def _send(self, status: int, body: bytes | str, content_type: str, headers: dict[str, str] | None = None) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _json(self, status: int, value: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(value), "application/json", headers)

    def _form(self) -> dict[str, str] | None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > _BODY_LIMIT:
            self._send(413, "request body too large\n", "text/plain")
            return None
        body = self.rfile.read(length).decode()
        if self.headers.get("Content-Type", "").startswith("application/json"):
            return {k: str(v) for k, v in json.loads(body or "{}").items()}
        return {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}

    # ------------------------------------------------------------------ dispatch

    def do_PUT(self) -> None:
        path = urlsplit(self.path).path
        if path == "/latest/api/token":
            self._imds_token()
        else:
            self._send(404, "not found\n", "text/plain")

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        if parts.path.startswith("/latest/"):
            self._imds(parts.path)
        elif parts.path == "/ecs/credentials":
            self._ecs()
        elif parts.path == "/" or parts.path.startswith("/computeMetadata/"):
            self._gce(parts.path, parse_qs(parts.query))
        else:
            self._send(404, "not found\n", "text/plain")

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if path.startswith("/computeMetadata/"):  # google-auth POSTs for bound tokens
            self._gce(path, parse_qs(urlsplit(self.path).query))
            return
        form = self._form()
        if form is None:
            return
        if path == "/":
            self._aws_sts(form)
        elif path == "/token":
            self._oauth(form)
        elif path == "/v1/token":
            self._google_sts(form)
        else:
            self._send(404, "not found\n", "text/plain")

    # ------------------------------------------------------------------ AWS

    def _imds_token(self) -> None:
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if not ttl.isdigit() or not 1 <= int(ttl) <= _IMDS_TOKEN_MAX_TTL_S:
            self._send(400, "missing or bad X-aws-ec2-metadata-token-ttl-seconds\n", "text/plain")
            return
        token = self.creds._new_imds_token(int(ttl))
        self._send(200, token, "text/plain", {"X-aws-ec2-metadata-token-ttl-seconds": ttl})

    def _imds(self, path: str) -> None:
        creds = self.creds
        if not creds._imds_token_valid(self.headers.get("X-aws-ec2-metadata-token")):
            self._send(401, "", "text/plain")  # IMDSv2 only, as hardened instances are
            return
        roles = "/latest/meta-data/iam/security-credentials/"
        if path in (roles, roles.rstrip("/")):
            self._send(200, creds.role_name, "text/plain")
        elif path.rstrip("/") == roles + creds.role_name:
            served = creds._aws_credentials("imds")
            if served is None:
                self._send(404, "", "text/plain")
                return
            document = {"Code": "Success", "LastUpdated": _iso(time.time()), "Type": "AWS-HMAC", **served}
            self._send(200, json.dumps(document), "text/plain")  # IMDS says text/plain, as the real one does
        elif path == "/latest/meta-data/placement/region":
            self._send(200, REGION, "text/plain")
        elif path.rstrip("/") == "/latest/meta-data/placement/availability-zone":
            self._send(200, REGION + "a", "text/plain")
        elif path == "/latest/dynamic/instance-identity/document":
            self._json(200, {"region": REGION, "availabilityZone": REGION + "a", "accountId": _ACCOUNT_ID})
        else:
            self._send(404, "", "text/plain")

    def _ecs(self) -> None:
        creds = self.creds
        expected = creds._container_auth_token
        offered = self.headers.get("Authorization") or ""
        if expected is not None and not hmac.compare_digest(offered.encode(), expected.encode()):
            self._json(401, {"code": "AccessDenied", "message": "bad container authorization token"})
            return
        served = creds._aws_credentials("ecs")
        if served is None:
            self._json(404, {"code": "NotFound", "message": "no credentials"})
            return
        self._json(200, {**served, "RoleArn": creds.role_arn})

    def _aws_sts(self, form: dict[str, str]) -> None:
        creds = self.creds
        action = form.get("Action")
        if action == "AssumeRoleWithWebIdentity":
            token = form.get("WebIdentityToken", "")
            if not hmac.compare_digest(token.encode(), creds._web_identity_token.encode()):
                self._sts_error(403, "AccessDenied", "Not authorized to perform sts:AssumeRoleWithWebIdentity")
                return
            kind = "sts-web-identity"
        elif action == "AssumeRole":
            signed_by = self.headers.get("Authorization", "").partition("Credential=")[2].split("/", 1)[0]
            if not signed_by or signed_by not in creds._source_keys:
                self._sts_error(403, "InvalidClientTokenId", "The security token included in the request is invalid.")
                return
            kind = "sts-assume-role"
        else:
            self._sts_error(400, "InvalidAction", f"Could not find operation {action}")
            return
        if form.get("RoleArn") != creds.role_arn:
            self._sts_error(403, "AccessDenied", f"Not authorized to assume {form.get('RoleArn')}")
            return
        served = creds._aws_credentials(kind)
        if served is None:
            self._sts_error(503, "ServiceUnavailable", "no keys to serve")
            return
        session = escape(form.get("RoleSessionName", "objckpt-test"))
        values = {k: escape(v) for k, v in served.items()}
        body = (
            f'<{action}Response xmlns="{_STS_NS}"><{action}Result>'
            f"<Credentials><AccessKeyId>{values['AccessKeyId']}</AccessKeyId>"
            f"<SecretAccessKey>{values['SecretAccessKey']}</SecretAccessKey>"
            f"<SessionToken>{values['Token']}</SessionToken><Expiration>{values['Expiration']}</Expiration>"
            f"</Credentials><AssumedRoleUser>"
            f"<Arn>arn:aws:sts::{_ACCOUNT_ID}:assumed-role/{escape(creds.role_name)}/{session}</Arn>"
            f"<AssumedRoleId>AROAOBJCKPTTEST:{session}</AssumedRoleId></AssumedRoleUser>"
            f"</{action}Result><ResponseMetadata><RequestId>{secrets.token_hex(16)}</RequestId>"
            f"</ResponseMetadata></{action}Response>"
        )
        self._send(200, body, "text/xml")

    def _sts_error(self, status: int, code: str, message: str) -> None:
        body = (
            f'<ErrorResponse xmlns="{_STS_NS}"><Error><Type>Sender</Type><Code>{code}</Code>'
            f"<Message>{escape(message)}</Message></Error><RequestId>{secrets.token_hex(16)}</RequestId>"
            f"</ErrorResponse>"
        )
        self._send(status, body, "text/xml")

    # ------------------------------------------------------------------ Google

    def _gce(self, path: str, query: dict[str, list[str]]) -> None:
        flavor = {"Metadata-Flavor": "Google"}
        if self.headers.get("Metadata-Flavor") != "Google":
            self._send(403, "Missing required header: Metadata-Flavor\n", "text/html", flavor)
            return
        if path == "/":
            self._send(200, "computeMetadata/\n", "application/text", flavor)
            return
        creds = self.creds
        name = path.removeprefix("/computeMetadata/v1/")
        accounts = "instance/service-accounts/"
        if name.startswith(accounts):
            account, _, item = name.removeprefix(accounts).partition("/")
            if account not in ("default", SERVICE_ACCOUNT_EMAIL):
                self._send(404, "not found\n", "text/html", flavor)
            elif item == "token":
                self._json(200, creds._google_token("gce"), flavor)
            elif item == "" and query.get("recursive") == ["true"]:
                info = {"aliases": ["default"], "email": SERVICE_ACCOUNT_EMAIL, "scopes": list(SCOPES)}
                self._json(200, info, flavor)
            elif item == "":
                self._send(200, "aliases\nemail\nidentity\nscopes\ntoken\n", "application/text", flavor)
            elif item == "email":
                self._send(200, SERVICE_ACCOUNT_EMAIL, "application/text", flavor)
            elif item == "scopes":
                self._send(200, "\n".join(SCOPES) + "\n", "application/text", flavor)
            else:
                self._send(404, "not found\n", "text/html", flavor)
            return
        answers = {
            "project/project-id": PROJECT_ID,
            "project/numeric-project-id": _ACCOUNT_ID,
            "universe/universe-domain": "googleapis.com",
        }
        if name in answers:
            self._send(200, answers[name], "application/text", flavor)
        else:
            self._send(404, "not found\n", "text/html", flavor)

    def _oauth(self, form: dict[str, str]) -> None:
        creds = self.creds
        grant = form.get("grant_type")
        if grant == _JWT_BEARER:
            if not self._assertion_valid(form.get("assertion", "")):
                self._json(400, {"error": "invalid_grant", "error_description": "Invalid JWT."})
                return
        elif grant == "refresh_token":
            with creds._lock:
                client = creds._refresh_tokens.get(form.get("refresh_token", ""))
            if client is None or client != (form.get("client_id"), form.get("client_secret")):
                self._json(400, {"error": "invalid_grant", "error_description": "Bad Request"})
                return
        else:
            self._json(400, {"error": "unsupported_grant_type", "error_description": f"Invalid grant_type: {grant}"})
            return
        self._json(200, creds._google_token("oauth"))

    def _assertion_valid(self, assertion: str) -> bool:
        """A service-account JWT signed by a key this server wrote, addressed to a token endpoint.

        google-auth addresses it to Google's token endpoint whatever the file's ``token_uri``.
        """
        from google.auth import exceptions, jwt

        creds = self.creds
        with creds._lock:
            keys = dict(creds._sa_keys)
        try:
            header = jwt.decode_header(assertion)
            public_pem = keys.get(header.get("kid", ""))
            if public_pem is None:
                return False
            jwt.decode(assertion, certs=public_pem, audience=[f"{creds.url}/token", _GOOGLE_TOKEN_URI])
        except (ValueError, exceptions.GoogleAuthError):
            return False
        return True

    def _google_sts(self, form: dict[str, str]) -> None:
        creds = self.creds
        if form.get("grant_type") != _TOKEN_EXCHANGE:
            self._json(400, {"error": "invalid_request", "error_description": "Invalid grant_type"})
            return
        token = form.get("subject_token", "")
        if not hmac.compare_digest(token.encode(), creds._web_identity_token.encode()):
            self._json(400, {"error": "invalid_grant", "error_description": "Invalid subject token"})
            return
        answer = creds._google_token("sts-exchange")
        self._json(200, {**answer, "issued_token_type": _ACCESS_TOKEN_TYPE})
