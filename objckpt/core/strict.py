"""Strict reading of the JSON documents a checkpoint is made of (the manifest, index objects).

A checkpoint may come from anyone, so its documents are read more strictly than
``json.loads`` does (RFC 8259 §8.1, §6, §4): UTF-8 with no byte-order mark
(``json.loads`` would take UTF-16/32 and a BOM), no ``NaN``/``Infinity`` and no
number that overflows to infinity (``1e999``), and no object with the same key
twice (where ``json.loads`` silently keeps the last one). The field helpers
raise :class:`FormatError` naming the document and the field. No I/O.
"""

from __future__ import annotations

import json
import math
from typing import Any

from objckpt.errors import FormatError


def strict_json(data: bytes, doc: str = "manifest", *, non_finite: bool = False) -> Any:
    """``data`` as JSON under the rules above; ``doc`` names the document in errors.

    ``non_finite`` takes the constants ``NaN``, ``Infinity`` and ``-Infinity`` as floats: a
    document that is a user's value (a ``PerProcess`` JSON value), not one of the format's own.
    A number that overflows a double is refused all the same.
    """
    if data[:3] == b"\xef\xbb\xbf":
        raise FormatError(f"{doc} is not valid JSON: it starts with a UTF-8 byte-order mark")
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray | memoryview) else data
    except UnicodeDecodeError as e:
        raise FormatError(f"{doc} is not valid JSON: not UTF-8 at byte {e.start} ({e.reason})") from None

    def reject_constant(name: str) -> Any:
        if non_finite:
            return float(name)
        raise FormatError(f"{doc} contains the non-JSON constant {name}")

    def finite_float(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise FormatError(f"{doc} contains the number {text[:40]}, which overflows a double")
        return value

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise FormatError(f"{doc} has an object with the key {dup[:100]!r} twice")
        return obj

    try:
        return json.loads(text, parse_constant=reject_constant, parse_float=finite_float, object_pairs_hook=unique_keys)
    except (ValueError, RecursionError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"{doc} is not valid JSON: {e}") from None


def need(cond: bool, where: str, what: str, doc: str = "manifest") -> None:
    """Raise ``FormatError("<doc> field <where>: <what>")`` unless ``cond``."""
    if not cond:
        raise FormatError(f"{doc} field {where}: {what}")


def is_int(x: Any) -> bool:
    """A JSON integer (a bool is not one)."""
    return isinstance(x, int) and not isinstance(x, bool)


def fields(
    obj: Any, where: str, required: set[str], optional: frozenset[str] | set[str] = frozenset(), doc: str = "manifest"
) -> None:
    """``obj`` is an object with every ``required`` key and no key outside ``required | optional``."""
    need(isinstance(obj, dict), where, "must be an object", doc)
    keys = set(obj)
    need(required <= keys, where, f"missing {sorted(required - keys)}", doc)
    need(keys <= required | optional, where, f"unknown {sorted(keys - required - optional)}", doc)
