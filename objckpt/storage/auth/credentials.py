"""Where a cloud store's credentials come from, decided once when it opens, with short limits.

Two jobs. First, "no credentials" is said at once, with the sources tried:
without this, a cloud URL opened with no credentials configured anywhere fails
late and obscurely (obstore probes the instance metadata service on every
request, ~20 s of retries; gcsfs spends ~20 s probing, then silently goes
anonymous). Second, for ``s3://`` the source found is handed to obstore
(:class:`S3Source`), so the native store, its streamed reads and the s3fs
fallback all use the source botocore's precedence picks:

* ``s3://``: botocore's own resolver (environment, shared credentials/config
  files and profile, assume-role, web identity, container, SSO, process...)
  without its instance metadata step, which retries and waits a second per
  request; then, only if that found nothing, the instance metadata service:
  one token request and one request for the instance's role, each under
  :data:`METADATA_TIMEOUT_S`, no retry. It counts only if it gives both (a
  service that answers 403, as a metadata address does where instance
  credentials are switched off, is no source: every later request would be
  refused too). botocore assumes roles lazily; container credentials are
  fetched once here.
* ``gs://``: the places Google's default credentials come from (the
  ``GOOGLE_APPLICATION_CREDENTIALS`` file, gcloud's application-default file,
  gcsfs's token cache), then one ping of the metadata server.

Finding nothing raises :class:`StorePermissionError` naming the URL and every
source tried. Explicit anonymous access (``anon=True`` for S3,
``token="anon"`` for GCS, or an emulator) and explicit credentials skip the
check. Nothing here logs or shows a secret; refreshing is the clients' job
(obstore's, botocore's, google-auth's), never objckpt's.
"""

from __future__ import annotations

import datetime as _dt
import http.client
import os
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from objckpt.errors import StorePermissionError
from objckpt.logs import remember_secrets
from objckpt.storage.urls import redact_url

#: Seconds allowed to each instance-metadata request of the pre-flight check (one attempt).
METADATA_TIMEOUT_S = 1.0

_S3_EXPLICIT = ("key", "secret", "token", "username", "password", "session")
_S3_CLIENT_EXPLICIT = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")


def s3_options_explicit(options: Mapping[str, Any]) -> bool:
    """Whether the s3fs options themselves settle how requests are signed (or not signed)."""
    if options.get("anon") or any(options.get(k) for k in _S3_EXPLICIT):
        return True
    client = options.get("client_kwargs") or {}
    if any(client.get(k) for k in _S3_CLIENT_EXPLICIT):
        return True
    config = options.get("config_kwargs") or {}
    return config.get("signature_version") is not None  # e.g. botocore.UNSIGNED


@dataclass(frozen=True)
class S3Source:
    """Where the S3 credentials of a store come from, as obstore ``S3Config`` entries.

    ``method`` is botocore's name for the source (``"env"``, ``"assume-role"``,
    ``"shared-credentials-file"``, ``"assume-role-with-web-identity"``,
    ``"container-role"``, ``"iam-role"``, ...), or ``"explicit"`` for storage
    options. ``config`` and ``provider`` hold or reach secrets: never shown.
    """

    method: str
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    provider: Callable[[], Any] | None = field(default=None, repr=False)
    region: str | None = None


def check_s3_credentials(url: str, options: Mapping[str, Any], environ: Mapping[str, str]) -> None:
    """Raise at once if no AWS credentials can be found for ``url`` (see :func:`resolve_s3_source`)."""
    if not s3_options_explicit(options):
        resolve_s3_source(url, options, environ)


def resolve_s3_source(url: str, options: Mapping[str, Any], environ: Mapping[str, str]) -> S3Source:
    """Decide, with botocore's own resolver and precedence, where ``url``'s credentials come from.

    Instance metadata is handed to obstore as configuration (its endpoint from
    ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` or the config file), which fetches
    and refreshes it natively: botocore would stretch a short metadata expiry
    by minutes. Every other source botocore finds (profiles, shared
    credentials and config files, assume-role, web identity, container
    credentials, SSO, ``credential_process``) is read through botocore itself:
    :class:`BotocoreCredentials` hands its (refreshed) credentials to obstore.
    obstore 0.12 resolves web identity and container credentials too, but
    cannot be pointed at another STS endpoint (``AWS_ENDPOINT_URL_STS``:
    regional, VPC or FIPS endpoints) nor reliably at a full container URI
    (``AWS_CONTAINER_CREDENTIALS_FULL_URI``, as EKS Pod Identity sets), so
    botocore, which reads every AWS SDK variable, is the one resolver.

    Args:
        url: The ``s3://`` URL being opened (shown without credentials).
        options: s3fs storage options (``profile`` is honoured).
        environ: Usually ``os.environ``.

    Raises:
        StorePermissionError: no source yields credentials (the message lists the sources
            tried), or botocore could not read a configured source (an unknown profile, say).
    """
    profile = options.get("profile")
    if not profile and environ.get("AWS_ACCESS_KEY_ID") and environ.get("AWS_SECRET_ACCESS_KEY"):
        return S3Source("env", _static(environ["AWS_ACCESS_KEY_ID"], environ["AWS_SECRET_ACCESS_KEY"], _token(environ)))
    try:
        import botocore.exceptions
        import botocore.session
    except ImportError:  # no botocore: obstore alone resolves, from the environment
        return S3Source("obstore")
    session = botocore.session.Session(profile=profile)
    resolver = session.get_component("credential_provider")
    resolver.remove("iam-role")  # instance metadata: probed below, once, briefly
    try:
        credentials = resolver.load_credentials()
    except botocore.exceptions.BotoCoreError as exc:
        raise StorePermissionError(f"cannot read AWS credentials for {redact_url(url)}: {exc}") from exc
    region = session.get_config_variable("region")
    if credentials is None:
        refusal = _imds_refusal(session, environ)
        if refusal is None:
            return S3Source("iam-role", {"metadata_endpoint": _imds_endpoint(session)}, region=region)
        raise StorePermissionError(
            f"no credentials found for {redact_url(url)}; tried: {_s3_sources(session, environ, refusal)}. "
            "Configure credentials, or pass storage_options={'anon': True} for a public bucket"
        )
    method = str(getattr(credentials, "method", ""))
    return S3Source(method, provider=BotocoreCredentials(credentials), region=region)


