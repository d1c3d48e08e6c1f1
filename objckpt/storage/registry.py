"""URL → :class:`Store`: a lazy scheme registry plus the ``objckpt.stores`` entry points.

Lookup order for a URL's scheme:

1. the registry: built-in schemes (``s3``, ``s3a``, ``gs``, ``gcs``, ``file``,
   ``local``, ``memory``) and anything passed to :func:`register_store`, which
   may replace a built-in; entries are ``"module:attr"`` strings imported on
   first use, so ``import objckpt`` never imports s3fs or gcsfs;
2. third-party packages declaring an entry point in the group
   ``objckpt.stores`` whose name is the scheme and whose value is a factory
   ``(url, **storage_options) -> Store`` (looked up only for schemes not in
   the registry, then cached);
3. any other protocol fsspec knows, through the generic :class:`FsspecStore`.

Every factory accepts ``request_timeout`` (seconds per call) besides the
filesystem's own storage options.

Two adapters serve the cloud schemes: the native :class:`ObstoreStore`
(obstore, Rust) and :class:`FsspecStore` (s3fs, gcsfs). Which one:

* ``s3://``: obstore when it is installed and the options translate (see
  :mod:`objckpt.storage.obstore_config`; every credential source does), else s3fs. Against SeaweedFS
  (``benchmarks/bench_stores.py``) its PUTs are ~1.3-1.7x faster at a
  quarter of the client CPU; its reads are faster through
  ``get_range_buffer`` (no copy) but ~15% slower through ``get_range``,
  whose ``bytes`` result costs obstore one extra copy.
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

Credentials: with none in the options, an ``s3://`` store resolves them once
with botocore's precedence (environment, profiles and shared files,
assume-role, web identity, container, instance metadata: see
:mod:`objckpt.storage.credentials`) and hands the source to obstore, which
refreshes expiring credentials mid-operation; the s3fs fallback reads the same
chain through botocore. ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` are
passed on explicitly (and switch on path-style addressing, which every
S3-compatible server supports). ``gs://`` takes Google's default credentials
through google-auth (:mod:`objckpt.storage.gcs_auth`) and honours
``STORAGE_EMULATOR_HOST`` the way Google's clients do: it becomes the
endpoint, with anonymous access unless a token is given. With no credentials
configured at all (and no explicit ``anon``), opening an ``s3://`` or ``gs://``
store raises :class:`StorePermissionError` at once, listing the sources tried.
TLS trust and proxies come from the standard variables (``AWS_CA_BUNDLE``,
``REQUESTS_CA_BUNDLE``, ``SSL_CERT_FILE``, ``HTTPS_PROXY``, ``NO_PROXY``) or
the options (``client_kwargs={"verify": ca_file}`` for S3; see
docs/CREDENTIALS.md).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import threading
from collections.abc import Callable
from typing import Any

from objckpt.errors import StoreNotAvailableError
from objckpt.storage.base import Store
from objckpt.storage.option_check import check_fsspec_options, check_storage_options

StoreFactory = Callable[..., Store]

_SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.\-]*$")
ENTRY_POINT_GROUP = "objckpt.stores"

_BUILTIN: dict[str, str] = {
    "s3": "objckpt.storage.registry:open_s3",
    "s3a": "objckpt.storage.registry:open_s3",
    "gs": "objckpt.storage.registry:open_gcs",
    "gcs": "objckpt.storage.registry:open_gcs",
    "file": "objckpt.storage.registry:open_local",
    "local": "objckpt.storage.registry:open_local",
    "memory": "objckpt.storage.registry:open_memory",
}
#: The pip package each built-in needs beyond objckpt's own dependencies.
_PIP_PACKAGE = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}

#: Storage option and environment variable choosing the adapter.
BACKEND_OPTION = "objckpt_backend"
BACKEND_ENV = "OBJCKPT_STORE_BACKEND"
_BACKENDS = ("auto", "fsspec", "obstore")

_lock = threading.Lock()
_registry: dict[str, str | StoreFactory] = dict(_BUILTIN)


def register_store(scheme: str, factory: str | StoreFactory) -> None:
    """Map a URL scheme to a store factory, replacing any earlier mapping.

    Args:
        scheme: e.g. ``"s3"`` or ``"mystore"`` (case-insensitive).
        factory: A callable ``(url, **storage_options) -> Store`` or a
            ``"module:attr"`` string naming one, imported on first use.
    """
    scheme = _normalise_scheme(scheme)
    if isinstance(factory, str):
        if ":" not in factory:
            raise ValueError(f"factory path must look like 'module:attr', got {factory!r}")
    elif not callable(factory):
        raise TypeError(f"factory must be callable or a 'module:attr' string, got {factory!r}")
    with _lock:
        _registry[scheme] = factory


def from_url(url: str | os.PathLike[str], **storage_options: Any) -> Store:
    """Open the store rooted at ``url``.

    Args:
        url: ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``file:///abs/path``,
            an absolute path, ``memory://name``, any other fsspec URL, or a
            scheme provided by a plugin.
        **storage_options: Passed to the store's factory (for fsspec stores:
            the filesystem's options, plus ``request_timeout``).

    Raises:
        ValueError: ``url`` is empty or a relative local path.
        StoreNotAvailableError: no store for the scheme, or its package is
            missing (the message says what to ``pip install``).
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ValueError(f"store URL must be a non-empty string, got {url!r}")
    if "::" in url:  # fsspec URL chaining, e.g. "simplecache::s3://bucket/x"
        return open_fsspec(url, **storage_options)
    scheme = scheme_of(url)
    if scheme is None:
        if not os.path.isabs(url):
            raise ValueError(f"relative local path {url!r}: use an absolute path or a file:// URL")
        scheme = "file"
    factory = _resolve(scheme, url)
    if scheme in ("file", "memory"):
        return factory(url, **storage_options)
    from objckpt.logs import guard_client_loggers

    guard_client_loggers()  # before the client fetches credentials, and after its imports
    store = factory(url, **storage_options)
    guard_client_loggers()
    return store


