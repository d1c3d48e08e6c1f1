"""How the commands print: JSON documents (``--json``), aligned tables, times.

Every command's machine-readable output goes through :func:`dump`, so all of
them indent and stringify the same way; tables and times read the same in
``ls``, ``ls --replicas`` and ``inspect``.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Collection
from typing import Any


def dump(doc: Any) -> None:
    """Print ``doc`` as indented JSON on stdout (what JSON cannot hold, as its ``str``)."""
    print(json.dumps(doc, indent=2, default=str))


def table(header: list[str], rows: list[list[str]], right: Collection[int] = frozenset()) -> str:
    """``rows`` under ``header`` in columns two spaces apart; the columns in ``right`` right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = []
    for row in [header, *rows]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def utc_time(t: float | None) -> str:
    """A POSIX time as ``2026-01-31 12:00:00`` (UTC); ``-`` for none."""
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def iso_time(t: float | None) -> str | None:
    """A POSIX time as ISO 8601 in UTC, to the second (``2026-01-31T12:00:00Z``); None for none."""
    if t is None:
        return None
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
