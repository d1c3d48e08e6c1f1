"""CheckpointManager: numbered steps under one root, async saves, retention, gc.

A root holds steps: ``<root>/step_0000000042/`` is a checkpoint like any other (zero-padded
so listing order is step order; :mod:`objckpt.roots` names, lists, deletes and
sweeps steps). A step is committed iff its ``manifest.json`` exists, so listing
steps reads no blobs and a crash at any moment never leaves a half-written step
looking committed. Deleting a step removes its manifest
first, then its blobs; ``gc`` sweeps blobs that no manifest references once
they are older than a grace period. Neither touches a step holding a live-save
marker (:mod:`objckpt.saving.live_markers`), whatever the grace period, so they never race a
save in flight; the save's commit also checks its blobs are all there.

At most one save is in flight per manager: ``save`` first waits for the
previous one and re-raises its error, so errors are never lost.

Which steps save is the manager's :class:`~objckpt.manager.save_policy.SavePolicy`
(``save_interval_steps``, ``save_on_steps``, ``final_step``, ``min_interval_seconds``,
``continuous``) plus preemption (:mod:`objckpt.manager.preemption`): ``save(step, ...)``
saves only when :meth:`CheckpointManager.should_save` says so, unless ``force=True``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from objckpt.core.metadata import to_json_value
from objckpt.errors import CheckpointExistsError, CheckpointNotFoundError
from objckpt.manager.preemption import Preemption
from objckpt.manager.replication import ReplicaStatus, Replicator
from objckpt.manager.retention import RetentionPolicy
from objckpt.manager.save_policy import SavePolicy
from objckpt.manager.save_schedule import SaveSchedule
from objckpt.manager.settings import LocalCopies, Replication, Retention, grouped
from objckpt.manager.step_deletion import apply_retention, delete_step, gc_root, gc_roots
from objckpt.manager.step_reads import StepReads
from objckpt.options import Options
from objckpt.restoring.locations import Location, as_locations
from objckpt.roots.listing import committed_steps, list_steps
from objckpt.storage import Store
from objckpt.tools.inspect import CheckpointInfo
from objckpt.transfer import runtime
from objckpt.transfer.retries import close_store, open_store

if TYPE_CHECKING:
    from objckpt.manager.tiers import Tiers, TierStatus
    from objckpt.saving.api import SaveHandle

# Saving, restoring and multihost import JAX, so the methods that use them import them: the
# root's step names, listing and deletion (objckpt.roots: `objckpt rm`, `gc`) run without JAX.

log = logging.getLogger("objckpt")


class CheckpointManager:
    """Saves numbered steps under ``root_url`` and keeps what the retention policies say.

    Args:
        root_url: where step directories live.
        storage_options: passed to the store.
        options: tuning for saves and restores.
        save_rules: which steps :meth:`save` saves (:class:`~objckpt.manager.save_policy.SavePolicy`).
        retention: which steps are kept (:class:`~objckpt.manager.settings.Retention`); by
            default all of them.
        local: copies on each host, no object-store traffic (docs/TIERS.md): a
            :class:`~objckpt.manager.settings.LocalCopies`, or its directory alone.
        replicas: other roots every committed step is copied to in the background, retention and
            ``gc`` applied there too (:mod:`objckpt.manager.replication`; the primary process
            copies): a :class:`~objckpt.manager.settings.Replication`, or its list of URLs and
            :class:`objckpt.Location` alone. :meth:`restore` reads the nearest copy, failing over.
        incremental: each save's base is the newest committed step (``objckpt.save(..., base=...)``,
            with SHA-256 digests): off by default; its cost in docs/INCREMENTAL.md.
        catch_sigterm: in a single process, install a SIGTERM handler (from the main
            thread) that turns the signal into a preemption notice instead of an exit;
            :meth:`close` puts the previous handler back. Off by default: the manager
            changes no signal handler unless asked. A multi-process job needs no flag:
            ``jax.distributed.initialize`` starts JAX's preemption service, which
            receives SIGTERM.
        **deprecated: the keywords taken before (``keep_last=``...) work for one release, each
            with a ``DeprecationWarning`` naming its new place (:func:`~objckpt.manager.settings.grouped`).

    With no save rule, every step saves. Whatever the rules, the step at
    which a preemption notice has reached every process saves (:meth:`reached_preemption`);
    ``save(step, ..., force=True)`` saves any step. A preempted loop::

        rules = objckpt.SavePolicy(save_interval_steps=1000, final_step=num_steps - 1)
        mgr = objckpt.CheckpointManager(url, save_rules=rules)
        start = mgr.latest_step()
        state = mgr.restore(start, abstract_state) if start is not None else init_state()
        for step in range(0 if start is None else start + 1, num_steps):
            state = train_step(state)
            mgr.save(step, state)              # saves when should_save(step): interval, final, preemption
            if mgr.reached_preemption(step):   # every process saved this step and it committed
                break
        mgr.close()                            # waits for the last save; then exit 0

    Without ``retention`` nothing is ever deleted. The latest committed step is
    always kept. Steps Orbax's ``CheckpointManager`` committed under the root are steps
    here too (:mod:`objckpt.roots.orbax_steps`); new steps are saved beside them.

    Attributes:
        store: the root's :class:`~objckpt.storage.Store`, open until :meth:`close`.
        save_policy: the save rules, ``save_rules`` (a :class:`~objckpt.manager.save_policy.SavePolicy`).
        retention: the :class:`~objckpt.manager.settings.Retention` settings.
        policies: the retention policies, ``keep_*`` and ``policies`` together.
        replicas: where the replicas are, as :class:`objckpt.Location` (empty without replicas).
    """

    def __init__(
        self,
        root_url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        options: Options | None = None,
        save_rules: SavePolicy | None = None,
        retention: Retention | None = None,
        local: LocalCopies | str | os.PathLike[str] | None = None,
        replicas: Replication | Sequence[str | Location] | None = None,
        incremental: bool = False,
        catch_sigterm: bool = False,
        **deprecated: Any,
    ) -> None:
        groups = grouped(dict(save_rules=save_rules, retention=retention, local=local, replicas=replicas), deprecated)
        self.save_policy: SavePolicy = groups["save_rules"]
        self.retention: Retention = groups["retention"]
        self.root_url = str(root_url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.options = options or Options()
        self.incremental = incremental
        self.store: Store = open_store(self.root_url, self.storage_options, self.options)
        self.policies: list[RetentionPolicy] = self.retention.all_policies()
        # The save path is imported now, with JAX already in: a training loop's first save
        # then blocks for its copy, not for loading (and compiling) the modules behind it.
        import objckpt.saving.api  # noqa: F401
        from objckpt.multihost import get_coordinator

        self._coordinator = get_coordinator()
        self._lock = threading.Lock()
        self._pending: concurrent.futures.Future[None] | None = None
        self._pending_step: int | None = None  # the step of the save in flight
        self._stored = -1  # the newest step this manager has seen committed (its local saves record it)
        self._metrics: dict[int, dict[str, Any]] = {}
        self._closed = False
        self._preemption = Preemption(catch_sigterm=catch_sigterm, process_count=self._coordinator.process_count)
        timeout = self.options.barrier_timeout
        self._schedule = SaveSchedule(self.save_policy, self._preemption, self._coordinator, self.root_url, timeout)
        self.replicas = as_locations(groups["replicas"].locations, self.storage_options, primary=self.root_url)
        self._reads = StepReads(
            self.store,
            self.root_url,
            storage_options=self.storage_options,
            options=self.options,
            replicas=self.replicas,
            metrics_seen=self._metrics,
        )
        self._replication_timeout = groups["replicas"].timeout
        self._replicator: Replicator | None = None
        self._tiers: Tiers | None = None
        if groups["local"] is not None:
            from objckpt.manager.tiers import Tiers

            args = (groups["local"], self._coordinator, timeout)
            self._tiers = Tiers(self.root_url, *args, store=self.store, options=self.options)
        if self.replicas and self._coordinator.is_primary:
            self._replicator = Replicator(
                self.store,
                self.replicas,
                options=self.options,
                policies=self.policies,
                known_metrics=self._metrics,
            )

    def step_url(self, step: int) -> str:
        """The URL of ``step``'s checkpoint: ``<root_url>/step_0000000042``, a checkpoint like any other."""
        return self._reads.step_url(step)

    def should_save(self, step: int) -> bool:
        """Whether ``step`` saves: by the save rules or because it is the preemption sync point.

        Every process gets the same answer: the step rules and JAX's sync point are the
        same everywhere, and the time and continuous rules are the primary process's
        decision, sent to the others (one key-value exchange through JAX's coordination
        service per step asked, only with ``min_interval_seconds`` or ``continuous``).
        The answer is kept for the step, so ``should_save(step)`` then ``save(step, ...)``
        decide once.
        """
        return self._schedule.should_save(step, saving=self.is_saving_in_progress())

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption notice has reached every process and ``step`` is where they all save.

        Multi-process: :func:`jax.experimental.multihost_utils.reached_preemption_sync_point`
        (call it, or :meth:`should_save` / :meth:`save`, at every step on every process).
        One process: the first step asked after SIGTERM, with ``catch_sigterm=True``.
        A save of that step waits for its commit, so the loop may stop right after it.
        """
        return self._schedule.reached_preemption(step)

    def is_saving_in_progress(self) -> bool:
        """Whether a save (its commit, then its retention pass) is still in flight."""
        pending = self._pending
        return pending is not None and not pending.done()

    def save(
        self,
        step: int,
        tree: Any,
        *,
        metrics: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        wait: bool = False,
        force: bool = False,
    ) -> bool:
        """Save ``tree`` as ``step`` if :meth:`should_save` says so (always with ``force=True``);
        returns whether it saved. A save returns after the device→host copy.

        ``metrics`` and ``metadata`` may hold numpy and jax scalars (a jitted
        step's ``loss``); they are stored as JSON, NaN and infinities as the
        strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (so ``keep_best``
        never ranks a non-finite metric).

        Waits for the previous save (and its retention pass) first, re-raising
        its error if it failed. With ``wait=True``, or at the preemption sync point,
        also waits for this one to commit. A step Orbax committed under the root is a
        CheckpointExistsError. A step that does not save waits for nothing.
        """
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        local = self._tiers is not None and self._tiers.due(step)
        local_metadata = {"objckpt.manager": {"step": step, "stored": self._stored}}
        if not force and not self.should_save(step):
            if self._tiers is not None and local:
                self._tiers.save(step, tree, local_metadata)
            return local
        if self._reads.is_orbax(step):
            raise CheckpointExistsError(f"step {step} is an Orbax step under {self.store.url}: save another step")
        metrics = to_json_value(dict(metrics or {}), "metrics")
        user_metadata = to_json_value(dict(metadata or {}), "metadata")
        with self._lock:
            self._wait_pending()
            self._schedule.started()
            full_metadata = {"objckpt.manager": {"step": step, "metrics": metrics}, **user_metadata}
            from objckpt.saving.api import save_async, start_save

            # One host stage for a step due for both: the local snapshot copies each box off the
            # devices, the store save stages from it. A local write still running, or a snapshot
            # that fails (host memory): the store save copies its own boxes, and goes first.
            tiers, stage, failed = self._tiers if local else None, None, None
            if tiers is not None and tiers.idle():
                try:
                    stage = tiers.snapshot(step, tree, local_metadata)
                except Exception as e:  # raised once the store's save has started, as a local save's error
                    failed = e
            base = self._base_for(step) if self.incremental else None
            handle = (save_async if stage is None else functools.partial(start_save, stage=stage))(
                self.step_url(step),
                tree,
                storage_options=self.storage_options,
                options=dataclasses.replace(self.options, digest="sha256") if self.incremental else self.options,
                metadata=full_metadata,
                base=base,
            )
            self._pending = runtime.submit(self._after_save(handle, step, metrics))
            self._pending_step = step
        if failed is not None:
            raise failed
        if tiers is not None and stage is not None:  # after the store's save: the disk never holds it up
            tiers.write(stage, reading=handle)
        elif tiers is not None:
            tiers.save(step, tree, local_metadata)
        if wait or self.reached_preemption(step):
            self.wait()
        return True

    def _base_for(self, step: int) -> str | None:
        """An incremental save's base: the newest committed step (objckpt's) before ``step``."""
        earlier = [s for s in runtime.run_sync(committed_steps(self.store)) if s < step]
        return self.step_url(earlier[-1]) if earlier else None

    async def _after_save(self, handle: SaveHandle, step: int, metrics: dict[str, Any]) -> None:
        await asyncio.wrap_future(handle.future)
        self._metrics[step] = metrics
        if self._replicator is not None:
            await self._replicator.committed(step)
        if self.policies and self._coordinator.is_primary:
            deleted = await self._apply_retention()
            if self._replicator is not None:
                await self._replicator.deleted(deleted)

    def wait(self) -> None:
        """Wait for the save in flight (and its retention pass), and the local one; re-raise an error."""
        with self._lock:
            self._wait_pending()
        if self._tiers is not None:
            self._tiers.wait()

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
            self._stored = max(self._stored, -1 if self._pending_step is None else self._pending_step)

    def close(self, timeout: float | None = None) -> None:
        """Wait for the save in flight, then for the replicas (up to ``timeout`` seconds,
        ``Replication.timeout`` by default), and close the stores; the manager cannot save afterwards.

        The replicas are caught up when each holds every step the root keeps, with the
        retention policies applied there and every copy abandoned mid-way deleted.
        Replicas still behind when the time is up are logged; a copy cut off leaves
        no partial step there, and the next manager on the same roots catches up.
        """
        try:
            try:
                with self._lock:
                    self._wait_pending()
            finally:  # every process takes part in the last peer copy, whatever its own save did
                if self._tiers is not None:
                    self._tiers.close()
            if self._replicator is not None:  # every step, retention and abandoned copy settled at each replica
                self._replicator.catch_up(self._replication_timeout if timeout is None else timeout)
        finally:
            self._closed = True
            self._preemption.close()
            try:
                if self._replicator is not None:
                    self._replicator.close()
            finally:
                close_store(self.store)

    def replica_status(self) -> list[ReplicaStatus]:
        """Where each replica stands: its steps, the step being copied, lag, errors
        (:class:`~objckpt.manager.replication.ReplicaStatus`). Empty without replicas,
        and on processes other than the primary, which do not replicate."""
        return self._replicator.status() if self._replicator is not None else []

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def steps(self) -> list[int]:
        """Committed steps, ascending, Orbax's included. Reads only the listing, never a blob.

        With replicas, a root that does not answer (two short attempts) is replaced by
        the replicas' listings, with a warning naming them (:mod:`objckpt.roots.listing`).
        """
        return list_steps(self.store, self.replicas, self.options, lambda store: committed_steps(store, orbax=True))

    def latest_step(self) -> int | None:
        """The newest committed step; with a local tier, the newest step complete in some tier,
        agreed by every process (so every process calls it)."""
        if self._tiers is not None:
            return self._tiers.latest_step(self.steps)
        steps = self.steps()
        return steps[-1] if steps else None

    def tier_status(self) -> TierStatus:
        """What each tier holds here: local steps, peer copies, the store's steps, the last restore's tier."""
        if self._tiers is None:
            raise ValueError("this manager has no local tier (CheckpointManager(..., local=...))")
        return self._tiers.status(self.steps())

    def restore(
        self, step: int | None = None, target: Any = None, *, partial: bool = False, cast: str = "checked"
    ) -> Any:
        """Restore ``step`` (the latest committed one by default); ``partial`` and ``cast`` as in
        :func:`objckpt.restore`. With a local tier, every process calls it: they agree on the step
        and the fastest tier that serves every process (:mod:`objckpt.manager.tiers`). A step this
        manager is still saving (the latest, when ``step`` is None) is restored once it commits."""
        self._settle(step)
        from_store = lambda s: self._reads.restore(s, target, partial=partial, cast=cast)  # noqa: E731
        if self._tiers is not None:
            return self._tiers.restore(step, target, partial=partial, store_steps=self.steps, from_store=from_store)
        return from_store(self._resolve(step))

    def inspect(self, step: int | None = None) -> CheckpointInfo:
        """What ``step`` (the latest committed one by default) holds, from its manifest alone:
        :func:`objckpt.inspect` of :meth:`step_url`; a step still saving here, once it commits."""
        self._settle(step)
        return self._reads.inspect(self._resolve(step))

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics ``step`` was saved with (read from its manifest if not seen here;
        for an Orbax step, what Orbax saved: :func:`~objckpt.roots.orbax_steps.orbax_metrics`)."""
        return self._reads.metrics(step)

    def _settle(self, step: int | None) -> None:
        """Wait for this manager's save in flight when ``step`` is it (None: the latest, which it becomes)."""
        if self.is_saving_in_progress() and (step is None or step == self._pending_step):
            self.wait()

    def _resolve(self, step: int | None) -> int:
        if step is not None:
            return step
        steps = self.steps()
        latest = steps[-1] if steps else None
        if latest is None:
            raise CheckpointNotFoundError(f"no committed step under {self.store.url}")
        return latest

    async def _apply_retention(self) -> list[int]:
        return await apply_retention(
            self.store,
            self.policies,
            orbax=self.retention.delete_orbax_steps,
            known_metrics=self._metrics,
            metrics_of=self.metrics,
            delete=self._delete_step,
        )

    async def _delete_step(self, step: int) -> None:
        self._metrics.pop(step, None)
        await delete_step(self.store, step, lease=self.options.live_marker_lease)

    def delete(self, step: int) -> None:
        """Delete one step (manifest first), an Orbax step too. With a local tier, deleting the
        newest committed steps rolls back: the local steps above the newest one left are retired
        on this process (docs/TIERS.md).

        Raises:
            SaveInProgressError: a save is writing into the step (a live-save
                marker is there); nothing, or only the manifest, was deleted.
        """
        self.wait()
        runtime.run_sync(self._delete_step(step))
        if self._tiers is not None:
            self._tiers.deleted(step, self.steps())

    def gc(self, grace_seconds: float | None = None) -> list[str]:
        """Delete blobs no committed manifest references, once older than the grace period,
        at the root and at every replica.

        Returns the keys deleted: relative to the root for the root's, full URLs for the replicas'. Steps holding a live-save
        marker younger than ``options.live_marker_lease`` are left alone whatever
        the grace period, so a save in flight is safe even with a grace of 0.
        """
        grace = self.retention.gc_grace_seconds if grace_seconds is None else grace_seconds
        limit, lease = self.options.manifest_size_limit, self.options.live_marker_lease
        collect = functools.partial(gc_root, grace=grace, manifest_size_limit=limit, lease=lease)
        return runtime.run_sync(gc_roots(self.store, self._replicator, collect))
