"""Manager roots and their checkpoints on the command line: ``rm`` (one checkpoint, an
Orbax or safetensors one too, or ``--recursive ROOT``), ``cp ROOT DST``, and ``gc``'s refusal of anything but a root.

``rm --recursive`` removes a whole root (or prefix of checkpoints) in the order
:func:`objckpt.roots.sweep.delete_root` keeps (manifests first, a save in flight
never raced); ``--force`` skips its looks for live-save markers.
"""

from __future__ import annotations

import argparse
from typing import Any

from objckpt.cli._output import dump
from objckpt.cli._stores import UsageError
from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import CheckpointNotFoundError, FormatError
from objckpt.layouts.registry import open_checkpoint
from objckpt.options import Options
from objckpt.progress import human_bytes
from objckpt.roots.references import Unknown, referenced_by_others
from objckpt.roots.step_names import STEP_DIR
from objckpt.roots.sweep import delete_checkpoint, delete_objects, delete_root
from objckpt.storage import ObjectInfo, Store
from objckpt.tools.copy_root import copy_steps
from objckpt.transfer import runtime


def remove_root(args: argparse.Namespace, store: Store, objects: list[ObjectInfo]) -> int:
    """Remove every object under ``store`` (listed as ``objects``), manifests first; the exit status."""
    manifests = runtime.run_sync(delete_root(store, objects, lease=args.lease_seconds, force=args.force))
    total = sum(o.size for o in objects)
    if args.json:
        dump({"url": store.url, "checkpoints": len(manifests), "objects": len(objects), "bytes": total})
        return 0
    print(
        f"removed {store.url} and everything under it: {len(manifests)} committed checkpoint(s),"
        f" {len(objects)} objects, {human_bytes(total)}"
    )
    return 0


def remove_checkpoint(args: argparse.Namespace, store: Store, objects: list[ObjectInfo]) -> int:
    """``rm URL`` of one checkpoint (or of objects without a manifest), as the manager deletes a
    step: the blobs other committed checkpoints reference stay, and it says so; the exit status."""
    keys = {o.key for o in objects}
    committed = MANIFEST_KEY in keys
    if not committed and not args.force and (layout := _other_layout(store)) is not None:
        first = [k for k in _MARKERS if k in keys]  # it stops being a checkpoint at once
        runtime.run_sync(delete_objects(store, first))
        runtime.run_sync(delete_objects(store, sorted(keys - set(first))))
        size = sum(o.size for o in objects)
        if args.json:
            dump({"url": store.url, "committed": True, "format": layout, "objects": len(objects), "bytes": size})
        else:
            print(f"removed {layout} checkpoint {store.url}: {len(objects)} objects, {human_bytes(size)}")
        return 0
    if not committed and not args.force:
        try:  # a base whose manifest went: --force would keep its blobs too
            held = runtime.run_sync(referenced_by_others(store, keys, Options().manifest_size_limit))
        except Unknown:
            held = set()
        why = "pass --force to delete them"
        if held == keys:
            why = "committed checkpoints beside it reference them (gc collects them once none does); nothing removed"
        raise CheckpointNotFoundError(f"no committed checkpoint at {store.url} ({len(objects)} objects); {why}")
    gone = {MANIFEST_KEY, *runtime.run_sync(delete_checkpoint(store, lease=args.lease_seconds, force=args.force))}
    size, kept = sum(o.size for o in objects if o.key in gone), [o for o in objects if o.key not in gone]
    counts = {"objects": len(objects) - len(kept), "bytes": size, "kept_objects": len(kept)}
    if args.json:
        dump({"url": store.url, "committed": committed, **counts, "kept_bytes": sum(o.size for o in kept)})
        return 0
    what = "checkpoint" if committed else "uncommitted objects at"
    print(f"removed {what} {store.url}: {counts['objects']} objects, {human_bytes(size)}", end="")
    print(f"; kept {len(kept)} objects that committed checkpoints beside it reference" if kept else "")
    return 0


#: The objects that make a prefix another layout's checkpoint (Orbax's commit files and
#: metadata, a safetensors index or single file): ``rm`` deletes them first.
_MARKERS = (
    "commit_success.txt",
    "_CHECKPOINT_METADATA",
    "_METADATA",
    "model.safetensors.index.json",
    "model.safetensors",
)


def _other_layout(store: Store) -> str | None:
    """The name of the layout other than objckpt's that recognises ``store`` (``"orbax"``,
    ``"safetensors"``), or None."""
    try:
        return open_checkpoint(store).format
    except (CheckpointNotFoundError, FormatError):
        return None


def copy_root(
    args: argparse.Namespace,
    src_options: dict[str, Any],
    dst_options: dict[str, Any],
    *,
    steps: list[int] | None,
    options: Options,
) -> int:
    """``cp ROOT DST``: every committed step of an objckpt manager root (or those of ``--steps``)."""
    done = copy_steps(
        args.src,
        args.dst,
        steps=steps,
        src_storage_options=src_options,
        dst_storage_options=dst_options,
        options=options,
        verify_existing=not args.trust_existing,
        server_side=not getattr(args, "no_server_side", False),
        progress=args.progress,
    )
    if args.json:
        dump([{"step": n, "copied": s is not None, **(s.to_dict() if s else {})} for n, s in done.items()])
        return 0
    for step, stats in done.items():
        said = stats.summary() if stats else "already at the destination (same save), left as it is"
        print(f"step {step}: {said}")
    copied = sum(s is not None for s in done.values())
    print(f"cp {args.src} -> {args.dst}: {copied} step(s) copied, {len(done) - copied} already there")
    return 0


def refuse_a_checkpoint(store: Any) -> None:
    """``gc`` works on a manager root: a step or a single checkpoint is a usage error, not "0 deleted"."""
    base = store.url.rstrip("/")
    name = base.rpartition("/")[2]
    try:
        runtime.run_sync(store.head(MANIFEST_KEY))
        committed = True
    except FileNotFoundError:
        committed = False
    if committed or STEP_DIR.match(name):
        what = "a step of a manager root" if STEP_DIR.match(name) else "a checkpoint"
        hint = f" (objckpt gc {base.rpartition('/')[0]})" if STEP_DIR.match(name) else ""
        raise UsageError(f"gc needs a manager root, the prefix holding step_*/ directories{hint}; {base} is {what}")
