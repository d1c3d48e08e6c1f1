"""Copies to a replica abandoned mid-way: what they wrote there is deleted, late writes included.

A copy of ``step_N`` to a replica (:mod:`objckpt.manager.replication`) is abandoned when the
step leaves the root while the copy is in flight (the root's retention deleted it), or when
``close`` cuts off the copy of a step the root no longer keeps. The copy's requests are then
cancelled, but a request the client stopped waiting for can still land at the replica: a
write on a worker thread (a local or mounted disk) finishes whatever its caller does, as
does a server-side copy call on its thread pool, and a server may carry out a request whose
reply was never read. One listing right after the copy stopped misses those.

So each abandoned copy is kept here with the keys it writes (its blobs and index objects,
known before it wrote anything) and its calls still running on worker threads
(:func:`objckpt.transfer.runtime.threads_joining`), until a sweep finds none of those keys at
the replica at least :data:`SETTLE_S` seconds after the copy stopped and its last thread
returned, however long that took; every sweep deletes those it finds. A key found late arms
the wait again. What a server carries out more than :data:`SETTLE_S` after its client stopped
waiting (a server-side copy of a very large blob) can land after the last sweep: what it
wrote is ``gc``'s, as a killed process's is. A step whose
manifest is at the replica is committed there (the copy's own manifest landed, or another
writer's): it is left to the replica's retention, never deleted here.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from objckpt.errors import CheckpointNotFoundError
from objckpt.layouts.manifest_io import read_manifest
from objckpt.options import Options
from objckpt.roots.step_names import step_dir
from objckpt.roots.sweep import delete_objects
from objckpt.storage import Store

log = logging.getLogger("objckpt")

#: Seconds after an abandoned copy stopped during which a write it started may still land.
SETTLE_S = 2.0


@dataclass
class AbandonedCopy:
    """One abandoned copy: its step, the keys it writes, and when a clean sweep settles it."""

    step: int
    writes: set[str]
    settle_at: float  # time.monotonic()
    threads: set[concurrent.futures.Future[Any]] = field(default_factory=set)  # those still running


class AbandonedCopies:
    """The abandoned copies of one replica not yet settled (see the module docstring)."""

    def __init__(self, url: str, settle_s: float = SETTLE_S) -> None:
        self.url = url
        self.settle_s = settle_s
        self.copies: dict[int, AbandonedCopy] = {}

    def __bool__(self) -> bool:
        return bool(self.copies)

    def add(self, step: int, writes: set[str], threads: set[concurrent.futures.Future[Any]] | None = None) -> None:
        """The copy of ``step``, which writes ``writes``, has stopped (its coroutine returned);
        ``threads``: its calls on worker threads, each in the set until it returns."""
        known = self.copies.get(step)
        keys = set(writes) | (known.writes if known is not None else set())
        running = (threads or set()) | (known.threads if known is not None else set())
        self.copies[step] = AbandonedCopy(step, keys, time.monotonic() + self.settle_s, running)

    def next_sweep_in(self) -> float | None:
        """Seconds until the earliest copy can settle; None when there is none."""
        if not self.copies:
            return None
        return max(0.0, min(c.settle_at for c in self.copies.values()) - time.monotonic())

    async def sweep(self, store: Store, options: Options) -> set[int]:
        """Delete at the replica ``store`` what each abandoned copy wrote; forget the copies a
        sweep after their settling time found clean. Returns the steps found committed there."""
        committed: set[int] = set()
        for copy in list(self.copies.values()):
            target = store.child(step_dir(copy.step))
            if await exists(target, options):
                committed.add(copy.step)
                del self.copies[copy.step]
                continue
            if any(not f.done() for f in list(copy.threads)):  # a write on its thread may still land
                copy.settle_at = max(copy.settle_at, time.monotonic() + self.settle_s)
            listed_at = time.monotonic()
            doomed = [o.key for o in await target.list() if o.key in copy.writes]
            await delete_objects(target, doomed)
            if doomed:
                log.info(
                    "objckpt replica %s: deleted %d objects of an abandoned copy of step %d (the step left the root)",
                    self.url,
                    len(doomed),
                    copy.step,
                )
                if listed_at >= copy.settle_at:  # a write landed late: more may follow
                    copy.settle_at = listed_at + self.settle_s
            elif listed_at >= copy.settle_at:
                del self.copies[copy.step]
        return committed


async def exists(store: Store, options: Options) -> bool:
    """Whether a committed checkpoint (its manifest) is at ``store``."""
    try:
        await read_manifest(store, size_limit=options.manifest_size_limit)
    except CheckpointNotFoundError:
        return False
    return True
