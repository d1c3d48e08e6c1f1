"""Vendor errors → objckpt's store errors, by type, HTTP status and the service's error code, never by wording.

Every store adapter funnels what its library raised through one function
here, so the transfer engine can decide retries by exception type alone:

* missing → :class:`ObjectNotFoundError`; a missing bucket (the service's
  ``NoSuchBucket``) → :class:`BucketNotFoundError`, which no caller reads as "nothing here";
* a failed create-if-absent → :class:`ObjectExistsError`;
* 401/403 (``AccessDenied``, ``InvalidAccessKeyId``, ``SignatureDoesNotMatch``, a
  metadata service refusing credentials), missing credentials → :class:`StorePermissionError`;
* 429/503 (the store asks the client to slow down) → :class:`ThrottledError`;
* 408/5xx, connection errors, timeouts → :class:`TransientStoreError`;
* anything else → :class:`StoreError`.

:func:`map_error` covers fsspec filesystems (s3fs/botocore, gcsfs/aiohttp,
requests, local OS errors); :func:`map_obstore_error` covers obstore, whose
exception classes already carry the category. Messages are scrubbed of
URL credentials, and a service's error body (S3's XML, GCS's JSON) is shown
as its code and message only (:func:`service_detail`), never as raw markup;
an obstore error is chained as the cause without it (:func:`redacted_cause`).
"""

from __future__ import annotations

import html
import re
import sys
from typing import Any

from objckpt.errors import (
    BucketNotFoundError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
    StorePermissionError,
    ThrottledError,
    TransientStoreError,
)
from objckpt.logs import redact_text
from objckpt.storage.urls import scrub

#: Bugs, not storage failures: never disguised as a StoreError.
PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, AssertionError, MemoryError)
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: "Slow down": S3 answers 503 SlowDown, GCS and S3 429 when a client exceeds a rate.
THROTTLE_STATUS = frozenset({429, 503})


def transient_error(status: int | None, message: str) -> TransientStoreError:
    """The retryable error for ``status``: :class:`ThrottledError` when it asks us to slow down."""
    return ThrottledError(message) if status in THROTTLE_STATUS else TransientStoreError(message)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status behind ``exc``, looking through its ``__cause__`` chain.

    s3fs raises plain ``OSError`` with the botocore ``ClientError`` as cause
    (status at ``response["ResponseMetadata"]["HTTPStatusCode"]``); aiohttp
    errors carry ``.status``; gcsfs's ``HttpError`` carries ``.code``.
    """
    gcsfs_retry = sys.modules.get("gcsfs.retry")
    http_error = getattr(gcsfs_retry, "HttpError", None)
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 8:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
        elif response is not None:
            status = getattr(response, "status_code", None) or getattr(response, "status", None)
            if isinstance(status, int) and 100 <= status < 600:
                return status
        status = getattr(cur, "status", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
        if http_error is not None and isinstance(cur, http_error):
            code = getattr(cur, "code", None)
            if isinstance(code, int):
                return code
        cur = cur.__cause__
    return None


def _transient_types() -> tuple[type[BaseException], ...]:
    """Connection-level error types of the HTTP stacks that are loaded."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    botocore_exc = sys.modules.get("botocore.exceptions")
    if botocore_exc is not None:
        for name in ("HTTPClientError", "ResponseStreamingError", "IncompleteReadError"):
            cls = getattr(botocore_exc, name, None)
            if isinstance(cls, type):
                types.append(cls)
    requests_exc = sys.modules.get("requests.exceptions")
    if requests_exc is not None:  # gcsfs turns a 502 into requests' ProxyError
        types += [requests_exc.ConnectionError, requests_exc.Timeout, requests_exc.ChunkedEncodingError]
    return tuple(types)


def _permission_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [PermissionError]
    botocore_exc = sys.modules.get("botocore.exceptions")
    if botocore_exc is not None:
        types.append(botocore_exc.NoCredentialsError)
    google_auth = sys.modules.get("google.auth.exceptions")
    if google_auth is not None:
        types.append(google_auth.DefaultCredentialsError)
    return tuple(types)


_CERTIFICATE = re.compile(
    r"InvalidCertificate\(\s*(\w+)|CERTIFICATE_VERIFY_FAILED\]? ?certificate verify failed: ([^()'\"]{1,80})"
)


