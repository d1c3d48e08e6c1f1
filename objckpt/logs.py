"""Keeping credentials out of the log records of the clients objckpt drives.

botocore, aiobotocore, s3fs, gcsfs, google-auth, urllib3 and their kin log
request and response bodies at DEBUG: an STS exchange carries the web identity
token out and a secret key and session token back, a token endpoint answers
with a bearer token. A process that logs at DEBUG (``logging.basicConfig(
level=DEBUG)``, ``objckpt --debug``) would print them.

objckpt is a guest in its user's process, so it neither re-levels nor drops
anyone's records. When it opens a store it adds one :class:`RedactingFilter`
to each logger of those clients (:data:`CLIENT_LOGGERS`, and the loggers
below them that exist by then or are named in :data:`_EMITTERS`): the filter
rewrites secret-looking values in a record's message to ``***`` and passes
every record on. Python applies a logger's filters only to records logged on
that very logger, hence one filter per logger, not one per package.
:func:`redact_client_logs` turns this off (and on again).

What counts as secret-looking (:func:`redact_text`): the values of
credential-named fields (``SecretAccessKey``, ``SessionToken``,
``WebIdentityToken``, ``X-Amz-Security-Token``, ``Authorization``,
``access_token``, ``assertion``, ``client_secret``, ...) in the shapes these
libraries log them (XML elements, dicts, JSON, form bodies, headers, query
strings), bearer tokens, JWTs, Google access and refresh tokens and PEM private
keys. Nothing here talks to a server: it is text matching, written by hand
because no logging library does it.

Shapes miss what they do not know (an opaque web identity token, a token with
a quote in it, a secret quoted in an exception), so the secrets themselves are
redacted too, by value, wherever they show (the message and the rendered
exception of a record): when a store opens, objckpt reads what its credential
sources hold (:mod:`objckpt.storage.auth.secrets`: the web identity token
file, shared credential and SSO cache files, service-account and
``authorized_user`` keys, external-account subject tokens, ...) and
:func:`remember_secrets` keeps the values, in memory only, for every
:class:`RedactingFilter` of the process.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable

#: Packages whose loggers can carry credentials, and whose loggers objckpt filters.
CLIENT_LOGGERS = (
    "aiobotocore",
    "aiohttp",
    "boto3",
    "botocore",
    "fsspec",
    "gcsfs",
    "google.auth",
    "google.cloud",
    "google.oauth2",
    "google.resumable_media",
    "google_auth_httplib2",
    "oauthlib",
    "requests",
    "requests_oauthlib",
    "s3fs",
    "s3transfer",
    "urllib3",
)

#: Loggers of those packages that log requests, responses or credentials, filtered even
#: before their module is imported (``logging.getLogger`` makes the logger the module will
#: later fetch): a store's first credential fetch happens while it opens.
_EMITTERS = (
    "aiobotocore.credentials",
    "aiobotocore.endpoint",
    "aiobotocore.utils",
    "botocore.auth",
    "botocore.awsrequest",
    "botocore.client",
    "botocore.credentials",
    "botocore.endpoint",
    "botocore.hooks",
    "botocore.httpsession",
    "botocore.parsers",
    "botocore.retryhandler",
    "botocore.utils",
    "gcsfs.core",
    "gcsfs.credentials",
    "google.auth._default",
    "google.auth._helpers",
    "google.auth.compute_engine._metadata",
    "google.auth.external_account",
    "google.auth.identity_pool",
    "google.auth.transport._aiohttp_requests",
    "google.auth.transport.requests",
    "google.auth.transport.urllib3",
    "google.oauth2._client",
    "requests_oauthlib.oauth2_session",
    "s3fs.core",
    "urllib3.connectionpool",
)

_MASK = "***"
_FIELD = (
    r"(?:aws_)?(?:secret_?access_?key|session_?token|security_?token|web_?identity_?token|"
    r"x-amz-security-token|x-amz-signature|x-aws-ec2-metadata-token|x-goog-iam-authorization-token|"
    r"client_?secret|refresh_?token|access_?token|id_?token|subject_?token|private_?key|assertion|"
    r"password|passwd|secret|token|signature|authorization)"
)
_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # PEM private keys, whole (also with literal "\n" escapes, as in a JSON key file's repr)
    (
        re.compile(r"-----BEGIN ([A-Z ]*)PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.S),
        r"-----BEGIN \1PRIVATE KEY-----***-----END \1PRIVATE KEY-----",
    ),
    # <SecretAccessKey>...</SecretAccessKey>, <SessionToken>, <WebIdentityToken>, <Token>, ...
    (re.compile(r"<(\w*(?:secret|token|password|signature)\w*)>[^<]+</\1>", re.I), r"<\1>***</\1>"),
    # field: value, 'field': 'value', "field":"value", field=value (forms, query strings, headers)
    (
        re.compile(
            rf"(?<![A-Za-z0-9])({_FIELD})(\\?[\"']?\s*[:=]\s*(?:b?\\?(?P<q>[\"']))?)"
            r"(?!(?:None|True|False|null|true|false)\b)(?(q)[^\"'\\\n]+|(?:(?:Bearer|Basic)\s+)?[^\s\"'&,;<>\\)}\]]+)",
            re.I,
        ),
        r"\1\2***",
    ),
    (re.compile(r"\b(Bearer|Basic)\s+[\w.~+/=-]{4,}", re.I), r"\1 ***"),
    (re.compile(r"\beyJ[\w-]{2,}\.[\w-]{2,}\.[\w-]*"), _MASK),  # JWTs: assertions, web identity tokens
    (re.compile(r"\bya29\.[\w.-]+"), "ya29." + _MASK),  # Google access tokens
    (re.compile(r"\b1//[\w-]{10,}"), "1//" + _MASK),  # Google refresh tokens
]


#: The shortest value :func:`remember_secrets` keeps (shorter ones would mask ordinary words).
MIN_REMEMBERED = 8
_remembered: tuple[str, ...] = ()  # longest first; replaced whole, never mutated (read without the lock)


def _spellings(value: str) -> set[str]:
    """``value`` as a log line may carry it: as is, stripped, escaped as ``repr`` and JSON escape
    it, percent-encoded as in a form body, and each long line of a multi-line value (a PEM key)."""
    import json
    import urllib.parse

    stripped = value.strip()
    found = {value, stripped, repr(stripped)[1:-1], json.dumps(stripped)[1:-1]}
    found.add(urllib.parse.quote_plus(stripped))
    found.add(urllib.parse.quote(stripped, safe=""))
    if "\n" in stripped or "\n" in value:
        found.update(line.strip() for line in stripped.splitlines())
    return {s for s in found if len(s) >= MIN_REMEMBERED}


def remember_secrets(values: Iterable[str]) -> None:
    """Redact each of ``values`` (and its escaped spellings) from every client record from now on.

    For the credentials objckpt reads from a credential source when a store
    opens; values shorter than :data:`MIN_REMEMBERED` characters are ignored.
    Kept in this process's memory only, and never shown.
    """
    global _remembered
    new: set[str] = set()
    for value in values:
        if isinstance(value, str) and len(value.strip()) >= MIN_REMEMBERED:
            new.update(_spellings(value))
    with _lock:
        if new - set(_remembered):
            _remembered = tuple(sorted(set(_remembered) | new, key=len, reverse=True))


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with secret-looking values, each of ``secrets`` and each remembered secret
    (:func:`remember_secrets`) replaced by ``***``."""
    for secret in sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, _MASK)
    for secret in _remembered:
        if secret in text:
            text = text.replace(secret, _MASK)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class RedactingFilter(logging.Filter):
    """A filter that rewrites secret-looking values of a record's message and keeps every record.

    The record's message is formatted once (``msg % args``) and, if anything
    was redacted, replaces ``msg`` with ``args`` emptied; an exception the
    record carries is rendered as the standard formatter renders it and, if
    anything in it was redacted, set as the record's ``exc_text`` (which
    formatters print instead of rendering it again); records without a secret
    pass untouched.

    Args:
        secrets: Exact values to redact besides the secret-looking ones
            (credentials a caller knows, such as those given on a command line).
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(secrets)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is its logger's business, not ours
            return True
        clean = redact_text(message, self.secrets)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and record.exc_info[0] is not None:
            try:
                rendered = record.exc_text or _RENDER.formatException(record.exc_info)
            except Exception:  # an exception that cannot render is its logger's business
                return True
            scrubbed = redact_text(rendered, self.secrets)
            if scrubbed != rendered:
                record.exc_text = scrubbed
        return True


_RENDER = logging.Formatter()


_FILTER = RedactingFilter()
_lock = threading.Lock()
_enabled = True


def guard_client_loggers() -> None:
    """Add the redacting filter to every client logger (see the module docstring); idempotent.

    objckpt calls this when it opens a store, before and after the client is
    made, so that loggers of modules the opening imported are covered too.
    Does nothing after ``redact_client_logs(False)``.
    """
    with _lock:
        if not _enabled:
            return
        for logger in _client_loggers(create=True):
            logger.addFilter(_FILTER)  # a no-op where it is already there


def redact_client_logs(enabled: bool = True) -> None:
    """Turn the redaction of client loggers on (the default) or off.

    Off removes objckpt's filter from every logger it was added to, and stops
    objckpt adding it again: for a process that wants the clients' records
    exactly as they log them (secrets included).
    """
    global _enabled
    with _lock:
        _enabled = enabled
    if enabled:
        guard_client_loggers()
        return
    with _lock:
        for logger in _client_loggers(create=False):
            logger.removeFilter(_FILTER)


def _client_loggers(*, create: bool) -> list[logging.Logger]:
    """The loggers under :data:`CLIENT_LOGGERS` that exist now (and :data:`_EMITTERS`, made if ``create``)."""
    names = set(CLIENT_LOGGERS)
    if create:
        names.update(_EMITTERS)
    prefixes = tuple(f"{name}." for name in CLIENT_LOGGERS)
    existing = logging.Logger.manager.loggerDict
    names.update(name for name in list(existing) if name.startswith(prefixes))
    return [
        logging.getLogger(name) for name in sorted(names) if create or isinstance(existing.get(name), logging.Logger)
    ]
