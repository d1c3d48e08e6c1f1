"""fsspec-style storage options → obstore store configuration (no network I/O).

objckpt's public options are the ones s3fs and gcsfs take, so a URL opens the
same way whichever adapter serves it. This module translates them for
obstore's ``S3Store``/``GCSStore``, reading the usual environment variables
when an option is absent. It never guesses: an option or credential source it
cannot carry over raises :class:`NotTranslatable`, and the registry then uses
the fsspec adapter for that URL (or, when the native store was demanded,
reports the reason).

Translated for ``s3://`` (s3fs names):

* ``key``/``username``, ``secret``/``password``, ``token`` (session token),
  or the same inside ``client_kwargs`` as ``aws_access_key_id``,
  ``aws_secret_access_key``, ``aws_session_token``;
* ``endpoint_url`` (top level or in ``client_kwargs``), ``use_ssl``;
* ``client_kwargs["region_name"]``, ``config_kwargs["region_name"]``;
* ``config_kwargs={"s3": {"addressing_style": "path" | "auto" | "virtual",
  "payload_signing_enabled": bool}}`` (default as botocore: sign the payload's
  SHA-256 only over plain HTTP);
* ``anon`` (unsigned requests), ``requester_pays``;
* ``client_kwargs["verify"]`` (a CA bundle path, or False), else ``AWS_CA_BUNDLE``,
  else ``REQUESTS_CA_BUNDLE`` (botocore's order) → obstore's ``root_certificate``
  (``SSL_CERT_FILE`` and ``HTTPS_PROXY``/``NO_PROXY`` obstore reads itself);
* environment: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``,
  ``AWS_REGION``/``AWS_DEFAULT_REGION``;
* every other credential source through ``source``, which the registry
  resolves with botocore's precedence before translating
  (:func:`objckpt.storage.auth.credentials.resolve_s3_source`): web identity,
  container and instance-metadata credentials as obstore configuration (obstore
  fetches and refreshes them), profiles and shared files (static keys,
  assume-role, SSO, ``credential_process``) as a credential provider over botocore.

Not translatable (the fsspec adapter is used): a ``profile`` option without a
resolved source, AWS without a known region (s3fs discovers a bucket's region;
obstore would sign for us-east-1), virtual-host addressing on a custom
endpoint, and any other s3fs option that changes behaviour
(``s3_additional_kwargs``, ``session``, ``version_aware``...).

Translated for ``gs://`` (gcsfs names): ``endpoint_url`` or
``STORAGE_EMULATOR_HOST``, ``token`` (``"anon"``, a service-account JSON path,
``"google_default"``/``"cloud"``/absent → Google's default credentials),
``project`` (not needed for object calls).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: s3fs/gcsfs options that only tune fsspec's own caches or file objects;
#: they have no meaning for whole-object calls and are dropped.
_IGNORED_COMMON = frozenset(
    {
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "asynchronous",
        "loop",
    }
)
_IGNORED_S3 = _IGNORED_COMMON | {"max_concurrency", "fixed_upload_size"}
_IGNORED_GCS = _IGNORED_COMMON | {"project", "check_connection", "block_size", "cache_timeout"}

_S3_TRANSLATED = frozenset(
    {
        "key",
        "username",
        "secret",
        "password",
        "token",
        "endpoint_url",
        "use_ssl",
        "client_kwargs",
        "config_kwargs",
        "anon",
        "requester_pays",
        "version_aware",
        "cache_regions",
        "profile",
    }
)
_S3_CLIENT_KWARGS = frozenset(
    {
        "endpoint_url",
        "region_name",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "use_ssl",
        "verify",
    }
)
#: botocore Config fields that objckpt overrides anyway (timeouts, retries, pool size).
_S3_CONFIG_IGNORED = frozenset({"connect_timeout", "read_timeout", "retries", "max_pool_connections"})

_GCS_TRANSLATED = frozenset({"endpoint_url", "token"})
_GCS_DEFAULT_TOKENS = frozenset({"google_default", "cloud"})

#: Per kind, the options this module reads or drops that the fsspec client of that kind
#: (s3fs and botocore's session; gcsfs) names too. An open checks only the other options
#: against that client's signature (:func:`objckpt.storage.option_check.check_fsspec_options`),
#: so a store opened with these alone never imports s3fs, aiobotocore or gcsfs.
FSSPEC_NAMED = {
    "s3": _S3_TRANSLATED | _IGNORED_S3,
    "gcs": _GCS_TRANSLATED | (_IGNORED_GCS - {"default_block_size", "default_fill_cache", "default_cache_type"}),
}

_DEFAULT_REGION = "us-east-1"


class NotTranslatable(ValueError):
    """The options (or environment) need something only the fsspec adapter does."""


@dataclass(frozen=True)
class NativeSpec:
    """What to build: one obstore store per bucket, rooted at ``prefix`` inside it.

    ``config`` holds secrets: never log or ``repr`` it (excluded from ``repr``).
    """

    kind: str  # "s3" or "gcs"
    bucket: str
    prefix: str
    endpoint: str | None
    config: dict[str, Any] = field(repr=False)
    #: obstore ``credential_provider`` (credentials botocore reads for obstore), or None.
    credential_provider: Any = field(default=None, repr=False)
    #: obstore ``ClientConfig`` entries beyond timeouts: trusted CA, certificate checks.
    client: dict[str, Any] = field(default_factory=dict)


def split_bucket_url(url: str) -> tuple[str, str]:
    """``scheme://[user@]bucket/some/prefix?query`` → ``("bucket", "some/prefix")``."""
    _, sep, rest = url.partition("://")
    if not sep:
        raise ValueError("expected a scheme://bucket/prefix URL")
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    authority, _, path = rest.partition("/")
    bucket = authority.rsplit("@", 1)[-1]
    return bucket, path.strip("/")


