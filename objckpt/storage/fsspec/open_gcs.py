"""Opening ``gs://`` stores through gcsfs: one credential, TLS trust, the fast paths, single attempts.

gcsfs serves every GCS store objckpt opens by default (:mod:`objckpt.storage.factories`
says why); :func:`open_gcsfs` sets up around it what a real deployment needs, and gcsfs
makes one attempt per request where its release allows (:func:`_one_attempt_per_request`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import types
from typing import Any

from objckpt.storage.base import Store
from objckpt.storage.endpoint import gcs_endpoint as configured_endpoint
from objckpt.storage.opening import pop_timeout, preflight, require
from objckpt.storage.urls import redact_url, scheme_of

logger = logging.getLogger(__name__)


def open_gcsfs(url: str, **storage_options: Any) -> Store:
    """``gs://`` / ``gcs://`` through gcsfs (``STORAGE_EMULATOR_HOST`` aware).

    gcsfs and objckpt's fast paths (streamed reads, media uploads) share one
    refreshable Google credential built from the ``token`` option
    (:mod:`objckpt.storage.auth.gcs`); a ``token`` it cannot load, and
    requester-pays buckets, leave the store to gcsfs alone. The fast paths go
    to the endpoint resolved here: ``endpoint_url``, else
    ``STORAGE_EMULATOR_HOST``, else ``https://storage.googleapis.com`` (or its
    ``GOOGLE_CLOUD_UNIVERSE_DOMAIN``); not where gcsfs presents a client
    certificate (mutual TLS), which they do not. gcsfs's aiohttp session
    honours ``HTTPS_PROXY``/``NO_PROXY`` (``trust_env``, unless
    ``session_kwargs`` says otherwise).

    Storage options beyond gcsfs's: ``request_timeout``, and ``ca_bundle``: a
    CA bundle (PEM path) that every request of the store trusts instead of
    the system roots: the fast paths', the token refreshes' and gcsfs's own
    (through an aiohttp connector made on gcsfs's loop; default
    ``REQUESTS_CA_BUNDLE``, as Google's clients read it). Without one,
    gcsfs keeps aiohttp's trust: the system roots, which ``SSL_CERT_FILE``
    replaces if set before aiohttp is imported.

    With an explicit endpoint (option or emulator variable) the core
    ``gcsfs.core.GCSFileSystem`` is used rather than gcsfs's experimental
    zonal-bucket subclass, whose bucket probe hangs 60 s against emulators.
    """
    from objckpt.storage.auth import gcs as gcs_auth
    from objckpt.storage.fsspec.factory import for_filesystem

    require("gcsfs", scheme_of(url) or "gs")
    gcsfs_core = importlib.import_module("gcsfs.core")
    options = dict(storage_options)
    store_kw = pop_timeout(options)
    ca_file = options.pop("ca_bundle", None) or os.environ.get("REQUESTS_CA_BUNDLE") or None
    store_kw["configured_endpoint"] = configured_endpoint(options, os.environ)
    endpoint = options.get("endpoint_url")
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if not endpoint and emulator and emulator != "default":
        if "://" not in emulator:
            emulator = f"http://{emulator}"
        options["endpoint_url"] = endpoint = emulator
        options.setdefault("token", "anon")
    preflight("check_gcs_credentials", url, options)
    token = gcs_auth.load_token(
        options.get("token"),
        url=url,
        timeout=store_kw["request_timeout"],
        access=options.get("access", "full_control"),
        ca_file=ca_file,
    )
    if token is not None and not token.anonymous:
        options["token"] = token.credentials  # the one credential gcsfs and the fast paths refresh
        if token.project and not options.get("project"):
            options["project"] = token.project  # as gcsfs's own google_default sets it
    options["session_kwargs"] = {"trust_env": True, **(options.get("session_kwargs") or {})}
    on_fsspec_loop = not options.get("asynchronous") and options.get("loop") is None
    if ca_file and on_fsspec_loop and "connector" not in options["session_kwargs"]:
        options["session_kwargs"]["connector"] = _trusting_connector(ca_file)
    options.setdefault("skip_instance_cache", True)
    options.setdefault("use_listings_cache", False)
    if endpoint:
        cls = gcsfs_core.GCSFileSystem
    else:
        cls = importlib.import_module("gcsfs").GCSFileSystem
    fs = cls(**options)
    _one_attempt_per_request(fs)
    path = fs._strip_protocol(url).rstrip("/")
    if not path:
        raise ValueError(f"GCS URL needs a bucket: {redact_url(url)!r}")
    base = gcs_endpoint(endpoint)
    if token is None or options.get("requester_pays") or (not endpoint and _gcs_client_cert()):
        return for_filesystem(fs, path, url=url, endpoint=base, **store_kw)
    return for_filesystem(
        fs, path, url=url, endpoint=base, **store_kw, **_gcs_fast_paths(base, token, ca_file, store_kw)
    )


def gcs_endpoint(endpoint: str | None) -> str:
    """The service URL a GCS store talks to: ``endpoint`` (the option or ``STORAGE_EMULATOR_HOST``),
    else Google's, in ``GOOGLE_CLOUD_UNIVERSE_DOMAIN`` if set."""
    universe = os.environ.get("GOOGLE_CLOUD_UNIVERSE_DOMAIN") or "googleapis.com"
    return str(endpoint or f"https://storage.{universe}").rstrip("/")


def _trusting_connector(ca_file: str) -> Any:
    """An aiohttp connector, made on fsspec's IO loop (where gcsfs runs its session),
    whose TLS trusts ``ca_file``: aiohttp makes connectors only inside a running loop."""
    import aiohttp
    import fsspec.asyn

    from objckpt.storage.http import network

    context = network.ssl_context(ca_file)

    async def make() -> Any:
        return aiohttp.TCPConnector(ssl=context)

    return fsspec.asyn.sync(fsspec.asyn.get_loop(), make)


def _gcs_fast_paths(base: str, token: Any, ca_file: str | None, store_kw: dict[str, Any]) -> dict[str, Any]:
    """The streamed range reader and the media uploader of a gcsfs store at ``base``, sharing ``token``."""
    from objckpt.storage.http import network
    from objckpt.storage.http.gcs import GCSRangeReader
    from objckpt.storage.http.gcs_upload import MediaUploader

    context = network.ssl_context(ca_file)
    timeout = store_kw["request_timeout"]
    bearer = None if token.anonymous else token
    reader = GCSRangeReader(endpoint=base, credentials=bearer, timeout=timeout, ssl_context=context)
    uploader = MediaUploader(endpoint=base, token=token, timeout=timeout, ssl_context=context)
    return {"range_reader": reader, "uploader": uploader}


def _gcs_client_cert() -> bool:
    """Whether google-auth is set up to present a client certificate (gcsfs then uses
    the mutual-TLS endpoint with it, which the fast paths do not)."""
    from google.auth.transport import mtls

    should_use = getattr(mtls, "should_use_client_cert", None)
    return bool(should_use is not None and should_use() and mtls.has_default_client_cert_source())


#: gcsfs releases, [first, end) as (year, month), whose ``GCSFileSystem._request`` is
#: wrapped by ``retry_request`` (made with the ``decorator`` package, which keeps the
#: undecorated function as ``__wrapped__``): read in 2024.6.0 and 2026.10.1, the release
#: the tests run on. Widen the end only after reading a newer ``gcsfs/core.py`` and
#: ``gcsfs/retry.py`` and running tests/test_throttle.py's gcsfs tests on it.
GCSFS_SINGLE_ATTEMPT_VERSIONS = ((2024, 6), (2026, 11))


def _one_attempt_per_request(fs: Any) -> bool:
    """Make each of gcsfs's HTTP requests one attempt, as obstore's are (``max_retries=0``).

    gcsfs retries 429 and 5xx itself, six attempts 1–32 s apart, inside what the
    transfer engine sees as one call: under its per-attempt timeout, unseen by its
    retry counter and by the window that backs off on 429 (:mod:`objckpt.transfer.throttle`).
    objckpt's engine and ``RetryingStore`` are the one retry layer, so this
    instance calls gcsfs's request function without its retry decorator.

    gcsfs has no public switch for this (its ``retries`` attribute is read only
    when the class is decorated; ``requests_timeout`` bounds one attempt: see
    docs/ARCHITECTURE.md): the undecorated function is its ``__wrapped__``,
    which is used only on the releases in
    :data:`GCSFS_SINGLE_ATTEMPT_VERSIONS`. On any other release, or if
    ``__wrapped__`` is missing, gcsfs's own retries stay on (logged once).

    Returns:
        Whether requests now make one attempt each.
    """
    version = _gcsfs_version()
    first, end = GCSFS_SINGLE_ATTEMPT_VERSIONS
    single = getattr(type(fs)._request, "__wrapped__", None)
    if version is None or not first <= version < end or not callable(single):
        _log_gcsfs_retries_on(version)
        return False
    fs._request = types.MethodType(single, fs)
    return True


def _gcsfs_version() -> tuple[int, int] | None:
    """gcsfs's (year, month) release, or None if it cannot be read."""
    try:
        parts = importlib.metadata.version("gcsfs").split(".")
        return int(parts[0]), int(parts[1])
    except (importlib.metadata.PackageNotFoundError, ValueError, IndexError):
        return None


_gcsfs_retries_logged: set[tuple[int, int] | None] = set()


def _log_gcsfs_retries_on(version: tuple[int, int] | None) -> None:
    """Say once per gcsfs version that its retries stay on."""
    if version in _gcsfs_retries_logged:
        return
    _gcsfs_retries_logged.add(version)
    (first_y, first_m), (end_y, end_m) = GCSFS_SINGLE_ATTEMPT_VERSIONS
    logger.info(
        "gcsfs %s: its own request retries stay on (objckpt turns them off on gcsfs %d.%d up to %d.%d)",
        ".".join(map(str, version)) if version else "(version unknown)",
        first_y,
        first_m,
        end_y,
        end_m,
    )
