"""What a URL without a checkpoint is near: a manager root, or a step its root lacks.

``objckpt inspect ROOT`` or ``objckpt.verify("ROOT/40")`` finds no checkpoint
there; "no manifest.json" alone leaves the user guessing. :func:`not_found_hint`
says what the URL is instead: a manager root (its latest committed steps, and
the URL of the newest to try), or a step the root does not hold (the steps
beside it). It costs one listing of the prefix, and one of its parent when the
prefix's last segment names a step (``40``, ``step_40``, ``step_0000000040``);
no step is read. Steps are objckpt's (``step_<N>/manifest.json``) and Orbax's
committed numeric step directories (:mod:`objckpt.roots.orbax_steps`). Read-only;
``inspect``, ``verify`` (:mod:`objckpt.tools`), ``objckpt export`` and ``restore`` (which
sits below this layer and finds :func:`explained` by name) add it to their not-found error.
"""

from __future__ import annotations

import bisect
import re
from typing import Any

from objckpt.errors import CheckpointNotFoundError
from objckpt.options import Options
from objckpt.roots.listing import step_dirs
from objckpt.roots.step_names import SHORT_STEP
from objckpt.storage import Store
from objckpt.transfer import runtime
from objckpt.transfer.retries import opened_store

#: How many steps a hint names: the latest of a root, or those on each side of a missing step.
SHOWN = 5
NEAR = 2
#: A step named with "step" misspelt: ``stpe_40``, ``setp-40``, ``step40``.
_MISSPELT_STEP = re.compile(r"^[step]{2,5}[_-]?(\d+)$", re.IGNORECASE)


def explained(
    error: CheckpointNotFoundError, store: Store, storage_options: dict[str, Any] | None, options: Options
) -> CheckpointNotFoundError:
    """``error`` (no checkpoint at ``store``), with :func:`not_found_hint`'s clause when there is one."""
    hint = not_found_hint(store, storage_options, options)
    return CheckpointNotFoundError(f"{error}{hint}") if hint else error


def not_found_hint(store: Store, storage_options: dict[str, Any] | None, options: Options) -> str:
    """A clause for the "no committed checkpoint at URL" message (``"; ..."``), or ``""``.

    ``store`` is the opened store of the prefix that holds no checkpoint. A listing that
    fails leaves the message as it is (the hint is never worth another error).
    """
    url = str(store.url).rstrip("/")
    try:
        steps = step_dirs(runtime.run_sync(store.list("")), url)
        if steps:
            return _root_hint(url, steps)
        parent, name = _parent_and_step(url)
        if parent is None:
            return ""
        with opened_store(parent, storage_options, options) as root:
            steps = step_dirs(runtime.run_sync(root.list("")), parent)
    except OSError:
        return ""
    return _missing_step_hint(parent, name, steps) if steps else ""


def _parent_and_step(url: str) -> tuple[str | None, int]:
    """The root above ``url`` and the step its last segment names (a misspelt ``stpe_40``
    included); (None, 0) when it names none or the root would be a bucket (never listed
    whole for a hint)."""
    parent, slash, name = url.rpartition("/")
    match = SHORT_STEP.match(name) or _MISSPELT_STEP.match(name)
    if not slash or match is None or not parent or parent.endswith(":/"):
        return None, 0
    scheme, sep, rest = parent.partition("://")
    if sep and "/" not in rest:
        return None, 0
    return parent, int(match.group(1))


def _root_hint(url: str, steps: dict[int, str]) -> str:
    numbers = sorted(steps)
    listed = ", ".join(map(str, numbers[-SHOWN:]))
    which = f", the latest {listed}" if len(numbers) > SHOWN else f": {listed}"
    count = f"{len(numbers)} committed step{'s' if len(numbers) > 1 else ''}"
    return f"; it is a manager root with {count}{which} (try {url}/{steps[numbers[-1]]})"


def _missing_step_hint(root: str, step: int, steps: dict[int, str]) -> str:
    numbers = sorted(steps)
    at = bisect.bisect_left(numbers, step)
    below, above = numbers[max(0, at - NEAR) : at], numbers[at : at + NEAR]
    if step in steps:  # the root holds it, by another name than the URL's (ROOT/step_40 for an Orbax step)
        return f"; the manager root {root} holds step {step} as {root}/{steps[step]}"
    near = ", ".join(map(str, below + above))
    nearest = min(below[-1:] + above[:1], key=lambda n: (abs(n - step), -n))
    return (
        f"; the manager root {root} has no committed step {step}: the steps nearest it are {near}"
        f" ({len(numbers)} in all, the latest {numbers[-1]}; try {root}/{steps[nearest]})"
    )
