"""Keys and URLs as every store sees them: validation and credential redaction.

Keys are relative, ``/``-separated, with no empty, ``.`` or ``..`` segment,
so a key can never escape its store's root. URLs shown in messages and
``repr`` lose their user info and query string, where credentials hide.
"""

from __future__ import annotations

import re

#: What a URL scheme may be spelt with (RFC 3986, lower-cased).
SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.\-]*$")


def redact_url(url: str) -> str:
    """``url`` without user info or query string (either may hold credentials).

    Chained fsspec URLs (``simplecache::s3://...``) are redacted link by link;
    plain paths are returned unchanged.
    """
    return "::".join(_redact_one(part) for part in url.split("::"))


def _redact_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    authority, slash, path = rest.partition("/")
    authority = authority.rsplit("@", 1)[-1]
    return f"{scheme}://{authority}{slash}{path}"


_URL_IN_TEXT = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)(?:[^\s/@'\"]*@)?([^\s?'\"]*)\?[^\s'\"]*")


def scrub(text: str) -> str:
    """Drop query strings and user info from URLs quoted in a library's message."""
    return _URL_IN_TEXT.sub(r"\1\2", text)


def check_relative(path: str, what: str, *, allow_empty: bool, allow_partial: bool) -> None:
    """Refuse a key (or prefix) that is not a clean relative ``/`` path.

    Args:
        path: The key, prefix or subpath to check.
        what: Its name in the error message (``"key"``, ``"prefix"``).
        allow_empty: ``""`` is acceptable (the root itself).
        allow_partial: A trailing ``/`` is acceptable (a prefix).

    Raises:
        TypeError: ``path`` is not a ``str``.
        ValueError: absolute, backslashes, NUL, or an empty/``.``/``..`` segment.
    """
    if not isinstance(path, str):
        raise TypeError(f"{what} must be a str, not {type(path).__name__}")
    if not path:
        if allow_empty:
            return
        raise ValueError(f"{what} must not be empty")
    if path.startswith("/") or "\\" in path or "\x00" in path:
        raise ValueError(f"invalid {what} {path!r}: must be relative, '/'-separated")
    parts = path.split("/")
    if allow_partial and parts[-1] == "":
        parts = parts[:-1]  # a prefix may end with "/"
    for part in parts:
        if part in ("", ".", ".."):
            raise ValueError(f"invalid {what} {path!r}: empty, '.' or '..' segment")


def scheme_of(url: str) -> str | None:
    """The lower-cased scheme of ``scheme://...``, or None for a plain path."""
    head, sep, _ = url.partition("://")
    if not sep:
        return None
    scheme = head.lower()
    if not SCHEME_RE.match(scheme):
        raise ValueError(f"invalid URL scheme in {url!r}")
    return scheme
