"""``objckpt ls ROOT --replicas URL...``: which steps exist where.

One listing per location (no blob read) says which steps are committed there
and which hold objects but no manifest (a copy in progress, or cut off); then
the manifest of each committed step is read, concurrently, to tell a copy of
the root's checkpoint (same ``save_id``) from another checkpoint under the same
step number, which a restore with replicas never mixes in. A location that does
not answer is shown as ``unreachable``, with a warning naming its error, and the
others are still listed (a root down while its replicas hold every step); only
when no location answers is it an error.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from objckpt.cli._output import dump, table
from objckpt.cli._stores import options_from_args
from objckpt.errors import CheckpointNotFoundError
from objckpt.layouts.manifest_io import read_manifest
from objckpt.options import Options
from objckpt.roots.listing import group_checkpoints
from objckpt.transfer import runtime
from objckpt.transfer.retries import close_store, open_store

#: How a step stands at one location.
COPY, OTHER, PARTIAL, ABSENT, UNREACHABLE = "yes", "other save", "partial", "-", "unreachable"


async def _location(store: Any, options: Options) -> dict[int, tuple[bool, str | None]]:
    """Step -> (committed, save_id) at one location."""
    entries = [e for e in group_checkpoints(await store.list()) if e.step is not None and e.format == "objckpt"]

    async def save_id(entry: Any) -> str | None:
        if not entry.committed:
            return None
        try:
            return (await read_manifest(store.child(entry.name), size_limit=options.manifest_size_limit)).save_id
        except CheckpointNotFoundError:
            return None

    ids = await asyncio.gather(*(save_id(e) for e in entries))
    return {e.step: (e.committed, sid) for e, sid in zip(entries, ids, strict=True) if e.step is not None}


def cmd_ls_replicas(args: argparse.Namespace) -> int:
    """Steps × locations: ``yes`` (a copy of the root's step), ``other save``, ``partial``, ``-``."""
    options = Options()
    urls = [args.root, *args.replicas]
    stores = [open_store(url, options_from_args(args, url), options) for url in urls]
    try:
        answers = runtime.run_sync(_gather(stores, options))
    finally:
        for store in stores:
            close_store(store)
    failed = [(store.url, e) for store, e in zip(stores, answers, strict=True) if isinstance(e, BaseException)]
    if len(failed) == len(stores):
        raise failed[0][1]
    for url, e in failed:
        print(f"objckpt: warning: {url} did not answer ({type(e).__name__}: {e})", file=sys.stderr)
    found = [{} if isinstance(at, BaseException) else at for at in answers]
    root = found[0]
    if isinstance(answers[0], BaseException):  # the root is down: the first replica holding a step stands for it
        root = {}
        for at in reversed(found[1:]):
            root.update({step: seen for step, seen in at.items() if seen[0]})
    steps = sorted(set().union(*found))

    def state(at: dict[int, tuple[bool, str | None]] | BaseException, step: int) -> str:
        if isinstance(at, BaseException):
            return UNREACHABLE
        if step not in at:
            return ABSENT
        committed, save_id = at[step]
        if not committed:
            return PARTIAL
        reference = root.get(step, (False, None))[1]
        return COPY if reference is None or save_id == reference else OTHER

    names = [store.url for store in stores]
    if args.json:
        dump(
            [
                {
                    "step": step,
                    "save_id": root.get(step, (False, None))[1],
                    "locations": {n: state(at, step) for n, at in zip(names, answers, strict=True)},
                }
                for step in steps
            ]
        )
        return 0
    if not steps:
        print(f"no steps under {', '.join(names)}")
        return 0
    for i, name in enumerate(names):
        print(f"[{i}] {name}" + (" (root)" if i == 0 else ""))
    rows = [[str(step)] + [state(at, step) for at in answers] for step in steps]
    print(table(["STEP"] + [f"[{i}]" for i in range(len(names))], rows, right={0}))
    return 0


async def _gather(stores: list[Any], options: Options) -> list[dict[int, tuple[bool, str | None]] | BaseException]:
    """Each location's steps, or the error it answered with."""
    return list(await asyncio.gather(*(_location(s, options) for s in stores), return_exceptions=True))