def untrusted_certificate(exc: BaseException, what: str) -> StoreError | None:
    """A permanent error saying how to trust the server, if ``exc`` is a failed TLS
    certificate check (retrying cannot help); else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:  # the cause chain: requests/aiohttp wrap ssl's error
        seen.add(id(current))
        match = _CERTIFICATE.search(str(current))
        if match:
            reason = match.group(1) or match.group(2).strip()
            return StoreError(
                f"{what} failed: the server's TLS certificate is not trusted ({reason}). Trust its CA with "
                "AWS_CA_BUNDLE, REQUESTS_CA_BUNDLE or SSL_CERT_FILE (S3), REQUESTS_CA_BUNDLE (GCS), or the storage options "
                "(client_kwargs={'verify': CA_FILE} for S3, ca_bundle=CA_FILE for GCS)"
            )
        current = current.__cause__ or current.__context__
    return None


def map_error(exc: BaseException, what: str, *, create: bool = False) -> StoreError:
    """Translate a filesystem/HTTP error into objckpt's store errors.

    Args:
        exc: What the filesystem raised.
        what: Operation and full object URL for the message, e.g.
            ``"get s3://bucket/ckpt/manifest.json"``.
        create: The failed call was a create-if-absent put (412 = exists).
    """
    if isinstance(exc, StoreError):
        return exc
    untrusted = untrusted_certificate(exc, what)
    if untrusted is not None:
        return untrusted
    status = http_status(exc)
    detail = scrub(_client_error_detail(exc) or f"{type(exc).__name__}: {service_detail(str(exc))}")
    suffix = f" (HTTP {status})" if status else ""
    message = f"{what} failed{suffix}: {detail}"
    if create and (isinstance(exc, FileExistsError) or status == 412):
        return ObjectExistsError(f"{what}: object already exists")
    code = _client_error_code(exc)
    if code in BUCKET_MISSING_CODES:
        return BucketNotFoundError(_no_bucket(what, status, code))
    if status == 404 or isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return ObjectNotFoundError(f"{what}: no such object")
    if status in (401, 403):
        found = _client_error_detail(exc) or service_detail(str(exc))  # botocore's code, or gcsfs's message
        return StorePermissionError(
            scrub(f"{what} failed: access denied (HTTP {status}{f': {found}' if found else ''})")
        )
    if isinstance(exc, _permission_types()):
        return StorePermissionError(message)
    if status in TRANSIENT_STATUS or (create and status == 409):
        # 409 on a conditional PUT: another conditional write to the same key
        # is in flight (S3 ConditionalRequestConflict); a retry sees 412 or wins.
        return transient_error(status, message)
    if status is None and isinstance(exc, _transient_types()):
        return TransientStoreError(message)
    if isinstance(exc, RuntimeError) and _EXPIRED_ON_ARRIVAL in str(exc):
        # botocore fetched credentials that lapsed as they came (a refresh that met the
        # source's rotation): the next attempt fetches the new ones.
        return TransientStoreError(message)
    return StoreError(message)


#: What botocore says when credentials it has just refreshed have already expired.
_EXPIRED_ON_ARRIVAL = "refreshed credentials are still expired"


#: Where a service's error body starts inside a library's message.
_BODY_START = re.compile(r"<\?xml|<Error\b|\{\s*\"error\"")
_XML_FIELD = re.compile(r"<(Code|Message)>([^<]{0,500})</(?:Code|Message)>")
_JSON_MESSAGE = re.compile(r'"message"\s*:\s*"((?:[^"\\]|\\.){0,500})"')
_JSON_STATUS = re.compile(r'"status"\s*:\s*"([A-Za-z_]{1,64})"')
_JSON_CODE = re.compile(r'"code"\s*:\s*(\d{3})')
_DETAIL_LIMIT = 400


def _body_fields(text: str) -> list[str]:
    """The error code and message of an S3 XML or GCS JSON error body inside ``text``."""
    fields: dict[str, str] = {}
    for name, value in _XML_FIELD.findall(text):
        fields.setdefault(name, html.unescape(value).strip())
    if not fields:
        status = _JSON_STATUS.search(text) or _JSON_CODE.search(text)
        message = _JSON_MESSAGE.search(text)
        if status:
            fields["Code"] = status.group(1)
        if message:
            fields["Message"] = message.group(1).replace('\\"', '"')
    return [fields[k] for k in ("Code", "Message") if fields.get(k)]


def service_detail(text: str) -> str:
    """A library's error message without the service's raw error body: its first line up
    to where the body starts, then the body's code and message (S3 ``<Code>``/``<Message>``,
    GCS JSON ``status``/``message``), e.g. ``"... 403 Forbidden: AccessDenied: Access Denied"``.

    obstore appends the body and a multi-line Rust debug dump (which repeats it) to its
    first line; only the part before the dump is read.
    """
    shown = text.split("\n\nDebug source:", 1)[0].strip()
    lines = shown.splitlines()
    head = lines[0] if lines else ""
    start = _BODY_START.search(head)
    if start is not None:
        head = head[: start.start()]
    head = head.rstrip().rstrip(":").rstrip()
    body = _BODY_START.search(shown)
    fields = _body_fields(shown[body.start() :]) if body is not None else []
    detail = ": ".join([head, *fields]) if head else ": ".join(fields)
    return detail[:_DETAIL_LIMIT]


def _client_error(exc: BaseException) -> dict[str, Any] | None:
    """The ``Error`` part of a botocore ``ClientError``'s response in ``exc``'s cause chain, or None."""
    cur: BaseException | None = exc
    for _ in range(8):
        if cur is None:
            return None
        response = getattr(cur, "response", None)
        error = response.get("Error") if isinstance(response, dict) else None
        if isinstance(error, dict):
            return error
        cur = cur.__cause__
    return None


def _client_error_code(exc: BaseException) -> str | None:
    """The service's error code of a botocore ``ClientError`` in ``exc``'s cause chain, or None."""
    error = _client_error(exc)
    return None if error is None else str(error.get("Code") or "") or None


#: Service error codes of a bucket that does not exist (S3, S3-compatible servers, GCS's XML API).
BUCKET_MISSING_CODES = frozenset({"NoSuchBucket"})


def _bucket_of(what: str) -> str:
    """The bucket named by the URL in ``what`` (``"list s3://bucket/x"`` → ``"bucket"``), or ``""``."""
    _, sep, rest = what.partition("://")
    return rest.split("/", 1)[0].split(" ", 1)[0].rsplit("@", 1)[-1] if sep else ""


def _no_bucket(what: str, status: int | None, code: str) -> str:
    answer = f"HTTP {status} {code}" if status else code
    return f"{what} failed: the bucket {_bucket_of(what)!r} does not exist ({answer})"


def _client_error_detail(exc: BaseException) -> str | None:
    """``"Code: Message"`` of a botocore ``ClientError`` in ``exc``'s cause chain (s3fs raises
    a plain ``OSError`` carrying only the message), or None; numeric codes (a HEAD's
    body-less ``"403"``) say nothing the status does not."""
    error = _client_error(exc)
    if error is None:
        return None
    code, message = str(error.get("Code") or ""), str(error.get("Message") or "")
    if code and not code.isdigit():
        return f"{code}: {message}" if message else code
    return None


_OBSTORE_STATUS = re.compile(r"\bstatus: (\d{3}),")


def _obstore_status(exc: BaseException) -> int | None:
    """The HTTP status in an obstore error's debug dump (``inner: Status { status: 503, ...``).

    obstore attaches no status to its exceptions, so this one reading of their
    text is used only to pace requests (a 429/503 lowers the window of requests
    in flight); whether to retry is still decided by the exception's class. If
    obstore's format changes, throttling answers are retried at full concurrency,
    which ``tests/test_throttle.py`` would catch.
    """
    found = _OBSTORE_STATUS.search(str(exc))
    return int(found.group(1)) if found else None


_REQUEST = re.compile(r"Error performing (\w+) (\S+) in ")
#: Paths of the credential services obstore asks (EC2 instance metadata, ECS/EKS container
#: credentials): a refusal there means no credentials, whatever the store would have said.
_CREDENTIAL_PATHS = re.compile(r"^https?://[^/]+/(latest/(api/token|meta-data/iam)|v2/credentials|v1/credentials)")


#: Refusals that fresh credentials cure: obstore asks its credential provider again, so these retry.
_REFRESHED_CODES = frozenset({"ExpiredToken", "TokenRefreshRequired"})
_XML_CODE = re.compile(r"<Code>([^<]{1,128})</Code>")


def _service_code(text: str) -> str | None:
    """The error code of the service's S3 XML error body inside an obstore message, or None."""
    head = text.split("\n\nDebug source:", 1)[0]
    found = _XML_CODE.search(head)
    return found.group(1).strip() if found else None