def scheme_of(url: str) -> str | None:
    """The lower-cased scheme of ``scheme://...``, or None for a plain path."""
    head, sep, _ = url.partition("://")
    if not sep:
        return None
    scheme = head.lower()
    if not _SCHEME_RE.match(scheme):
        raise ValueError(f"invalid URL scheme in {url!r}")
    return scheme


def _normalise_scheme(scheme: str) -> str:
    scheme = scheme.lower().removesuffix("://")
    if not _SCHEME_RE.match(scheme):
        raise ValueError(f"invalid URL scheme {scheme!r}")
    return scheme


def _load_path(path: str) -> StoreFactory:
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _entry_point(scheme: str) -> importlib.metadata.EntryPoint | None:
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=scheme)
    for ep in found:
        return ep
    return None


def _fsspec_knows(scheme: str) -> bool:
    from fsspec.registry import known_implementations, registry

    return scheme in registry or scheme in known_implementations


def _resolve(scheme: str, url: str) -> StoreFactory:
    with _lock:
        entry = _registry.get(scheme)
    if entry is None:
        ep = _entry_point(scheme)
        if ep is not None:
            try:
                factory = ep.load()
            except ImportError as exc:
                raise StoreNotAvailableError(
                    f"store plugin {ep.value!r} for scheme {scheme!r} failed to import: {exc}"
                ) from exc
            with _lock:
                _registry.setdefault(scheme, factory)
            return factory  # type: ignore[no-any-return]
        if _fsspec_knows(scheme):
            return open_fsspec
        raise StoreNotAvailableError(
            f"no store for URL scheme {scheme!r} ({_display(url)}): register one with "
            f"objckpt.storage.register_store() or install a package providing an "
            f"{ENTRY_POINT_GROUP!r} entry point named {scheme!r}"
        )
    if callable(entry):
        return entry
    try:
        factory = _load_path(entry)
    except ImportError as exc:
        raise StoreNotAvailableError(f"store for scheme {scheme!r} ({entry}) failed to import: {exc}") from exc
    with _lock:
        if _registry.get(scheme) == entry:
            _registry[scheme] = factory
    return factory


def _display(url: str) -> str:
    from objckpt.storage.urls import redact_url

    return redact_url(url)


