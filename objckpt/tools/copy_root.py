"""Whole manager roots: copy every committed step, and find a step named the short way.

:func:`copy_steps` copies the committed steps of an objckpt ``CheckpointManager``
root (all, or some) to another root, one :func:`objckpt.tools.copy.copy` per
step, so each step is copied the way a single checkpoint is: server-side where
the two stores allow, streamed otherwise, manifest last. A step directory
without a manifest (a save in flight or killed) is not a step and is left out.
A step already committed at the destination by the same save (same
``save_id``) is skipped before anything is written, so rerunning a copy that was
cut off resumes it: finished steps cost one manifest read each, and the step
that was cut off keeps the blobs it had copied. A step committed at the
destination by another save is never overwritten: the copy stops there, naming
it.

:func:`resolve_step_url` lets a user name a step of a root as ``ROOT/300`` or
``ROOT/step_300``: when nothing is stored at that literal path and the root holds
``step_0000000300/``, that is the checkpoint meant. The literal path wins
whenever it holds anything (an Orbax step is ``ROOT/300/``).

The manager's naming is imported inside the functions: the command line imports
this module, and the manager's module brings JAX with it.
"""

from __future__ import annotations

import re
from typing import Any

from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import CheckpointNotFoundError
from objckpt.options import Options
from objckpt.progress import ProgressArg
from objckpt.storage.base import Store
from objckpt.tools.copy import CopyStats, DestinationCommittedError, copy
from objckpt.transfer import runtime
from objckpt.transfer.engine import opened_store

#: How a user may name step N of a root: ``N`` or ``step_N`` (any zero padding).
SHORT_STEP = re.compile(r"^(?:step_)?(\d+)$")


def root_steps(
    root_url: str, storage_options: dict[str, Any] | None = None, options: Options | None = None
) -> list[int]:
    """The committed steps of the objckpt manager root at ``root_url`` (one listing), ascending."""
    from objckpt.manager.checkpoint_manager import committed_steps

    with opened_store(root_url, storage_options, options or Options()) as store:
        return runtime.run_sync(committed_steps(store))


def copy_steps(
    src_root: str,
    dst_root: str,
    *,
    steps: list[int] | None = None,
    src_storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    verify_existing: bool = True,
    server_side: bool = True,
    progress: ProgressArg = False,
) -> dict[int, CopyStats | None]:
    """Copy the committed steps of the manager root ``src_root`` (all, or ``steps``) to ``dst_root``.

    Each step goes to ``dst_root/step_<N>`` as :func:`objckpt.tools.copy.copy` copies a
    checkpoint (the other arguments are its own). Steps are copied oldest first.

    Returns:
        Per step, its :class:`CopyStats`, or None when the destination already held that
        step committed by the same save (left as it is: rerunning resumes).

    Raises:
        CheckpointNotFoundError: ``src_root`` holds no committed step, or not one of ``steps``.
        DestinationCommittedError: a step at the destination was committed by another save
            (left intact; the steps before it are copied).
    """
    from objckpt.manager.checkpoint_manager import step_dir

    options = options or Options()
    found = root_steps(src_root, src_storage_options, options)
    if not found:
        raise CheckpointNotFoundError(f"no committed step under {src_root} (an objckpt manager root holds step_*/)")
    missing = sorted(set(steps or []) - set(found))
    if missing:
        raise CheckpointNotFoundError(
            f"no committed step {', '.join(map(str, missing))} under {src_root} (its steps: {_some(found)})"
        )
    out: dict[int, CopyStats | None] = {}
    for step in sorted(found if steps is None else set(steps)):
        name = step_dir(step)
        try:
            out[step] = copy(
                f"{src_root.rstrip('/')}/{name}",
                f"{dst_root.rstrip('/')}/{name}",
                src_storage_options=src_storage_options,
                dst_storage_options=dst_storage_options,
                options=options,
                verify_existing=verify_existing,
                server_side=server_side,
                progress=progress,
            )
        except DestinationCommittedError as there:
            if not there.same:
                raise DestinationCommittedError(
                    f"step {step} at {dst_root.rstrip('/')}/{name} was committed by another save"
                    f" (save_id {there.save_id}); left intact, copied the steps before it only",
                    save_id=there.save_id,
                    same=False,
                ) from None
            out[step] = None
    return out


def _some(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (f", ... ({len(steps)} in all)" if len(steps) > 8 else "")


def resolve_step_url(url: str, storage_options: dict[str, Any] | None = None, options: Options | None = None) -> str:
    """``ROOT/300`` or ``ROOT/step_300`` → ``ROOT/step_0000000300`` when that is the step meant.

    The URL is returned as it is unless its last segment names a step the short way,
    nothing at all is stored under it, and the root holds that step's directory
    (committed or not: ``rm --force`` removes an uncommitted one). Costs two or
    three requests, and none for a URL already in the long form.
    """
    from objckpt.manager.checkpoint_manager import step_dir

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