def _denied(exc: BaseException, what: str, status: int | None) -> StorePermissionError:
    """A refused request, said in one line: the service's code and message when its body has
    them, and the credential service when it was the one refusing (an instance metadata
    service answering 403 to the token request, say); no request timings, no debug dump."""
    text = str(exc)
    head = text.split("\n\nDebug source:", 1)[0]
    body = _BODY_START.search(head)
    fields = _body_fields(head[body.start() :]) if body is not None else []
    answer = " ".join(p for p in (f"HTTP {status}" if status else "", ": ".join(fields)) if p)
    requests = _REQUEST.findall(head.split("\n", 1)[0])
    if requests and _CREDENTIAL_PATHS.match(requests[-1][1]):
        method, url = requests[-1]
        return StorePermissionError(
            scrub(
                f"{what} failed: no credentials: the credential service refused {method} {url} ({answer or 'denied'})"
            )
        )
    return StorePermissionError(scrub(f"{what} failed: access denied ({answer or type(exc).__name__})"))


def redacted_cause(exc: BaseException) -> BaseException:
    """``exc`` made again, to chain as a mapped error's cause, without the service's answer
    (:func:`service_detail`), URL credentials or secret-looking values: obstore's text holds
    the whole body, and AWS's ``SignatureDoesNotMatch`` echoes the signed request in it."""
    text = str(exc)
    if _BODY_START.search(text) or "body: Some(" in text:
        text = service_detail(text)
    text = redact_text(scrub(text))
    try:
        return type(exc)(text)
    except Exception:  # a class that is not made from a message
        return StoreError(f"{type(exc).__name__}: {text}")