def _require(module: str, scheme: str) -> Any:
    """Import an optional dependency or say which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = _PIP_PACKAGE.get(scheme, module)
        raise StoreNotAvailableError(f"{scheme}:// URLs need the {package!r} package: pip install {package}") from exc


def _pop_timeout(options: dict[str, Any]) -> dict[str, Any]:
    from objckpt.storage.base import DEFAULT_REQUEST_TIMEOUT_S

    return {"request_timeout": options.pop("request_timeout", DEFAULT_REQUEST_TIMEOUT_S)}


def _pop_backend(options: dict[str, Any], *, native: bool) -> str:
    """Pop ``objckpt_backend`` and resolve it against ``OBJCKPT_STORE_BACKEND``.

    Args:
        options: Storage options; the backend option is removed.
        native: Whether this scheme has a native path; where it has none, an
            explicit ``"obstore"`` option is an error and the variable is ignored.
    """
    explicit = options.pop(BACKEND_OPTION, None)
    value = explicit if explicit is not None else (os.environ.get(BACKEND_ENV) or "auto")
    choice = str(value).strip().lower()
    if choice not in _BACKENDS:
        source = f"{BACKEND_OPTION}=" if explicit is not None else f"${BACKEND_ENV}="
        raise ValueError(f"{source}{value!r}: expected one of {', '.join(_BACKENDS)}")
    if not native:
        if explicit is not None and choice == "obstore":
            raise ValueError(f"{BACKEND_OPTION}='obstore': no native store for this URL scheme")
        return "fsspec"
    return choice


def _obstore_available() -> bool:
    try:
        importlib.import_module("obstore")
    except ImportError:
        return False
    return True


def _open_native(url: str, options: dict[str, Any], backend: str, translate: str) -> Store | None:
    """The native store for ``url``, or None to fall back to fsspec (``backend="auto"``).

    Args:
        translate: Name of the :mod:`objckpt.storage.obstore_config` function
            for this scheme (``"translate_s3"``, ``"translate_gcs"``).
    """
    if backend == "fsspec":
        return None
    forced = backend == "obstore"
    if not _obstore_available():
        if forced:
            raise StoreNotAvailableError(f"{BACKEND_OPTION}='obstore' needs the 'obstore' package: pip install obstore")
        return None
    from objckpt.storage import obstore_config, obstore_store

    rest = dict(options)
    store_kw = _pop_timeout(rest)
    # An unknown option is the first thing said (before a credential lookup it may have misdirected).
    check_fsspec_options(url, rest, translate.removeprefix("translate_"))
    try:
        if translate == "translate_s3":
            spec = obstore_config.translate_s3(url, rest, os.environ, _s3_source(url, rest))
        else:
            spec = getattr(obstore_config, translate)(url, rest, os.environ)
            _preflight(f"check_{spec.kind}_credentials", url, rest)
    except obstore_config.NotTranslatable as exc:
        if forced:
            check_fsspec_options(url, rest, translate.removeprefix("translate_"))  # no client takes it
            raise ValueError(f"{_display(url)} cannot use the obstore store: {exc}") from exc
        return None
    return obstore_store.open_spec(spec, url, **store_kw)


def _s3_source(url: str, options: dict[str, Any]) -> Any:
    """Where an ``s3://`` store's credentials come from (None when the options say),
    resolved once with botocore's precedence (:func:`objckpt.storage.credentials.resolve_s3_source`)."""
    from objckpt.storage import credentials

    if credentials.s3_options_explicit(options):
        return None
    return credentials.resolve_s3_source(url, options, os.environ)


# ------------------------------------------------------------------ factories


def open_s3(url: str, **storage_options: Any) -> Store:
    """``s3://`` / ``s3a://``: obstore when it can serve the URL, else s3fs."""
    options = dict(storage_options)
    backend = _pop_backend(options, native=True)
    native = _open_native(url, options, backend, "translate_s3")
    if native is not None:
        return native
    return open_s3_fsspec(url, **options)


def open_s3_fsspec(url: str, **storage_options: Any) -> Store:
    """``s3://`` / ``s3a://`` through s3fs."""
    from objckpt.storage.fsspec_store import for_filesystem

    s3fs = _require("s3fs", scheme_of(url) or "s3")
    options = dict(storage_options)
    store_kw = _pop_timeout(options)
    check_fsspec_options(url, options, "s3")
    _preflight("check_s3_credentials", url, options)
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
        raise ValueError(f"S3 URL needs a bucket: {_display(url)!r}")
    return for_filesystem(fs, path, url=url, **store_kw)


