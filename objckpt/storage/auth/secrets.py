"""The secret values a cloud store's credential sources hold, so they are redacted from every log by value.

The client libraries log what they send and receive at DEBUG (botocore the
STS request with the web identity token in it, google-auth token exchanges),
and :mod:`objckpt.logs` masks what looks like a credential. A shape can miss
a value (an opaque token, one with a quote in it, a secret inside an
exception's text); the value itself cannot be missed. So when a store opens,
:func:`credential_secrets` reads what the sources of its URL's scheme hold,
the way the clients will read them, and the opener hands the values to
:func:`objckpt.logs.remember_secrets` (docs/CREDENTIALS.md, "Debug logs", lists them:
the secret keys and tokens of the environment, of every profile of the shared files and of
the SSO cache, Google key files' private keys and tokens, credential-named storage options).

Credentials fetched later (STS, IMDS, ECS answers, Google access tokens) are
remembered where objckpt sees them (:class:`~objckpt.storage.auth.credentials.BotocoreCredentials`),
and otherwise masked by shape. Reading is best-effort: a file that is
missing, unreadable, too large or malformed is skipped, and nothing here ever
fails an open or shows a value.
"""

from __future__ import annotations

import configparser
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

#: Files larger than this are not read (a token, a key file or a cache entry is a few KiB).
MAX_FILE_BYTES = 1 << 20
_SECRET_OPTIONS = frozenset(
    {"secret", "token", "password", "aws_secret_access_key", "aws_session_token", "session_token",
     "secret_access_key", "secret_key", "client_secret", "refresh_token", "access_token", "private_key"}
)  # fmt: skip
#: gcsfs ``token`` values that name a method, not a secret.
_TOKEN_METHODS = frozenset({"anon", "google_default", "cloud", "browser", "cache"})
_AWS_PROFILE_SECRETS = ("aws_secret_access_key", "aws_session_token", "aws_security_token")
_GOOGLE_SECRETS = ("private_key", "client_secret", "refresh_token")
_SSO_SECRETS = ("accessToken", "refreshToken", "clientSecret")


def credential_secrets(scheme: str, options: Mapping[str, Any], environ: Mapping[str, str]) -> list[str]:
    """The secret values the credential sources of a ``scheme`` store hold (see the module docstring)."""
    found = list(_option_secrets(options))
    if scheme in ("s3", "s3a"):
        found += _aws_secrets(environ)
    elif scheme in ("gs", "gcs"):
        found += _google_secrets(options, environ)
    return [value for value in found if isinstance(value, str) and value.strip()]


def _read(path: str | os.PathLike[str] | None) -> str | None:
    if not path:
        return None
    try:
        file = Path(os.path.expanduser(os.fspath(path)))
        if not file.is_file() or file.stat().st_size > MAX_FILE_BYTES:
            return None
        return file.read_text(errors="replace")
    except (OSError, ValueError):
        return None


def _option_secrets(options: Mapping[str, Any]) -> Iterator[str]:
    for key, value in options.items():
        if isinstance(value, Mapping):
            yield from _option_secrets(value)
        elif isinstance(value, str) and str(key).lower() in _SECRET_OPTIONS:
            if str(key).lower() == "token" and (value in _TOKEN_METHODS or os.path.isfile(value)):
                continue  # a method or a key file (read by _google_secrets), not a secret itself
            yield value


def _home(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("HOME") or os.path.expanduser("~"))


def _aws_secrets(environ: Mapping[str, str]) -> Iterator[str]:
    for name in (
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    ):
        if environ.get(name):
            yield environ[name]
    for name in ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"):
        text = _read(environ.get(name))
        if text:
            yield text
    home = _home(environ)
    files = (
        environ.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials",
        environ.get("AWS_CONFIG_FILE") or home / ".aws" / "config",
    )
    for path in files:
        yield from _profile_secrets(_read(path))
    cache = home / ".aws" / "sso" / "cache"
    try:
        entries = sorted(cache.glob("*.json"))[:64] if cache.is_dir() else []
    except OSError:
        entries = []
    for entry in entries:
        yield from _json_fields(_read(entry), _SSO_SECRETS)


def _profile_secrets(text: str | None) -> Iterator[str]:
    if not text:
        return
    parser = configparser.RawConfigParser()
    try:
        parser.read_string(text)
    except configparser.Error:
        return
    for section in parser.sections():
        for key in _AWS_PROFILE_SECRETS:
            if parser.has_option(section, key):
                yield parser.get(section, key)
        if parser.has_option(section, "web_identity_token_file"):
            token = _read(parser.get(section, "web_identity_token_file"))
            if token:
                yield token


def _json_fields(text: str | None, names: tuple[str, ...]) -> Iterator[str]:
    if not text:
        return
    try:
        info = json.loads(text)
    except ValueError:
        return
    if isinstance(info, dict):
        yield from (info[name] for name in names if isinstance(info.get(name), str))


def _google_secrets(options: Mapping[str, Any], environ: Mapping[str, str]) -> Iterator[str]:
    token = options.get("token")
    infos: list[Any] = []
    if isinstance(token, Mapping):
        infos.append(dict(token))
    elif isinstance(token, (str, os.PathLike)) and os.path.isfile(token):
        infos.append(_load(_read(token)))
    infos.append(_load(_read(environ.get("GOOGLE_APPLICATION_CREDENTIALS"))))
    gcloud = environ.get("CLOUDSDK_CONFIG") or _home(environ) / ".config" / "gcloud"
    infos.append(_load(_read(Path(gcloud) / "application_default_credentials.json")))
    for info in infos:
        if not isinstance(info, dict):
            continue
        yield from (info[name] for name in _GOOGLE_SECRETS if isinstance(info.get(name), str))
        source = info.get("credential_source")
        if isinstance(source, Mapping):
            subject = _read(source.get("file"))
            if subject:
                yield subject
                shape = source.get("format")
                field = shape.get("subject_token_field_name") if isinstance(shape, Mapping) else None
                if isinstance(field, str):
                    yield from _json_fields(subject, (field,))


def _load(text: str | None) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None
