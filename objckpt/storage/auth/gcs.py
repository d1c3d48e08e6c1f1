"""One refreshable Google credential per GCS store, shared by gcsfs and objckpt's fast paths.

A ``gs://`` store makes requests three ways: through gcsfs, through the
streamed range reader (:mod:`objckpt.storage.http.gcs`) and through media
uploads (:mod:`objckpt.storage.http.gcs_upload`). All three authorize with the same
``google.auth`` credentials object, built here once from gcsfs's ``token``
storage option, so there is one access token per store and it is refreshed
once when it nears expiry, whoever notices first.

google-auth does the protocol work (service-account JWT grants, authorized-user
refresh tokens, workload identity federation, the GCE metadata server); this
module only chooses how to load the credentials, refreshes them one at a time
under a lock with a timeout on every request, and maps refresh failures to
objckpt's errors. What the ``token`` option means:

* ``None`` or ``"google_default"``: Google's application default credentials
  (``google.auth.default``): the ``GOOGLE_APPLICATION_CREDENTIALS`` file of any
  type (service account, authorized user, external account), gcloud's
  application-default file, then the GCE metadata server (which google-auth
  finds through ``GCE_METADATA_HOST``/``GCE_METADATA_IP``);
* ``"cloud"``: the GCE metadata server;
* a path to a ``service_account``, ``authorized_user`` or ``external_account``
  (workload identity federation) JSON file, or its content as a ``dict``,
  each loaded with its type's own google-auth loader (google-auth deprecates
  its generic ones); other kinds (impersonation) are read through
  ``GOOGLE_APPLICATION_CREDENTIALS`` by the default chain;
* a ``google.auth.credentials.Credentials`` instance, used as it is;
* ``"anon"``: anonymous requests (public buckets, emulators).

Anything else gcsfs accepts (``"browser"``, ``"cache"``, a raw access token, a
gcsfs token-cache file or dict) loads as None: gcsfs alone serves that store,
without the fast paths. So does ``None`` when no default credentials exist
(gcsfs then tries its own cache and goes anonymous).

Refreshes go through ``google.auth.transport.requests`` (requests honours
``HTTPS_PROXY``/``NO_PROXY`` and ``REQUESTS_CA_BUNDLE``). Access tokens never
reach a message, a log or a ``repr``.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import google.auth
import google.auth.compute_engine
import google.auth.exceptions
import google.auth.transport.requests
import google.oauth2.credentials
import requests
from google.auth.credentials import AnonymousCredentials, Credentials
from google.oauth2 import service_account

from objckpt.errors import StorePermissionError, TransientStoreError
from objckpt.logs import remember_secrets
from objckpt.storage.urls import redact_url

#: The OAuth scope for gcsfs's ``access`` option (``full_control`` by default, as gcsfs).
SCOPE_PREFIX = "https://www.googleapis.com/auth/devstorage."
_ACCESS = ("read_only", "read_write", "full_control")
_DEFAULT_TOKENS = (None, "google_default")
_REASON_LIMIT = 200  # characters of a token endpoint's refusal kept in a message


class _TimedRequest(google.auth.transport.requests.Request):
    """google-auth's requests transport with a timeout on every request (its default is 120 s)."""

    def __init__(self, session: requests.Session, timeout: float) -> None:
        super().__init__(session)
        self._timeout = timeout

    def __call__(
        self, url: Any, method: Any = "GET", body: Any = None, headers: Any = None, timeout: Any = None, **kwargs: Any
    ) -> Any:
        limit = self._timeout if not isinstance(timeout, int | float) else min(float(timeout), self._timeout)
        return super().__call__(url, method=method, body=body, headers=headers, timeout=limit, **kwargs)


class GoogleToken:
    """The auth headers for one store's requests, from one refreshable ``google.auth`` credential.

    Args:
        credentials: The credentials (``AnonymousCredentials`` for anonymous access).
        url: The store's URL, named in errors (credentials stripped).
        timeout: Seconds allowed to each request of a refresh.
        project: The project the credentials came with, if any.
        ca_file: A CA bundle the refresh requests trust instead of requests' default.
    """

    def __init__(
        self,
        credentials: Credentials,
        *,
        url: str,
        timeout: float,
        project: str | None = None,
        ca_file: str | None = None,
    ) -> None:
        self.credentials = credentials
        self.project = project
        self._url = redact_url(url)
        self._timeout = float(timeout)
        self._ca_file = ca_file
        self._lock = threading.Lock()  # one refresh at a time

    def __repr__(self) -> str:
        return f"GoogleToken({type(self.credentials).__name__}, {self._url})"

    @property
    def anonymous(self) -> bool:
        """Whether requests go without an ``Authorization`` header."""
        return isinstance(self.credentials, AnonymousCredentials)

    def fresh_headers(self) -> dict[str, str] | None:
        """The auth headers when no refresh is due (no I/O), else None."""
        if not self.credentials.valid:  # no token, or within google-auth's refresh skew of expiry
            return None
        out: dict[str, str] = {}
        self.credentials.apply(out)
        return out

    def headers(self) -> dict[str, str]:
        """The auth headers, refreshing the credential first when it is due (blocking).

        Raises:
            StorePermissionError: the token endpoint refused the credential.
            TransientStoreError: it could not be reached, or failed in a retryable way.
        """
        fresh = self.fresh_headers()
        if fresh is not None:
            return fresh
        with self._lock:
            if not self.credentials.valid:  # another thread may have refreshed meanwhile
                self._refresh()
            out: dict[str, str] = {}
            self.credentials.apply(out)
            return out

    def _refresh(self) -> None:
        what = f"refreshing the Google credentials for {self._url}"
        with requests.Session() as session:
            if self._ca_file:
                session.verify = self._ca_file
            try:
                self.credentials.refresh(_TimedRequest(session, self._timeout))
                remember_secrets((str(getattr(self.credentials, "token", None) or ""),))
            except google.auth.exceptions.TransportError as exc:
                raise TransientStoreError(f"{what} failed: {type(exc).__name__}") from exc
            except google.auth.exceptions.RefreshError as exc:
                reason = _reason(exc)
                if exc.retryable:
                    raise TransientStoreError(f"{what} failed: {reason}") from exc
                raise StorePermissionError(f"{what}: refused ({reason})") from exc