def _unknown(options: Mapping[str, Any], translated: frozenset[str], ignored: frozenset[str]) -> list[str]:
    return sorted(k for k in options if k not in translated and k not in ignored)


def _first(*values: Any) -> Any:
    for value in values:
        if value not in (None, ""):
            return value
    return None


def _aws_files_in_use(environ: Mapping[str, str]) -> bool:
    """Whether botocore would take credentials or settings from profile files."""
    if environ.get("AWS_PROFILE") or environ.get("AWS_DEFAULT_PROFILE"):
        return True
    if environ.get("AWS_WEB_IDENTITY_TOKEN_FILE") or environ.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        return False  # botocore prefers these to the shared files, and obstore reads them
    if environ.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return False
    home = os.path.expanduser("~")
    paths = [
        environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"),
        environ.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
    ]
    return any(os.path.isfile(p) for p in paths)


def translate_s3(url: str, options: Mapping[str, Any], environ: Mapping[str, str], source: Any = None) -> NativeSpec:
    """s3fs options + ``AWS_*`` environment → an ``S3Store`` configuration.

    Args:
        url: ``s3://bucket/prefix`` (or ``s3a://``).
        options: s3fs storage options, without objckpt's own (``request_timeout``...).
        environ: Usually ``os.environ``.
        source: Where the credentials come from when the options name none
            (:class:`objckpt.storage.auth.credentials.S3Source`); without it, only
            the environment's static keys are translated and profile files are not.

    Raises:
        NotTranslatable: something only s3fs/botocore can honour (see module doc).
        ValueError: the URL has no bucket.
    """
    bucket, prefix = split_bucket_url(url)
    if not bucket:
        raise ValueError("S3 URL needs a bucket")
    unknown = _unknown(options, _S3_TRANSLATED, _IGNORED_S3)
    if unknown:
        raise NotTranslatable(f"s3fs option(s) {', '.join(unknown)}")
    if options.get("version_aware"):
        raise NotTranslatable("version_aware=True")
    client = dict(options.get("client_kwargs") or {})
    unknown = sorted(set(client) - _S3_CLIENT_KWARGS)
    if unknown:
        raise NotTranslatable(f"client_kwargs {', '.join(unknown)}")
    config_kwargs = dict(options.get("config_kwargs") or {})
    s3_section = dict(config_kwargs.pop("s3", None) or {})
    addressing = s3_section.pop("addressing_style", None)
    payload_signing = s3_section.pop("payload_signing_enabled", None)
    unknown = sorted((set(config_kwargs) - _S3_CONFIG_IGNORED - {"region_name"}) | set(s3_section))
    if unknown:
        raise NotTranslatable(f"config_kwargs {', '.join(unknown)}")

    config: dict[str, Any] = {}
    provider = None
    key = _first(options.get("key"), options.get("username"), client.get("aws_access_key_id"))
    secret = _first(options.get("secret"), options.get("password"), client.get("aws_secret_access_key"))
    token = _first(options.get("token"), client.get("aws_session_token"))
    anon = bool(options.get("anon"))
    if anon:
        config["skip_signature"] = True
    elif key or secret:
        if not (key and secret):
            raise NotTranslatable("an access key without its secret (or the reverse)")
        config["access_key_id"] = key
        config["secret_access_key"] = secret
        if token:
            config["session_token"] = token
    elif source is not None:
        config.update(source.config)
        provider = source.provider
    elif options.get("profile"):
        raise NotTranslatable("a profile option (read through botocore when the source is resolved)")
    elif environ.get("AWS_ACCESS_KEY_ID") and environ.get("AWS_SECRET_ACCESS_KEY"):
        config["access_key_id"] = environ["AWS_ACCESS_KEY_ID"]
        config["secret_access_key"] = environ["AWS_SECRET_ACCESS_KEY"]
        session = _first(environ.get("AWS_SESSION_TOKEN"), environ.get("AWS_SECURITY_TOKEN"))
        if session:
            config["session_token"] = session
    elif _aws_files_in_use(environ):
        raise NotTranslatable("credentials from an AWS profile or shared config file")

    endpoint = _first(
        options.get("endpoint_url"),
        client.get("endpoint_url"),
        environ.get("AWS_ENDPOINT_URL_S3"),
        environ.get("AWS_ENDPOINT_URL"),
    )
    use_ssl = options.get("use_ssl", client.get("use_ssl", True))
    if endpoint:
        endpoint = str(endpoint).rstrip("/")
        if "://" not in endpoint:
            endpoint = f"{'https' if use_ssl else 'http'}://{endpoint}"
        config["endpoint"] = endpoint
    elif not use_ssl:
        raise NotTranslatable("use_ssl=False without an endpoint")

    region = _first(
        client.get("region_name"),
        config_kwargs.get("region_name"),
        environ.get("AWS_REGION"),
        environ.get("AWS_DEFAULT_REGION"),
        getattr(source, "region", None),
    )
    if region is None and not endpoint:
        raise NotTranslatable("no region configured (s3fs discovers the bucket's region; set AWS_REGION)")
    config["region"] = region or _DEFAULT_REGION

    if addressing == "virtual":
        if endpoint:
            raise NotTranslatable("virtual-host addressing with a custom endpoint")
        config["virtual_hosted_style_request"] = True
    elif addressing in (None, "auto", "path"):
        config["virtual_hosted_style_request"] = False  # path style: every S3-compatible server has it
    else:
        raise NotTranslatable(f"addressing_style={addressing!r}")
    if options.get("requester_pays"):
        config["request_payer"] = True
    if payload_signing is None:
        # botocore's rule: no payload hash over HTTPS, where TLS guards the body
        # (and crc32c guards it end to end); hashing costs ~0.6 CPU-s per GiB.
        payload_signing = bool(endpoint and endpoint.startswith("http://"))
    config["unsigned_payload"] = not payload_signing
    ca_bundle = _first(environ.get("AWS_CA_BUNDLE"), environ.get("REQUESTS_CA_BUNDLE"))
    client_config = _trust(client.get("verify", True), ca_bundle)
    return NativeSpec("s3", bucket, prefix, endpoint, config, provider, client_config)


