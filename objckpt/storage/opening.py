"""What every built-in store factory shares: the backend choice, the request timeout,
optional dependencies, and the credential pre-flight.

Kept apart from :mod:`objckpt.storage.registry` (which maps schemes to factories) and from
the factories themselves, so that a factory in a backend's package (``gs://`` through
gcsfs: :mod:`objckpt.storage.fsspec.open_gcs`) uses them without importing the registry.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from objckpt.errors import StoreNotAvailableError
from objckpt.storage.auth import credentials
from objckpt.storage.base import DEFAULT_REQUEST_TIMEOUT_S

#: Storage option and environment variable choosing the adapter.
BACKEND_OPTION = "objckpt_backend"
BACKEND_ENV = "OBJCKPT_STORE_BACKEND"
_BACKENDS = ("auto", "fsspec", "obstore")

#: The pip package each built-in scheme needs beyond objckpt's own dependencies.
_PIP_PACKAGE = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}


def require(module: str, scheme: str) -> Any:
    """Import an optional dependency or say which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = _PIP_PACKAGE.get(scheme, module)
        raise StoreNotAvailableError(f"{scheme}:// URLs need the {package!r} package: pip install {package}") from exc


def pop_timeout(options: dict[str, Any]) -> dict[str, Any]:
    """Pop ``request_timeout`` from ``options``: the store's keyword, with its default."""
    return {"request_timeout": options.pop("request_timeout", DEFAULT_REQUEST_TIMEOUT_S)}


def pop_backend(options: dict[str, Any], *, native: bool) -> str:
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


def obstore_available() -> bool:
    """Whether obstore (the native stores' client) can be imported."""
    try:
        importlib.import_module("obstore")
    except ImportError:
        return False
    return True


def preflight(check: str, url: str, options: dict[str, Any]) -> None:
    """Run one of :mod:`objckpt.storage.auth.credentials`' checks: with no credentials configured
    anywhere, opening fails at once naming the sources tried, not after a minute of retries."""
    options = {k: v for k, v in options.items() if k != "request_timeout"}
    getattr(credentials, check)(url, options, os.environ)
