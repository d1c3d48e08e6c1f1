"""Storage option names checked against the client that takes them, before it sees them.

An fsspec filesystem hands the keyword arguments it does not name on: s3fs to botocore's
session, which fails with a ``TypeError`` naming ``AioSession.__init__()``; gcsfs and the
local filesystem keep them unused, so a misspelt option is dropped without a word. Here an
option is known when the filesystem class, or what it hands its ``**kwargs`` to, names it
as a keyword parameter (read from their signatures, so new client releases need no list).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from objckpt.errors import StorageOptionError
from objckpt.storage.urls import redact_url

#: Options every fsspec filesystem takes (its instance and listings caches), whatever its class names.
FSSPEC_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"})


def known_names(*takers: Any) -> set[str]:
    """Every keyword parameter of the ``__init__`` of ``takers`` (classes, with their bases) or of
    ``takers`` themselves (functions)."""
    known: set[str] = set()
    for taker in takers:
        for owner in taker.__mro__ if isinstance(taker, type) else (taker,):
            init = owner.__dict__.get("__init__") if isinstance(owner, type) else owner
            if init is None or owner is object:
                continue
            for p in inspect.signature(init).parameters.values():
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                    known.add(p.name)
    return known


def check_storage_options(url: str, options: Mapping[str, Any], *takers: Any, extra: Iterable[str] = ()) -> None:
    """Refuse a storage option that none of ``takers`` names (``extra``: objckpt's own options).

    Raises:
        StorageOptionError: naming the unknown option(s), the URL, and the nearest known name.
    """
    known = known_names(*takers) | FSSPEC_OPTIONS | set(extra)
    unknown = sorted(str(k) for k in options if k not in known)
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
    names = ", ".join(repr(k) for k in unknown)
    raise StorageOptionError(
        f"unknown storage option{'s' if len(unknown) > 1 else ''} {names} for {redact_url(url)}"
        + (f" (did you mean {close[0]!r}?)" if close else "")
    )


def check_fsspec_options(url: str, options: Mapping[str, Any], kind: str) -> None:
    """:func:`check_storage_options` against the fsspec client of ``kind`` (``"s3"``: s3fs and
    botocore's session, to which s3fs hands the rest; ``"gcs"``: gcsfs), where it is installed.
    No options: nothing to check, and the client is not imported."""
    if not options:
        return
    try:
        if kind == "s3":
            session = importlib.import_module("aiobotocore.session").AioSession
            takers = [importlib.import_module("s3fs").S3FileSystem, session]
        else:
            takers = [importlib.import_module("gcsfs").GCSFileSystem]
    except ImportError:
        return
    check_storage_options(url, options, *takers, extra=("request_timeout", "ca_bundle") if kind == "gcs" else ())