def _static(key: str, secret: str, token: str | None) -> dict[str, Any]:
    config = {"access_key_id": key, "secret_access_key": secret}
    if token:
        config["session_token"] = token
    return config


def _token(environ: Mapping[str, str]) -> str | None:
    return environ.get("AWS_SESSION_TOKEN") or environ.get("AWS_SECURITY_TOKEN") or None


class BotocoreCredentials:
    """An obstore ``credential_provider`` over botocore credentials (a profile, assume-role, SSO...).

    botocore refreshes temporary credentials well before they expire (its
    advisory and mandatory windows, 15 and 10 minutes); obstore asks again
    once the ``expires_at`` given here passes. That time comes from botocore's
    public ``refresh_needed(seconds)``: the longest of a few horizons the
    credentials outlive, so credentials of any lifetime (even seconds, in
    tests) are asked for again before they lapse.
    """

    #: Seconds ahead that obstore may keep a set of credentials, longest first.
    HORIZONS = (300.0, 60.0, 15.0, 5.0, 1.0)

    def __init__(self, credentials: Any) -> None:
        self._credentials = credentials

    def __repr__(self) -> str:
        return f"BotocoreCredentials(method={getattr(self._credentials, 'method', None)!r})"

    def __call__(self) -> dict[str, Any]:
        frozen = self._credentials.get_frozen_credentials()
        remember_secrets((frozen.secret_key or "", frozen.token or ""))  # out of every log, by value
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token or None,
            "expires_at": self._expires_at(),
        }

    def _expires_at(self) -> _dt.datetime | None:
        refresh_needed = getattr(self._credentials, "refresh_needed", None)
        if refresh_needed is None:
            return None  # static credentials never expire
        now = _dt.datetime.now(_dt.UTC)
        for horizon in self.HORIZONS:
            if not refresh_needed(horizon):
                return now + _dt.timedelta(seconds=horizon)
        return now  # lapsing now: ask again at the next request


def _imds_endpoint(session: Any) -> str:
    endpoint = session.get_config_variable("ec2_metadata_service_endpoint")
    if endpoint:
        return str(endpoint).rstrip("/")
    mode = str(session.get_config_variable("ec2_metadata_service_endpoint_mode") or "ipv4").lower()
    return "http://[fd00:ec2::254]" if mode == "ipv6" else "http://169.254.169.254"


_IMDS_ROLES = "/latest/meta-data/iam/security-credentials/"


