"""A manager root's step names: ``<root>/step_0000000042/``, and a step named the short way.

Each step is a checkpoint like any other, in a directory whose name is the step
zero-padded to ten digits (so listing order is step order). A step is committed
iff its ``manifest.json`` exists, so the committed steps come from one listing
and no blob read (:func:`objckpt.roots.listing.committed_steps`).

A user may name step N of a root as ``ROOT/N`` or ``ROOT/step_N`` (any zero
padding): :func:`resolve_step_url` turns that into the step's directory when
nothing is stored at the literal path and the root holds the step. The literal
path wins whenever it holds anything (an Orbax step is ``ROOT/300/``).
"""

from __future__ import annotations

import re
from typing import Any

from objckpt.core.format import MANIFEST_KEY
from objckpt.options import Options
from objckpt.storage.base import Store
from objckpt.transfer import runtime
from objckpt.transfer.retries import opened_store

#: A step directory's name; the step number is group 1.
STEP_DIR = re.compile(r"^step_(\d{10,})$")
#: How a user may name step N of a root: ``N`` or ``step_N`` (any zero padding).
SHORT_STEP = re.compile(r"^(?:step_)?(\d+)$")


def step_dir(step: int) -> str:
    """The directory name of a step; zero-padded so lexical order is numeric order."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:010d}"


def resolve_step_url(url: str, storage_options: dict[str, Any] | None = None, options: Options | None = None) -> str:
    """``ROOT/300`` or ``ROOT/step_300`` → ``ROOT/step_0000000300`` when that is the step meant.

    The URL is returned as it is unless its last segment names a step the short way,
    nothing at all is stored under it, and the root holds that step's directory
    (committed or not: ``rm --force`` removes an uncommitted one). Costs two or
    three requests, and none for a URL already in the long form.
    """
    base = url.rstrip("/")
    parent, slash, name = base.rpartition("/")
    match = SHORT_STEP.match(name)
    at_top = "/" not in base.partition("://")[2] if "://" in base else False  # a bucket, not a key
    if not slash or not parent or at_top or match is None or name == step_dir(int(match.group(1))):
        return url
    full = step_dir(int(match.group(1)))
    with opened_store(parent, storage_options, options or Options()) as store:
        if runtime.run_sync(_holds_step(store, name, full)):
            return f"{parent}/{full}"
    return url


async def _holds_step(store: Store, literal: str, full: str) -> bool:
    if await store.list(f"{literal}/"):
        return False
    try:
        await store.head(f"{full}/{MANIFEST_KEY}")
        return True
    except FileNotFoundError:
        return bool(await store.list(f"{full}/"))
