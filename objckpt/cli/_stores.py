"""Store options for the command line: flags → fsspec-style ``storage_options``.

Flags cover what users of ``aws s3`` / ``gsutil`` / fsspec reach for most:
``--endpoint-url``, ``--region``, ``--anon``, and ``--storage-option KEY=VALUE``
(repeatable; VALUE is JSON when it parses as JSON, a string otherwise; a dotted
KEY such as ``client_kwargs.region_name`` builds nested options). Everything
else comes from the usual environment, which the stores read themselves:
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_ENDPOINT_URL(_S3)``, ``AWS_DEFAULT_REGION``/``AWS_REGION``, AWS profiles,
``GOOGLE_APPLICATION_CREDENTIALS``, ``STORAGE_EMULATOR_HOST``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from objckpt.storage.urls import scheme_of

#: Option names and environment variables whose values must never be printed.
SECRET_OPTION_NAMES = frozenset(
    {"key", "secret", "token", "password", "username", "aws_access_key_id", "aws_secret_access_key",
     "aws_session_token", "access_key", "secret_key", "session_token", "client_secret"}
)  # fmt: skip
SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


class UsageError(ValueError):
    """A command line that cannot work (exit status 2)."""


def add_store_flags(parser: argparse.ArgumentParser, side: str = "") -> None:
    """Add the store flags; ``side`` is ``"src"`` or ``"dst"`` for ``cp`` (``--src-region``...)."""
    p = f"{side}-" if side else ""
    what = f"the {'source' if side == 'src' else 'destination'} store" if side else "the store"
    group = parser.add_argument_group(f"{what.removeprefix('the ')} options" if side else "store options")
    group.add_argument(f"--{p}endpoint-url", metavar="URL", help=f"endpoint of {what} (S3-compatible or GCS)")
    group.add_argument(f"--{p}region", metavar="REGION", help=f"S3 region of {what}")
    group.add_argument(f"--{p}anon", action="store_true", help=f"unsigned/anonymous access to {what}")
    names = [f"--{p}storage-option", f"--{p}option"] if side else ["--storage-option", "-o"]
    group.add_argument(
        *names,
        dest=f"{side}_storage_option" if side else "storage_option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"any storage option of {what} (repeatable; JSON values; dotted keys nest)",
    )


def options_from_args(args: argparse.Namespace, url: str, side: str = "") -> dict[str, Any]:
    """The ``storage_options`` for ``url`` from the flags of ``side``."""
    p = f"{side}_" if side else ""
    return storage_options(
        url,
        endpoint_url=getattr(args, f"{p}endpoint_url"),
        region=getattr(args, f"{p}region"),
        anon=getattr(args, f"{p}anon"),
        pairs=getattr(args, f"{p}storage_option"),
        flag_prefix=f"--{side}-" if side else "--",
    )


def storage_options(
    url: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    anon: bool = False,
    pairs: list[str] | None = None,
    flag_prefix: str = "--",
) -> dict[str, Any]:
    """Translate the flags for ``url``'s scheme; a flag that cannot apply is a :class:`UsageError`."""
    scheme = scheme_of(url) or "file"
    out: dict[str, Any] = {}
    s3 = scheme in ("s3", "s3a")
    gcs = scheme in ("gs", "gcs")
    for flag, given, ok in (
        ("endpoint-url", endpoint_url, s3 or gcs),
        ("region", region, s3),
        ("anon", anon, s3 or gcs),
    ):
        if given and not ok:
            raise UsageError(f"{flag_prefix}{flag} does not apply to {scheme}:// URLs")
    if endpoint_url:
        out["endpoint_url"] = endpoint_url
    if region:
        out["client_kwargs"] = {"region_name": region}
    if anon:
        if s3:
            out["anon"] = True
        else:
            out["token"] = "anon"
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag_prefix}storage-option wants KEY=VALUE, got {pair.split('=')[0]!r}...")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        _set_nested(out, key.split("."), value)
    return out


def _set_nested(target: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        child = target.get(part)
        if not isinstance(child, dict):
            child = target[part] = {}
        target = child
    target[path[-1]] = value


def secret_values(*option_sets: dict[str, Any]) -> list[str]:
    """Credential strings from storage options and the environment, to scrub from any message."""
    found: list[str] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                if isinstance(v, str) and str(k).lower() in SECRET_OPTION_NAMES and len(v) >= 4:
                    found.append(v)
                else:
                    walk(v)

    for options in option_sets:
        walk(options)
    found.extend(v for name in SECRET_ENV if len(v := os.environ.get(name, "")) >= 4)
    return sorted(set(found), key=len, reverse=True)


def redact(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"2G"``, ``"1048576"`` → bytes."""
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
             "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
             "tib": 1 << 40}  # fmt: skip
    s = text.strip().lower()
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = s[len(number) :].strip()
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)") from None
    if unit not in units or value <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)")
    return int(value * units[unit])