def _imds_refusal(session: Any, environ: Mapping[str, str]) -> str | None:
    """None when the instance metadata service gives a session token (IMDSv2) and names the
    instance's role, as obstore will ask; else why not, for the message."""
    if (environ.get("AWS_EC2_METADATA_DISABLED") or "").lower() == "true":
        return "disabled by AWS_EC2_METADATA_DISABLED"
    endpoint = _imds_endpoint(session)
    if endpoint in _ANSWERED:
        return None
    token = _ask(endpoint, "PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
    if token is None:
        return f"no answer within {METADATA_TIMEOUT_S:g} s"
    if token[0] != 200:
        return f"the token request was refused: HTTP {token[0]}"
    remember_secrets((token[1].decode("latin-1"),))
    role = _ask(endpoint, "GET", _IMDS_ROLES, {"X-aws-ec2-metadata-token": token[1].decode("latin-1").strip()})
    if role is None:
        return f"no answer to the role request within {METADATA_TIMEOUT_S:g} s"
    if role[0] != 200 or not role[1].strip():
        return f"no instance role: HTTP {role[0]} for {_IMDS_ROLES}"
    _ANSWERED.add(endpoint)
    return None


#: Metadata endpoints that answered once in this process: a host's metadata service
#: does not go away, so every store opened after the first asks it nothing.
_ANSWERED: set[str] = set()


def _answers(endpoint: str, method: str, path: str, headers: dict[str, str]) -> bool:
    """Whether ``endpoint`` gives any HTTP answer to one request within
    :data:`METADATA_TIMEOUT_S` (the client then resolves through it as usual).
    Only a yes is remembered (:data:`_ANSWERED`)."""
    if endpoint in _ANSWERED:
        return True
    if _ask(endpoint, method, path, headers) is None:
        return False
    _ANSWERED.add(endpoint)
    return True


#: Bytes of a metadata answer read at most (a token or a role name is a few dozen).
_ANSWER_LIMIT = 64 * 1024


def _ask(endpoint: str, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes] | None:
    """One request to ``endpoint`` within :data:`METADATA_TIMEOUT_S`: its status and body, or None
    when nothing answers. No proxy, no retry: a metadata service is on the host's own link."""
    parsed = urllib.parse.urlsplit(endpoint)
    if not parsed.hostname:
        return None
    conn_type = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(parsed.hostname, parsed.port, timeout=METADATA_TIMEOUT_S)
    try:
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        return response.status, response.read(_ANSWER_LIMIT)
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _s3_sources(session: Any, environ: Mapping[str, str], refusal: str) -> str:
    """The credential sources botocore tried, as one line for the message; ``refusal`` says
    why the instance metadata service gave none."""
    profile = session.profile or environ.get("AWS_PROFILE") or "default"
    credentials_file = os.path.expanduser(str(session.get_config_variable("credentials_file")))
    config_file = os.path.expanduser(str(session.get_config_variable("config_file")))
    imds = _imds_endpoint(session)
    if (environ.get("AWS_EC2_METADATA_DISABLED") or "").lower() == "true":
        metadata = f"instance metadata ({refusal})"
    else:
        metadata = f"instance metadata at {imds} ({refusal})"
    return "; ".join(
        (
            "environment variables (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)",
            f"shared credentials file {credentials_file} and config file {config_file} (profile {profile!r})",
            "web identity token (AWS_WEB_IDENTITY_TOKEN_FILE)",
            "container credentials (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI/_FULL_URI)",
            metadata,
        )
    )


def _gcs_files(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(description, path) of every file Google's default credentials or gcsfs may read."""
    home = os.path.expanduser("~")
    config_dir = environ.get("CLOUDSDK_CONFIG") or (
        os.path.join(environ["APPDATA"], "gcloud") if os.name == "nt" and environ.get("APPDATA") else None
    )
    config_dir = config_dir or os.path.join(home, ".config", "gcloud")
    files = [
        ("gcloud application-default credentials", os.path.join(config_dir, "application_default_credentials.json")),
        ("gcsfs token cache", os.path.join(home, ".gcs_tokens")),
    ]
    explicit = environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if explicit:
        files.insert(0, ("GOOGLE_APPLICATION_CREDENTIALS", explicit))
    return files


def _gce_metadata_host(environ: Mapping[str, str]) -> str:
    """The GCE metadata server: ``GCE_METADATA_HOST`` (or ``GCE_METADATA_IP``) when set, as google-auth reads them."""
    return environ.get("GCE_METADATA_HOST") or environ.get("GCE_METADATA_IP") or "metadata.google.internal"


def _gce_metadata_answers(environ: Mapping[str, str]) -> bool:
    """One short request to the GCE metadata server."""
    return _answers(
        f"http://{_gce_metadata_host(environ)}", "GET", "/computeMetadata/v1/", {"Metadata-Flavor": "Google"}
    )


def check_gcs_credentials(url: str, options: Mapping[str, Any], environ: Mapping[str, str]) -> None:
    """Raise at once if gcsfs would find no Google credentials for ``url`` (it would go anonymous).

    Only for the default ``token=None``: an explicit token (``"anon"``, a file,
    credentials) and any endpoint (an emulator, ``STORAGE_EMULATOR_HOST``) are
    taken as they are.

    Raises:
        StorePermissionError: no credential file exists and the metadata server does not answer.
    """
    if options.get("token") is not None or options.get("endpoint_url"):
        return
    if environ.get("STORAGE_EMULATOR_HOST", "default") != "default":
        return  # an emulator: anonymous unless a token is given
    files = _gcs_files(environ)
    if any(os.path.exists(path) for _, path in files) or _gce_metadata_answers(environ):
        return
    host = _gce_metadata_host(environ)
    tried = [f"{what} ({path})" for what, path in files]
    if "GOOGLE_APPLICATION_CREDENTIALS" not in environ:
        tried.insert(0, "GOOGLE_APPLICATION_CREDENTIALS (unset)")
    tried.append(f"GCE metadata server at {host} (no answer within {METADATA_TIMEOUT_S:g} s)")
    raise StorePermissionError(
        f"no credentials found for {redact_url(url)}; tried: {'; '.join(tried)}. "
        "Configure credentials, or pass storage_options={'token': 'anon'} for a public bucket"
    )