def open_gcs(url: str, **storage_options: Any) -> Store:
    """``gs://`` / ``gcs://``: gcsfs, or obstore when asked for (see the module doc)."""
    options = dict(storage_options)
    backend = _pop_backend(options, native=True)
    native = _open_native(url, options, "fsspec" if backend == "auto" else backend, "translate_gcs")
    if native is not None:
        return native
    return open_gcs_fsspec(url, **options)


def open_gcs_fsspec(url: str, **storage_options: Any) -> Store:
    """``gs://`` / ``gcs://`` through gcsfs (see :func:`objckpt.storage.gcs_open.open_gcsfs`)."""
    from objckpt.storage.gcs_open import open_gcsfs

    _require("gcsfs", scheme_of(url) or "gs")
    check_fsspec_options(url, storage_options, "gcs")

    return open_gcsfs(url, **storage_options)


def _preflight(check: str, url: str, options: dict[str, Any]) -> None:
    """Run one of :mod:`objckpt.storage.credentials`' checks: with no credentials configured
    anywhere, opening fails at once naming the sources tried, not after a minute of retries."""
    from objckpt.storage import credentials

    options = {k: v for k, v in options.items() if k != "request_timeout"}
    getattr(credentials, check)(url, options, os.environ)


def open_local(url: str, **storage_options: Any) -> Store:
    """``file:///abs/path``, ``local:///abs/path`` or a plain absolute path."""
    from fsspec.implementations.local import LocalFileSystem

    from objckpt.storage.fsspec_store import for_filesystem

    options = dict(storage_options)
    backend = _pop_backend(options, native=True)
    store_kw = _pop_timeout(options)
    scheme = scheme_of(url)
    raw = url[len(scheme) + 3 :] if scheme else url
    if raw.startswith("localhost/"):
        raw = raw[len("localhost") :]
    if not raw.startswith("/"):
        raise ValueError(f"local store URL must be absolute: {url!r}")
    if backend == "obstore":  # "auto" stays on fsspec: LocalStore measured no faster
        if options:
            raise ValueError(f"{BACKEND_OPTION}='obstore' takes no local filesystem options: {sorted(options)}")
        if not _obstore_available():
            raise StoreNotAvailableError(f"{BACKEND_OPTION}='obstore' needs the 'obstore' package: pip install obstore")
        from objckpt.storage.obstore_store import open_local_path

        return open_local_path(os.path.normpath(raw), url, **store_kw)
    check_storage_options(url, options, LocalFileSystem)
    options.setdefault("skip_instance_cache", True)
    fs = LocalFileSystem(**options)
    path = fs._strip_protocol(raw)
    return for_filesystem(fs, path, url=url, **store_kw)


def open_memory(url: str, **storage_options: Any) -> Store:
    """``memory://name``: fsspec's process-wide in-memory filesystem."""
    from fsspec.implementations.memory import MemoryFileSystem

    from objckpt.storage.fsspec_store import for_filesystem

    options = dict(storage_options)
    _pop_backend(options, native=False)
    store_kw = _pop_timeout(options)
    fs = MemoryFileSystem(**options)
    return for_filesystem(fs, fs._strip_protocol(url), url=url, **store_kw)


def open_fsspec(url: str, **storage_options: Any) -> Store:
    """Any other fsspec URL (``hdfs://``, ``az://``, ``sftp://``, chained URLs, ...)."""
    import fsspec.core

    from objckpt.storage.fsspec_store import for_filesystem, map_error

    options = dict(storage_options)
    _pop_backend(options, native=False)
    store_kw = _pop_timeout(options)
    options.setdefault("skip_instance_cache", True)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise StoreNotAvailableError(f"{scheme_of(url) or url!r} URLs need an extra package: {exc}") from exc
    except (OSError, ConnectionError, TimeoutError) as exc:  # filesystems that connect eagerly
        raise map_error(exc, f"open {_display(url)}") from exc
    return for_filesystem(fs, path, url=url, **store_kw)
