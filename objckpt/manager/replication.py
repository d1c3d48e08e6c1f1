"""Replicas of a manager's steps, kept in the background while training goes on.

``CheckpointManager(root, replicas=[...])`` hands each step committed at the root
to a :class:`Replicator`: one worker per replica root, on objckpt's I/O loop,
copies ``<root>/step_N`` to ``<replica>/step_N`` with :func:`objckpt.tools.copy`'s
machinery (server-side when both roots are on one provider and account, else
streamed within ``Options.read_window`` bytes), blobs first and ``manifest.json``
last with the same ``save_id``: a replica's step is complete or absent, never
partial, whenever the copy is cut off.

What a worker copies is the difference between the steps the root keeps and
those its replica holds, newest first: a replica that falls behind (slow, or
unreachable for a while) skips to the newest step, says so, and fills in the
older steps still kept afterwards; a step the root's retention deleted
meanwhile is never copied, and what a copy cut off mid-way wrote at the replica is
deleted (:mod:`objckpt.manager.abandoned_copies`). The same retention policies then run
on each replica's own steps, after every copy that lands there. A replica is caught up (:meth:`Replicator.wait`, which
``close`` calls) once it holds every step the root keeps, its retention has run
since its last copy, and its abandoned copies are swept clean; ``close`` then
stops the workers, every wait bounded by a timeout. Nothing here blocks a save: the root's commit never waits
for a replica, and a failing replica is retried with backoff and reported by
:meth:`Replicator.status`. The state starts from one listing of the root and of
each replica, so a run killed mid-replication is caught up by the next one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from objckpt.errors import CheckpointExistsError, CheckpointNotFoundError, SaveInProgressError
from objckpt.layouts.manifest_io import read_manifest
from objckpt.manager.abandoned_copies import AbandonedCopies, exists
from objckpt.manager.retention import KeepBest, RetentionPolicy, StepRecord, steps_to_delete
from objckpt.options import Options
from objckpt.restoring.locations import Location
from objckpt.roots.listing import committed_steps
from objckpt.roots.step_names import step_dir
from objckpt.roots.sweep import delete_checkpoint
from objckpt.storage import Store
from objckpt.transfer import runtime
from objckpt.transfer.retries import RetryingStore, close_store, open_store

log = logging.getLogger("objckpt")

#: Longest wait, in seconds, before a failing replica is tried again.
MAX_BACKOFF_S = 60.0

#: Longest wait, in seconds, of ``close`` for the root's first listing and for its last sweep
#: of abandoned copies (a replica that does not answer is logged, not waited on).
CLOSE_TIMEOUT_S = 30.0


@dataclass
class ReplicaStatus:
    """Where one replica stands (a snapshot: :meth:`CheckpointManager.replica_status`).

    Attributes:
        url: the replica root.
        steps: committed steps at the replica, ascending.
        last_step: the newest of them (None: none yet).
        pending: steps the root holds that the replica does not yet, newest first.
        replicating: the step being copied now, if any.
        lag_steps: how many of the root's steps are newer than ``last_step``.
        lag_seconds: how long ago the root committed the oldest step the replica
            still lacks (0 when it lacks none).
        skipped: steps the replica never got because retention deleted them at the
            root before their turn came (it had fallen behind).
        errors: failed attempts so far.
        last_error: the latest one, with its time.
        bytes_copied: bytes of blobs the replica received.
        client_bytes: bytes that passed through this process to do so (near 0 for
            server-side copies).
        methods: how each step was copied ("server-side" or "streamed"), by step.
    """

    url: str
    steps: list[int] = field(default_factory=list)
    last_step: int | None = None
    pending: list[int] = field(default_factory=list)
    replicating: int | None = None
    lag_steps: int = 0
    lag_seconds: float = 0.0
    skipped: list[int] = field(default_factory=list)
    errors: int = 0
    last_error: str | None = None
    bytes_copied: int = 0
    client_bytes: int = 0
    methods: dict[int, str] = field(default_factory=dict)


@dataclass
class _Replica:
    location: Location
    store: RetryingStore
    have: set[int] = field(default_factory=set)
    conflicts: set[int] = field(default_factory=set)  # steps holding another save there: left alone
    partial: dict[int, set[str]] = field(default_factory=dict)  # copies not committed yet: the keys each writes
    threads: dict[int, set[Any]] = field(default_factory=dict)  # and their calls on worker threads still running
    abandoned: AbandonedCopies = field(init=False)  # copies whose step left the root: swept until settled
    status: ReplicaStatus = field(init=False)
    wake: asyncio.Event | None = None
    ready: bool = False
    retained: bool = False  # the retention policies ran on ``have`` since it last grew

    def __post_init__(self) -> None:
        self.status = ReplicaStatus(self.location.url)
        self.abandoned = AbandonedCopies(self.location.url)

    def settled(self, root_steps: dict[int, float]) -> bool:
        """Retention has run since the last copy, and no abandoned copy is left to sweep."""
        return self.retained and not self.abandoned and all(s in root_steps for s in self.partial)


class Replicator:
    """Background replication of a manager root's steps to replica roots (see the module docstring).

    Args:
        root: the manager's root store.
        replicas: the replica roots.
        options: the manager's options (copies use ``read_window`` as their memory budget).
        policies: the manager's retention policies, applied to each replica's own steps.
        known_metrics: the metrics of the steps the manager knows (for ``KeepBest``);
            others are read from the replica's manifest.
    """

    def __init__(
        self,
        root: RetryingStore,
        replicas: list[Location],
        *,
        options: Options,
        policies: list[RetentionPolicy],
        known_metrics: dict[int, dict[str, Any]],
    ) -> None:
        self.root = root
        self.options = options
        self.copy_options = replace(options, memory_budget=min(options.memory_budget, options.read_window))
        self.policies = policies
        self.known_metrics = known_metrics
        self.root_steps: dict[int, float] = {}  # step -> when the root committed it (as first known here)
        self.replicas: list[_Replica] = []
        self._lock = threading.Lock()  # guards the statuses read from other threads
        self._closing = False
        self._workers: list[asyncio.Task[None]] = []
        opened: list[RetryingStore] = []
        try:
            for location in replicas:
                opened.append(open_store(location.url, location.storage_options, options))
        except BaseException:
            for store in opened:
                close_store(store)
            raise
        self.replicas = [_Replica(loc, store) for loc, store in zip(replicas, opened, strict=True)]
        self._started = runtime.submit(self._start())

    async def _start(self) -> None:
        now = time.time()
        try:
            for step in await committed_steps(self.root):
                self.root_steps.setdefault(step, now)
        except Exception as e:  # the replicas still get every step committed from now on
            log.warning(
                "objckpt could not list %s to catch its replicas up: %s: %s", self.root.url, type(e).__name__, e
            )
        for replica in self.replicas:
            replica.wake = asyncio.Event()
            self._workers.append(asyncio.ensure_future(self._worker(replica)))

    # ------------------------------------------------------------------ the manager's hooks (loop thread)

    async def committed(self, step: int) -> None:
        """The root committed ``step``: every replica should get it."""
        await asyncio.wrap_future(self._started)
        self.root_steps[step] = time.time()
        self._wake_all()

    async def deleted(self, steps: list[int]) -> None:
        """The root's retention deleted ``steps``: no replica needs them any more."""
        await asyncio.wrap_future(self._started)
        for step in steps:
            self.root_steps.pop(step, None)
        self._wake_all()

    def _wake_all(self) -> None:
        for replica in self.replicas:
            if replica.wake is not None:
                replica.wake.set()

    # ------------------------------------------------------------------ one replica's worker

    def _wanted(self, replica: _Replica) -> list[int]:
        return sorted((set(self.root_steps) - replica.have) - replica.conflicts, reverse=True)

    async def _worker(self, replica: _Replica) -> None:
        assert replica.wake is not None
        failures = behind = 0
        while not self._closing:
            step = None
            try:
                await self._drop_abandoned(replica)
                if not replica.ready:
                    replica.have = set(await committed_steps(replica.store))
                    replica.ready, replica.retained = True, False
                if not replica.retained:
                    await self._retain(replica)
                wanted = self._wanted(replica)
                if not wanted:
                    self._publish(replica, None)
                    replica.wake.clear()
                    try:  # an abandoned copy is swept again once it can settle
                        await asyncio.wait_for(replica.wake.wait(), replica.abandoned.next_sweep_in())
                    except TimeoutError:
                        pass
                    continue
                step = wanted[0]
                if len(wanted) > 1 and len(wanted) != behind:
                    log.warning(
                        "objckpt replica %s is %d steps behind: copying the newest, step %d, first",
                        replica.location.url,
                        len(wanted),
                        step,
                    )
                behind = len(wanted)
                self._publish(replica, step)
                await self._replicate(replica, step)
                failures = 0
                await self._retain(replica)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failing replica never stops the training: report, wait, retry
                if step is not None and await self._left_root(step):  # retention deleted it mid-copy
                    log.info(
                        "objckpt replica %s skips step %d: deleted at the root meanwhile", replica.location.url, step
                    )
                    with self._lock:
                        replica.status.skipped.append(step)
                    continue
                failures += 1
                with self._lock:
                    replica.status.errors += 1
                    replica.status.last_error = f"{time.strftime('%H:%M:%S')} {type(e).__name__}: {e}"
                    replica.status.replicating = None
                delay = min(MAX_BACKOFF_S, 0.5 * 2 ** (failures - 1))
                log.warning(
                    "objckpt replication to %s failed (%s: %s); trying again in %.1f s",
                    replica.location.url,
                    type(e).__name__,
                    e,
                    delay,
                )
                replica.wake.clear()
                try:
                    await asyncio.wait_for(replica.wake.wait(), delay)
                except TimeoutError:
                    pass

    async def _left_root(self, step: int) -> bool:
        """Whether ``step`` has left the root (its copy failing then is no error): the root's
        retention said so, or its manifest is gone (retention is deleting it now)."""
        if step not in self.root_steps:
            return True
        try:
            gone = not await exists(self.root.child(step_dir(step)), self.options)
        except Exception:  # the root does not answer: the copy's error stands
            return False
        if gone:
            self.root_steps.pop(step, None)
        return gone

    async def _replicate(self, replica: _Replica, step: int) -> None:
        from objckpt.tools.copy import DestinationCommittedError, copy_stores_async

        name = step_dir(step)
        source, target = self.root.child(name), replica.store.child(name)
        # Kept until the copy commits: if it stops mid-way and the step then leaves the
        # root, what it wrote at the replica is deleted (:meth:`_drop_abandoned`).
        writes = replica.partial.setdefault(step, set())
        try:
            with runtime.threads_joining(replica.threads.setdefault(step, set())):
                stats = await copy_stores_async(source, target, self.copy_options, writes=writes)
        except CheckpointNotFoundError:
            if step in self.root_steps and not await exists(source, self.options):
                self.root_steps.pop(step, None)  # deleted at the root meanwhile: nothing to copy
                with self._lock:
                    replica.status.skipped.append(step)
                return
            raise
        except DestinationCommittedError as e:
            replica.partial.pop(step, None)  # refused before writing anything
            replica.threads.pop(step, None)
            if not e.same:
                replica.conflicts.add(step)
                raise CheckpointExistsError(
                    f"{target.url} holds another checkpoint (save {e.save_id}); left as it is and not replicated"
                ) from None
            replica.have.add(step)  # copied already (a run cut off after the commit)
            replica.retained = False
            return
        replica.partial.pop(step, None)
        replica.threads.pop(step, None)
        replica.have.add(step)
        replica.retained = False
        with self._lock:
            replica.status.bytes_copied += stats.bytes_copied
            replica.status.client_bytes += stats.client_bytes
            replica.status.methods[step] = stats.method
        log.info("objckpt replicated step %d to %s (%s)", step, replica.location.url, stats.summary())

    async def _drop_abandoned(self, replica: _Replica) -> None:
        """Sweep at the replica what the copies of steps that left the root wrote, once each copy
        has stopped (:mod:`objckpt.manager.abandoned_copies`). A step committed there meanwhile
        (the copy's manifest landed, or another writer's) joins the replica's steps instead."""
        for step in [s for s in replica.partial if s not in self.root_steps]:
            writes, threads = replica.partial.pop(step), replica.threads.pop(step, set())
            if writes:  # empty: it stopped before writing anything
                replica.abandoned.add(step, writes, threads)
        if not replica.abandoned:
            return
        committed = await replica.abandoned.sweep(replica.store, self.options) - replica.conflicts
        if committed:
            replica.have |= committed
            replica.retained = False

    async def _retain(self, replica: _Replica) -> None:
        """The manager's retention policies, on the replica's own steps."""
        if not self.policies or not replica.have:
            replica.retained = True
            return

        ranked = any(isinstance(p, KeepBest) for p in self.policies)
        records = [StepRecord(s, await self._metrics(replica, s) if ranked else {}) for s in sorted(replica.have)]
        for step in steps_to_delete(records, self.policies):
            try:
                await delete_checkpoint(replica.store.child(step_dir(step)), lease=self.options.live_marker_lease)
            except SaveInProgressError as e:
                log.warning("objckpt retention left step %d at %s: %s", step, replica.location.url, e)
                continue
            replica.have.discard(step)
            log.info("objckpt retention deleted step %d at the replica %s", step, replica.location.url)
        replica.retained = True

    async def _metrics(self, replica: _Replica, step: int) -> dict[str, Any]:
        if step not in self.known_metrics:
            store = replica.store.child(step_dir(step))
            manifest = await read_manifest(store, size_limit=self.options.manifest_size_limit)
            info = manifest.metadata.get("objckpt.manager", {})
            self.known_metrics[step] = dict(info.get("metrics", {})) if isinstance(info, dict) else {}
        return self.known_metrics[step]

    def _publish(self, replica: _Replica, replicating: int | None) -> None:
        wanted = self._wanted(replica)
        have = sorted(replica.have)
        last = have[-1] if have else None
        newest_missing = [s for s in wanted if last is None or s > last]
        oldest_missing = min(wanted, default=None)
        with self._lock:
            status = replica.status
            status.steps, status.last_step, status.pending = have, last, wanted
            status.replicating = replicating
            status.lag_steps = len(newest_missing)
            status.lag_seconds = 0.0 if oldest_missing is None else time.time() - self.root_steps[oldest_missing]

    # ------------------------------------------------------------------ the manager's calls (any thread)

    def status(self) -> list[ReplicaStatus]:
        """A snapshot of every replica's status."""
        with self._lock:
            return [
                replace(r.status, steps=list(r.status.steps), pending=list(r.status.pending)) for r in self.replicas
            ]

    def wait(self, timeout: float) -> bool:
        """Wait until every replica holds every step the root keeps; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        try:
            self._started.result(timeout=max(0.0, timeout))
        except concurrent.futures.TimeoutError:  # still listing the root (it may be down)
            return False
        while True:
            done = runtime.run_sync(self._caught_up())
            if done or time.monotonic() >= deadline:
                return done
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    async def _caught_up(self) -> bool:
        return all(r.ready and not self._wanted(r) and r.settled(self.root_steps) for r in self.replicas)

    def catch_up(self, timeout: float) -> bool:
        """:meth:`wait`, then a warning naming each replica still behind and what it lacks."""
        if self.wait(timeout):
            return True
        behind = runtime.run_sync(self._behind())
        log.warning("objckpt stopped replicating after %.0f s; behind: %s", timeout, "; ".join(behind))
        return False

    async def _behind(self) -> list[str]:
        said = []
        for replica, status in zip(self.replicas, self.status(), strict=True):
            what = [] if replica.ready else ["not listed yet"]
            if status.pending:
                what.append(f"pending steps {status.pending}")
            if replica.ready and not replica.retained:
                what.append("retention not applied")
            if replica.abandoned or any(s not in self.root_steps for s in replica.partial):
                what.append("abandoned copies not yet deleted")
            if what and status.last_error:
                what.append(f"last error {status.last_error}")
            if what:
                said.append(f"{replica.location.url} ({', '.join(what)})")
        return said

    def close(self) -> None:
        """Stop the workers (a copy cut off leaves no partial step: its manifest goes last), sweep
        the abandoned copies until they settle, and close the stores; each wait is bounded by
        :data:`CLOSE_TIMEOUT_S`, and what is left undone is logged with the replica's URL."""
        self._closing = True

        async def stop() -> None:
            for worker in self._workers:
                worker.cancel()
            await asyncio.gather(*self._workers, return_exceptions=True)
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
            for replica in self.replicas:  # copies cut off here whose step has left the root
                try:
                    while True:
                        await asyncio.wait_for(self._drop_abandoned(replica), deadline - time.monotonic())
                        wait = replica.abandoned.next_sweep_in()
                        if wait is None:
                            break
                        await asyncio.sleep(min(wait, max(0.0, deadline - time.monotonic())))
                except Exception as e:  # gc collects them later
                    log.warning(
                        "objckpt could not delete an abandoned copy at %s: %s: %s (objckpt gc deletes it later)",
                        replica.location.url,
                        type(e).__name__,
                        e,
                    )

        self._started.cancel()  # still listing the root (it may be down): no catching up now
        try:
            if not self._started.cancelled():
                self._started.result(timeout=CLOSE_TIMEOUT_S)
            runtime.run_sync(stop())
        except Exception as e:  # closing must not fail the manager's close
            log.warning("objckpt stopping replication: %s: %s", type(e).__name__, e)
        finally:
            for replica in self.replicas:
                close_store(replica.store)
            self._publish_all()

    def _publish_all(self) -> None:
        for replica in self.replicas:
            self._publish(replica, None)

    async def gc(self, collect: Callable[[Store], Any]) -> list[str]:
        """``collect`` (the manager's gc of one root) on every replica; the keys deleted, as URLs."""
        deleted: list[str] = []
        for replica in self.replicas:
            keys = await collect(replica.store)
            deleted.extend(f"{replica.location.url}/{key}" for key in keys)
        return deleted
