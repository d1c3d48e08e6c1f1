"""The built-in schemes' store factories: ``s3://``, ``gs://``, ``file://``, ``memory://``
and any other fsspec protocol. :mod:`objckpt.storage.registry` maps each scheme to one of
these by name and imports this module on first use.

Every factory accepts ``request_timeout`` (seconds per call) besides the
filesystem's own storage options.

Two adapters serve the cloud schemes: the native :class:`ObstoreStore`
(obstore, Rust) and :class:`FsspecStore` (s3fs, gcsfs). Which one:

* ``s3://``: obstore when it is installed and the options translate (see
  :mod:`objckpt.storage.obstore.config`; every credential source does), else s3fs
  (docs/PERFORMANCE.md, "Kept", compares them).
* ``gs://``: gcsfs. obstore's GCS client writes through the XML API, which
  the local emulator (fake-gcs-server) routes to its JSON upload handler
  and refuses, so the native path is untested here and only used when
  asked for.
* ``file://``: objckpt's own atomic writes over fsspec's local filesystem
  (obstore's ``LocalStore`` was no faster); native only when asked for.

Force one with the storage option ``objckpt_backend="fsspec" | "obstore"``
(or ``"auto"``) or the environment variable ``OBJCKPT_STORE_BACKEND``; the
option wins. Asking for ``"obstore"`` where it cannot serve the URL (not
installed, untranslatable options) is an error rather than a silent
fallback; the environment variable only steers schemes with a native path.

Credentials, endpoints, TLS trust and proxies come from where the AWS and Google
SDKs find them (docs/CREDENTIALS.md; :mod:`objckpt.storage.auth.credentials`); with
none configured at all (and no explicit ``anon``), opening an ``s3://`` or ``gs://``
store raises :class:`StorePermissionError` at once, listing the sources tried.
"""

from __future__ import annotations

import os
from typing import Any

from objckpt.errors import StoreNotAvailableError
from objckpt.storage.auth import credentials
from objckpt.storage.base import Store
from objckpt.storage.endpoint import ConfiguredEndpoint, gcs_endpoint, s3_endpoint
from objckpt.storage.opening import (
    BACKEND_OPTION,
    obstore_available,
    pop_backend,
    pop_timeout,
    preflight,
    require,
)
from objckpt.storage.option_check import check_fsspec_options, check_storage_options
from objckpt.storage.urls import redact_url, scheme_of


def _open_native(url: str, options: dict[str, Any], backend: str, translate: str) -> Store | None:
    """The native store for ``url``, or None to fall back to fsspec (``backend="auto"``).

    Args:
        translate: Name of the :mod:`objckpt.storage.obstore.config` function
            for this scheme (``"translate_s3"``, ``"translate_gcs"``).
    """
    if backend == "fsspec":
        return None
    forced = backend == "obstore"
    if not obstore_available():
        if forced:
            raise StoreNotAvailableError(f"{BACKEND_OPTION}='obstore' needs the 'obstore' package: pip install obstore")
        return None
    from objckpt.storage.obstore import config as obstore_config
    from objckpt.storage.obstore import store as obstore_store

    rest = dict(options)
    store_kw = pop_timeout(rest)
    # An unknown option is the first thing said (before a credential lookup it may have misdirected);
    # the options obstore's translation reads are the fsspec client's own names, known without it.
    kind = translate.removeprefix("translate_")
    check_fsspec_options(url, {k: v for k, v in rest.items() if k not in obstore_config.FSSPEC_NAMED[kind]}, kind)
    try:
        if translate == "translate_s3":
            spec = obstore_config.translate_s3(url, rest, os.environ, _s3_source(url, rest))
        else:
            spec = getattr(obstore_config, translate)(url, rest, os.environ)
            preflight(f"check_{spec.kind}_credentials", url, rest)
    except obstore_config.NotTranslatable as exc:
        if forced:
            check_fsspec_options(url, rest, kind)  # no client takes it
            raise ValueError(f"{redact_url(url)} cannot use the obstore store: {exc}") from exc
        return None
    named = (s3_endpoint if spec.kind == "s3" else gcs_endpoint)(rest, os.environ)
    configured = ConfiguredEndpoint(spec.endpoint, named.setting, networks=True) if spec.endpoint and named else None
    return obstore_store.open_spec(spec, url, **store_kw, configured_endpoint=configured)


def _s3_source(url: str, options: dict[str, Any]) -> Any:
    """Where an ``s3://`` store's credentials come from (None when the options say),
    resolved once with botocore's precedence (:func:`objckpt.storage.auth.credentials.resolve_s3_source`)."""
    if credentials.s3_options_explicit(options):
        return None
    return credentials.resolve_s3_source(url, options, os.environ)


def open_s3(url: str, **storage_options: Any) -> Store:
    """``s3://`` / ``s3a://``: obstore when it can serve the URL, else s3fs."""
    options = dict(storage_options)
    backend = pop_backend(options, native=True)
    native = _open_native(url, options, backend, "translate_s3")
    if native is not None:
        return native
    return open_s3_fsspec(url, **options)


