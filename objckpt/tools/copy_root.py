"""Whole manager roots: copy every committed step.

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
it. Which steps a root holds, and their names, come from :mod:`objckpt.roots`.
"""

from __future__ import annotations

from typing import Any

from objckpt.errors import CheckpointNotFoundError
from objckpt.options import Options
from objckpt.progress import ProgressArg
from objckpt.roots.listing import root_steps
from objckpt.roots.step_names import step_dir
from objckpt.tools.copy import CopyStats, DestinationCommittedError, copy


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