def _reason(exc: BaseException) -> str:
    """The first argument of a google-auth error (the token endpoint's error and description)."""
    first = exc.args[0] if exc.args else ""
    return (first if isinstance(first, str) else type(exc).__name__)[:_REASON_LIMIT]


def scope_for(access: str) -> str:
    """The OAuth scope for gcsfs's ``access`` option."""
    if access not in _ACCESS:
        raise ValueError(f"access must be one of {', '.join(_ACCESS)}, got {access!r}")
    return SCOPE_PREFIX + access


def load_token(
    token: Any,
    *,
    url: str,
    timeout: float,
    access: str = "full_control",
    ca_file: str | None = None,
) -> GoogleToken | None:
    """The store's credential for gcsfs's ``token`` option, or None when gcsfs alone serves it.

    See the module doc for what each ``token`` value means.

    Raises:
        StorePermissionError: ``"google_default"`` was asked for and none exist,
            or a credentials file or dict google-auth recognises is invalid.
    """
    scopes = [scope_for(access)]
    make = functools.partial(GoogleToken, url=url, timeout=timeout, ca_file=ca_file)
    if isinstance(token, Credentials):
        return make(token)
    if token == "anon":
        return make(AnonymousCredentials())
    if token == "cloud":
        return make(google.auth.compute_engine.Credentials(scopes=scopes))
    if token in _DEFAULT_TOKENS:
        return _default(token, scopes, url, make)
    info = _info(token)
    if info is not None and info.get("type") in _LOADERS:
        return make(_load(info, scopes, url))
    return None


def _default(token: str | None, scopes: list[str], url: str, make: Callable[..., GoogleToken]) -> GoogleToken | None:
    """Google's application default credentials, with the project they name (as gcsfs takes it).

    A workload identity federation file in ``GOOGLE_APPLICATION_CREDENTIALS``
    is loaded directly (:func:`_external_account`): ``google.auth.default``
    would also look its project up at the Cloud Resource Manager, a request
    with no timeout whose failure fails the load, for a project objckpt does
    not use.
    """
    info = _info(os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") or "")
    if info is not None and info.get("type") == "external_account":
        return make(_load(info, scopes, url))
    try:
        credentials, project = google.auth.default(scopes=scopes)
    except google.auth.exceptions.DefaultCredentialsError as exc:
        if token is None:
            return None  # gcsfs goes on to its token cache, then anonymous
        raise StorePermissionError(f"no Google default credentials for {redact_url(url)}: {_reason(exc)}") from exc
    return make(credentials, project=project)


def _service_account(info: dict[str, Any], scopes: list[str]) -> Credentials:
    return service_account.Credentials.from_service_account_info(info, scopes=scopes)


def _authorized_user(info: dict[str, Any], scopes: list[str]) -> Credentials:
    # no scopes, as gcsfs: a refresh asking for more than the user granted fails with invalid_scope
    return google.oauth2.credentials.Credentials.from_authorized_user_info(info)


def _external_account(info: dict[str, Any], scopes: list[str]) -> Credentials:
    """Workload identity federation credentials, of the kind their ``credential_source`` names
    (the choice ``google.auth.default`` makes), without the project lookup."""
    from google.auth import aws, identity_pool, pluggable

    source = info.get("credential_source") or {}
    kind: Any = identity_pool
    if str(source.get("environment_id", "")).startswith("aws"):
        kind = aws
    elif "executable" in source:
        kind = pluggable
    return kind.Credentials.from_info(info, scopes=scopes)  # type: ignore[no-any-return]


#: The credential files and dicts taken as ``token``, by ``type``, loaded with their own google-auth loader.
_LOADERS: dict[str, Callable[[dict[str, Any], list[str]], Credentials]] = {
    "service_account": _service_account,
    "authorized_user": _authorized_user,
    "external_account": _external_account,
}


def _info(token: Any) -> dict[str, Any] | None:
    """The JSON object ``token`` is or names (a dict, or a path to a JSON file), else None."""
    if isinstance(token, Mapping):
        return dict(token)
    if not isinstance(token, str | os.PathLike) or not os.path.isfile(token):
        return None
    try:
        with open(token, encoding="utf-8") as f:
            content = json.load(f)
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def _load(info: dict[str, Any], scopes: list[str], url: str) -> Credentials:
    """Credentials of a type in :data:`_LOADERS` (a project they name is not used, as by gcsfs)."""
    try:
        return _LOADERS[info["type"]](info, scopes)
    except (ValueError, KeyError, google.auth.exceptions.GoogleAuthError) as exc:
        raise StorePermissionError(
            f"invalid Google {info['type']} credentials for {redact_url(url)}: {type(exc).__name__}"
        ) from exc