def _trust(verify: Any, ca_bundle: str | None) -> dict[str, Any]:
    """obstore ``ClientConfig`` entries for whom TLS trusts: botocore's ``verify`` (a CA
    bundle path, or False) or the bundle botocore reads from the environment
    (``AWS_CA_BUNDLE``, else ``REQUESTS_CA_BUNDLE``); else nothing, and obstore
    trusts the system roots, which ``SSL_CERT_FILE`` replaces. obstore adds a CA to its
    roots rather than replacing them."""
    if verify is False:
        return {"allow_invalid_certificates": True}
    path = verify if isinstance(verify, (str, os.PathLike)) else ca_bundle
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            return {"root_certificate": f.read()}
    except OSError as exc:
        raise ValueError(f"cannot read the CA bundle {os.fspath(path)!r}: {exc.strerror}") from exc


def translate_gcs(url: str, options: Mapping[str, Any], environ: Mapping[str, str]) -> NativeSpec:
    """gcsfs options + Google environment → a ``GCSStore`` configuration.

    Raises:
        NotTranslatable: e.g. a credentials object or an unknown gcsfs option.
        ValueError: the URL has no bucket.
    """
    bucket, prefix = split_bucket_url(url)
    if not bucket:
        raise ValueError("GCS URL needs a bucket")
    unknown = _unknown(options, _GCS_TRANSLATED, _IGNORED_GCS)
    if unknown:
        raise NotTranslatable(f"gcsfs option(s) {', '.join(unknown)}")
    config: dict[str, Any] = {}
    endpoint = options.get("endpoint_url")
    token = options.get("token")
    emulator = environ.get("STORAGE_EMULATOR_HOST", "")
    if not endpoint and emulator and emulator != "default":
        endpoint = emulator if "://" in emulator else f"http://{emulator}"
        if token is None:
            token = "anon"
    if endpoint:
        endpoint = str(endpoint).rstrip("/")
        config["base_url"] = endpoint
    if token == "anon":
        config["skip_signature"] = True
    elif token is None or (isinstance(token, str) and token in _GCS_DEFAULT_TOKENS):
        credentials = environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        if credentials:
            config["application_credentials"] = credentials
    elif isinstance(token, (str, os.PathLike)) and os.path.isfile(token):
        config["service_account"] = os.fspath(token)
    else:
        raise NotTranslatable("a gcsfs token that is not 'anon', a default, or a service-account file")
    return NativeSpec("gcs", bucket, prefix, endpoint, config)