def open_s3_fsspec(url: str, **storage_options: Any) -> Store:
    """``s3://`` / ``s3a://`` through s3fs."""
    from objckpt.storage.fsspec.factory import for_filesystem

    s3fs = require("s3fs", scheme_of(url) or "s3")
    options = dict(storage_options)
    store_kw = pop_timeout(options)
    check_fsspec_options(url, options, "s3")
    configured = s3_endpoint(options, os.environ)
    preflight("check_s3_credentials", url, options)
    client_kwargs = dict(options.get("client_kwargs") or {})
    endpoint = options.get("endpoint_url") or client_kwargs.get("endpoint_url")
    if not endpoint:
        # botocore >= 1.31 reads these itself; passing them on explicitly keeps
        # older botocore working and tells us to use path-style addressing.
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["endpoint_url"] = endpoint
    if endpoint:
        config_kwargs = dict(options.get("config_kwargs") or {})
        s3_config = dict(config_kwargs.get("s3") or {})
        s3_config.setdefault("addressing_style", "path")
        config_kwargs["s3"] = s3_config
        options["config_kwargs"] = config_kwargs
    options.setdefault("skip_instance_cache", True)
    options.setdefault("use_listings_cache", False)
    fs = s3fs.S3FileSystem(**options)
    path = fs._strip_protocol(url).rstrip("/")
    if not path:
        raise ValueError(f"S3 URL needs a bucket: {redact_url(url)!r}")
    return for_filesystem(fs, path, url=url, configured_endpoint=configured, **store_kw)


def open_gcs(url: str, **storage_options: Any) -> Store:
    """``gs://`` / ``gcs://``: gcsfs, or obstore when asked for (see the module doc)."""
    options = dict(storage_options)
    backend = pop_backend(options, native=True)
    native = _open_native(url, options, "fsspec" if backend == "auto" else backend, "translate_gcs")
    if native is not None:
        return native
    return open_gcs_fsspec(url, **options)


def open_gcs_fsspec(url: str, **storage_options: Any) -> Store:
    """``gs://`` / ``gcs://`` through gcsfs (see :func:`objckpt.storage.fsspec.open_gcs.open_gcsfs`)."""
    from objckpt.storage.fsspec.open_gcs import open_gcsfs

    require("gcsfs", scheme_of(url) or "gs")
    check_fsspec_options(url, storage_options, "gcs")

    return open_gcsfs(url, **storage_options)


def open_local(url: str, **storage_options: Any) -> Store:
    """``file:///abs/path``, ``local:///abs/path`` or a plain absolute path."""
    from fsspec.implementations.local import LocalFileSystem

    from objckpt.storage.fsspec.factory import for_filesystem

    options = dict(storage_options)
    backend = pop_backend(options, native=True)
    store_kw = pop_timeout(options)
    scheme = scheme_of(url)
    raw = url[len(scheme) + 3 :] if scheme else url
    if raw.startswith("localhost/"):
        raw = raw[len("localhost") :]
    if not raw.startswith("/"):
        raise ValueError(f"local store URL must be absolute: {url!r}")
    if backend == "obstore":  # "auto" stays on fsspec: LocalStore measured no faster
        if options:
            raise ValueError(f"{BACKEND_OPTION}='obstore' takes no local filesystem options: {sorted(options)}")
        if not obstore_available():
            raise StoreNotAvailableError(f"{BACKEND_OPTION}='obstore' needs the 'obstore' package: pip install obstore")
        from objckpt.storage.obstore.store import open_local_path

        return open_local_path(os.path.normpath(raw), url, **store_kw)
    check_storage_options(url, options, LocalFileSystem)
    options.setdefault("skip_instance_cache", True)
    fs = LocalFileSystem(**options)
    path = fs._strip_protocol(raw)
    return for_filesystem(fs, path, url=url, **store_kw)


def open_memory(url: str, **storage_options: Any) -> Store:
    """``memory://name``: fsspec's process-wide in-memory filesystem."""
    from fsspec.implementations.memory import MemoryFileSystem

    from objckpt.storage.fsspec.factory import for_filesystem

    options = dict(storage_options)
    pop_backend(options, native=False)
    store_kw = pop_timeout(options)
    fs = MemoryFileSystem(**options)
    return for_filesystem(fs, fs._strip_protocol(url), url=url, **store_kw)


def open_fsspec(url: str, **storage_options: Any) -> Store:
    """Any other fsspec URL (``hdfs://``, ``az://``, ``sftp://``, chained URLs, ...)."""
    import fsspec.core

    from objckpt.storage.errors import map_error
    from objckpt.storage.fsspec.factory import for_filesystem

    options = dict(storage_options)
    pop_backend(options, native=False)
    store_kw = pop_timeout(options)
    options.setdefault("skip_instance_cache", True)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise StoreNotAvailableError(f"{scheme_of(url) or url!r} URLs need an extra package: {exc}") from exc
    except (OSError, ConnectionError, TimeoutError) as exc:  # filesystems that connect eagerly
        raise map_error(exc, f"open {redact_url(url)}") from exc
    return for_filesystem(fs, path, url=url, **store_kw)
