"""Whole manager roots on the command line: ``rm --recursive ROOT``, ``cp ROOT DST``, and
``gc``'s refusal of anything but a root.

``rm --recursive`` removes a whole root (or prefix of checkpoints).
The order is the one :func:`objckpt.manager.checkpoint_manager.delete_checkpoint`
keeps for one checkpoint, applied to all of them: look for live-save markers
under any checkpoint (a save in flight keeps the whole root untouched), delete
every manifest (each checkpoint stops existing at once), look for markers again
(a save that started meanwhile keeps its objects, and the message says only the
manifests went), then delete every other object the first listing held.
``--force`` skips both looks.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from objckpt.cli._stores import UsageError
from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import SaveInProgressError
from objckpt.manager.checkpoint_manager import STEP_DIR, delete_objects
from objckpt.options import Options
from objckpt.progress import human_bytes
from objckpt.saving.live_markers import LIVE_DIR, committed_save_id, explain, is_live, is_marker
from objckpt.storage import ObjectInfo, Store
from objckpt.tools.copy_root import copy_steps
from objckpt.transfer import runtime


def remove_root(args: argparse.Namespace, store: Store, objects: list[ObjectInfo]) -> int:
    """Remove every object under ``store`` (listed as ``objects``), manifests first; the exit status."""
    keys = [o.key for o in objects]
    manifests = [k for k in keys if k == MANIFEST_KEY or k.endswith("/" + MANIFEST_KEY)]
    if not args.force:
        _refuse_if_live(store, objects, args.lease_seconds, "nothing removed")
    runtime.run_sync(delete_objects(store, manifests))
    if not args.force:
        _refuse_if_live(
            store,
            runtime.run_sync(store.list()),
            args.lease_seconds,
            f"deleted the {len(manifests)} manifest(s) only; gc collects the rest after the save",
        )
    chosen = set(manifests)
    runtime.run_sync(delete_objects(store, [k for k in keys if k not in chosen]))
    total = sum(o.size for o in objects)
    if args.json:
        doc = {"url": store.url, "checkpoints": len(manifests), "objects": len(objects), "bytes": total}
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"removed {store.url} and everything under it: {len(manifests)} committed checkpoint(s),"
        f" {len(objects)} objects, {human_bytes(total)}"
    )
    return 0


def _refuse_if_live(store: Store, objects: list[ObjectInfo], lease: float, what: str) -> None:
    """Raise naming the first checkpoint under ``store`` that a live-save marker holds."""
    now = time.time()
    live = [o for o in objects if is_marker(o.key) and is_live(o, lease=lease, now=now)]
    if not live:
        return
    prefix = live[0].key.rpartition(f"{LIVE_DIR}/")[0].rstrip("/")
    held = [m for m in live if m.key.rpartition(f"{LIVE_DIR}/")[0].rstrip("/") == prefix]
    where: Any = store.child(prefix) if prefix else store
    markers = [ObjectInfo(m.key[len(prefix) + 1 :] if prefix else m.key, m.size, m.last_modified) for m in held]
    committed = runtime.run_sync(committed_save_id(where, size_limit=Options.manifest_size_limit))
    more = len(live) - len(held)
    others = f" (and {more} more live marker(s) elsewhere under {store.url})" if more else ""
    raise SaveInProgressError(
        f"{explain(where.url, markers, lease=lease, committed_save_id=committed)}{others}: {what}."
        " Pass --force to remove it anyway (a save still writing then fails at its commit)"
    )


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
        doc = [{"step": n, "copied": s is not None, **(s.to_dict() if s else {})} for n, s in done.items()]
        print(json.dumps(doc, indent=2, default=str))
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
