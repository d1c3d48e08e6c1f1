"""Incremental checkpoints' references: a piece stored in an earlier checkpoint (docs/FORMAT.md, "Bases").

A checkpoint saved with ``base=`` lists, in its root's optional ``bases`` field, the earlier
checkpoints whose blobs its pieces point into: each by its name (one path component, a sibling
of the checkpoint under the same parent prefix) and its ``save_id``. A blob of such a base
appears in an index object's ``blobs`` as the **reference key** ``../<name>/<hh>/<file>``, where
``<file>`` is ``<save_id>-p<process>-<seq>.blob`` with the ``save_id`` the root gives ``<name>``.

The reader's checks (here, pure): a reference leads to a sibling the root names, one level up and
no further, and to a blob of the very save the root names for it; nothing else may start with
``../``. Older readers refuse a root with ``bases`` (an unknown field) and any reference key
(an unsafe blob key), so none misreads one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from objckpt.core.format.schema import check_blob_key
from objckpt.core.strict import fields, need

REF_PREFIX = "../"
#: A base's name: one path component, as a manager root's ``step_0000000300``.
_NAME = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,255}$")
_SAVE_ID = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")
_BLOB_FILE = re.compile(r"^[0-9a-f]{2}/([A-Za-z0-9_\-]{1,128})-p[0-9]+-[0-9]+\.blob$")


class Base(NamedTuple):
    """An earlier checkpoint a checkpoint's pieces point into: a sibling ``name`` and its ``save_id``."""

    name: str
    save_id: str


def is_ref(key: str) -> bool:
    """True when ``key`` is a reference key (it leads into a base)."""
    return key.startswith(REF_PREFIX)


def ref_key(name: str, key: str) -> str:
    """The reference key of blob ``key`` of the sibling checkpoint ``name``."""
    return f"{REF_PREFIX}{name}/{key}"


def split_ref(key: str) -> tuple[str, str]:
    """``(name, key inside that base)`` of a reference key (not checked: see :func:`check_ref_key`)."""
    name, _, rest = key[len(REF_PREFIX) :].partition("/")
    return name, rest


def check_name(name: Any) -> bool:
    """True when ``name`` is one safe path component (no ``.``, ``..`` or ``/``)."""
    return isinstance(name, str) and bool(_NAME.match(name)) and name not in (".", "..")


def check_ref_key(key: str, bases: Mapping[str, str]) -> bool:
    """True when reference ``key`` leads to a blob of one of ``bases`` (name → save_id), and of no other save."""
    if not is_ref(key):
        return False
    name, rest = split_ref(key)
    save_id = bases.get(name)
    if save_id is None or not check_name(name) or not check_blob_key(rest):
        return False
    match = _BLOB_FILE.match(rest)
    return match is not None and match.group(1) == save_id


def bases_to_json(bases: tuple[Base, ...]) -> list[dict[str, str]]:
    return [{"name": b.name, "save_id": b.save_id} for b in bases]


def bases_from_json(raw: Any, own_save_id: str) -> tuple[Base, ...]:
    """The root's ``bases``: a non-empty list of ``{name, save_id}``, names distinct, none the checkpoint's own id."""
    need(isinstance(raw, list) and 0 < len(raw) <= 1_000_000, "'bases'", "must be a non-empty list")
    out: list[Base] = []
    names: set[str] = set()
    for i, b in enumerate(raw):
        where = f"'bases[{i}]'"
        fields(b, where, {"name", "save_id"}, set())
        need(check_name(b["name"]), f"{where}.name", f"must be one safe path component, got {str(b['name'])[:200]!r}")
        need(b["name"] not in names, f"{where}.name", f"base {b['name']!r} listed twice")
        sid = b["save_id"]
        need(isinstance(sid, str) and bool(_SAVE_ID.match(sid)), f"{where}.save_id", "must be a save id")
        need(sid != own_save_id, f"{where}.save_id", "is the checkpoint's own save_id")
        names.add(b["name"])
        out.append(Base(b["name"], sid))
    return tuple(out)


def root_relative(step: str, key: str) -> str:
    """Blob ``key`` of checkpoint ``step`` as a key relative to their parent (a reference resolved)."""
    if is_ref(key):
        name, rest = split_ref(key)
        return f"{name}/{rest}"
    return f"{step}/{key}"
