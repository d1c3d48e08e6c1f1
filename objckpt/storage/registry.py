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
filesystem's own storage options. The built-in factories, and which adapter serves each
cloud scheme, are in :mod:`objckpt.storage.factories`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
from collections.abc import Callable
from typing import Any

from objckpt.errors import StoreNotAvailableError
from objckpt.storage.base import Store
from objckpt.storage.urls import SCHEME_RE, redact_url, scheme_of

StoreFactory = Callable[..., Store]

ENTRY_POINT_GROUP = "objckpt.stores"

_BUILTIN: dict[str, str] = {
    "s3": "objckpt.storage.factories:open_s3",
    "s3a": "objckpt.storage.factories:open_s3",
    "gs": "objckpt.storage.factories:open_gcs",
    "gcs": "objckpt.storage.factories:open_gcs",
    "file": "objckpt.storage.factories:open_local",
    "local": "objckpt.storage.factories:open_local",
    "memory": "objckpt.storage.factories:open_memory",
}
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
        from objckpt.storage.factories import open_fsspec

        return open_fsspec(url, **storage_options)
    scheme = scheme_of(url)
    if scheme is None:
        if not os.path.isabs(url):
            raise ValueError(f"relative local path {url!r}: use an absolute path or a file:// URL")
        scheme = "file"
    factory = _resolve(scheme, url)
    if scheme in ("file", "memory"):
        return factory(url, **storage_options)
    from objckpt.logs import guard_client_loggers, remember_secrets
    from objckpt.storage.auth.secrets import credential_secrets

    guard_client_loggers()  # before the client fetches credentials, and after its imports
    remember_secrets(credential_secrets(scheme, storage_options, os.environ))  # redacted by value
    store = factory(url, **storage_options)
    guard_client_loggers()
    return store


def _normalise_scheme(scheme: str) -> str:
    scheme = scheme.lower().removesuffix("://")
    if not SCHEME_RE.match(scheme):
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
            from objckpt.storage.factories import open_fsspec

            return open_fsspec
        raise StoreNotAvailableError(
            f"no store for URL scheme {scheme!r} ({redact_url(url)}): register one with "
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