def map_obstore_error(exc: BaseException, what: str, *, create: bool = False) -> StoreError:
    """Translate what obstore raised into objckpt's store errors, by class.

    obstore gives each outcome its own class, except that every HTTP failure
    without one (5xx, 429, connection reset, timeout, and the rare permanent
    400) arrives as ``GenericError`` with no status attached. objckpt turns
    obstore's own retries off, so ``GenericError`` is treated as transient:
    the transfer engine's bounded retries then decide, and a permanent one
    costs only a few backoffs. Callers handle "range starts past the end"
    (also a ``GenericError``) before mapping.

    Refusals no retry can cure are the exceptions, decided by the status and
    the service's error code obstore carries in its message (as for throttling,
    :func:`_obstore_status`): a 401/403 (a listing refused for a wrong secret,
    an instance metadata service refusing the token request) is a
    :class:`StorePermissionError`, and ``NoSuchBucket`` (on any call) a
    :class:`BucketNotFoundError`.

    Args:
        exc: What obstore raised.
        what: Operation and full object URL for the message.
        create: The failed call was a create-if-absent put.
    """
    if isinstance(exc, StoreError):
        return exc
    untrusted = untrusted_certificate(exc, what)
    if untrusted is not None:
        return untrusted
    message = f"{what} failed: {scrub(f'{type(exc).__name__}: {service_detail(str(exc))}')}"
    status = _obstore_status(exc)
    code = _service_code(str(exc))
    if code in BUCKET_MISSING_CODES:  # on a listing (GenericError) or a read (FileNotFoundError)
        return BucketNotFoundError(_no_bucket(what, status, code))
    oe = sys.modules.get("obstore.exceptions")
    if oe is not None and isinstance(exc, oe.BaseError):
        if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)) or (
            isinstance(exc, oe.GenericError) and status in (401, 403) and code not in _REFRESHED_CODES
        ):
            return _denied(exc, what, status)
        if isinstance(exc, (oe.AlreadyExistsError, oe.PreconditionError)):
            if create:
                # S3 412 (and 409 ConditionalRequestConflict, which obstore also
                # reports as AlreadyExists), GCS 412, an existing local file.
                return ObjectExistsError(f"{what}: object already exists")
            if isinstance(exc, oe.AlreadyExistsError):
                return TransientStoreError(message)  # a 409 on a plain PUT: a conflicting write in flight
            return StoreError(message)
        if isinstance(exc, oe.NotFoundError):
            return ObjectNotFoundError(f"{what}: no such object")
        if isinstance(exc, (oe.GenericError, oe.JoinError)):
            return transient_error(status, message)
        return StoreError(message)  # InvalidPath, NotSupported, NotModified, UnknownConfigurationKey
    # obstore raises some built-ins itself (FileNotFoundError for a missing
    # object); local stores raise OS errors.
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return ObjectNotFoundError(f"{what}: no such object")
    if create and isinstance(exc, FileExistsError):
        return ObjectExistsError(f"{what}: object already exists")
    if isinstance(exc, PermissionError):
        return StorePermissionError(message)
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return TransientStoreError(message)
    return StoreError(message)
