"""Vendor errors → objckpt's store errors, by type and HTTP status, never by text.

Every store adapter funnels what its library raised through one function
here, so the transfer engine can decide retries by exception type alone:

* missing → :class:`ObjectNotFoundError`;
* a failed create-if-absent → :class:`ObjectExistsError`;
* 401/403, missing credentials → :class:`StorePermissionError`;
* 429/503 (the store asks the client to slow down) → :class:`ThrottledError`;
* 408/5xx, connection errors, timeouts → :class:`TransientStoreError`;
* anything else → :class:`StoreError`.

:func:`map_error` covers fsspec filesystems (s3fs/botocore, gcsfs/aiohttp,
requests, local OS errors); :func:`map_obstore_error` covers obstore, whose
exception classes already carry the category. Messages are scrubbed of
URL credentials.
"""

from __future__ import annotations

import re
import sys

from objckpt.errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
    StorePermissionError,
    ThrottledError,
    TransientStoreError,
)
from objckpt.storage.urls import scrub

#: Bugs, not storage failures: never disguised as a StoreError.
PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, AssertionError, MemoryError)
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: "Slow down": S3 answers 503 SlowDown, GCS and S3 429 when a client exceeds a rate.
THROTTLE_STATUS = frozenset({429, 503})


def transient_error(status: int | None, message: str) -> TransientStoreError:
    """The retryable error for ``status``: :class:`ThrottledError` when it asks us to slow down."""
    return ThrottledError(message) if status in THROTTLE_STATUS else TransientStoreError(message)


# ------------------------------------------------------------------- fsspec


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
    status = http_status(exc)
    detail = scrub(f"{type(exc).__name__}: {exc}")
    suffix = f" (HTTP {status})" if status else ""
    message = f"{what} failed{suffix}: {detail}"
    if create and (isinstance(exc, FileExistsError) or status == 412):
        return ObjectExistsError(f"{what}: object already exists")
    if status == 404 or isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return ObjectNotFoundError(f"{what}: no such object")
    if status in (401, 403) or isinstance(exc, _permission_types()):
        return StorePermissionError(message)
    if status in TRANSIENT_STATUS or (create and status == 409):
        # 409 on a conditional PUT: another conditional write to the same key
        # is in flight (S3 ConditionalRequestConflict); a retry sees 412 or wins.
        return transient_error(status, message)
    if status is None and isinstance(exc, _transient_types()):
        return TransientStoreError(message)
    return StoreError(message)


# ------------------------------------------------------------------ obstore


def _first_line(exc: BaseException) -> str:
    # obstore appends a multi-line Rust debug dump; the first line says what happened.
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


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


def map_obstore_error(exc: BaseException, what: str, *, create: bool = False) -> StoreError:
    """Translate what obstore raised into objckpt's store errors, by class.

    obstore gives each outcome its own class, except that every HTTP failure
    without one (5xx, 429, connection reset, timeout, and the rare permanent
    400) arrives as ``GenericError`` with no status attached. objckpt turns
    obstore's own retries off, so ``GenericError`` is treated as transient:
    the transfer engine's bounded retries then decide, and a permanent one
    costs only a few backoffs. Callers handle "range starts past the end"
    (also a ``GenericError``) before mapping.

    Args:
        exc: What obstore raised.
        what: Operation and full object URL for the message.
        create: The failed call was a create-if-absent put.
    """
    if isinstance(exc, StoreError):
        return exc
    message = f"{what} failed: {scrub(f'{type(exc).__name__}: {_first_line(exc)}')}"
    oe = sys.modules.get("obstore.exceptions")
    if oe is not None and isinstance(exc, oe.BaseError):
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
        if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)):
            return StorePermissionError(message)
        if isinstance(exc, (oe.GenericError, oe.JoinError)):
            return transient_error(_obstore_status(exc), message)
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
