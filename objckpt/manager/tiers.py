"""The recovery tiers in front of a manager's object store: local, peer copy, then the store.

:class:`Tiers` is what :class:`~objckpt.manager.checkpoint_manager.CheckpointManager`
holds when it is given ``local=``:

- **saving**: every ``local_interval_steps`` steps each process snapshots its own boxes
  (the caller's thread, like ``save_async``'s blocking phase) and writes them to its local
  directory in the background (:mod:`objckpt.manager.local_tier`). With ``peers=1`` the same
  background job then sends the step to the process's keeper (:mod:`objckpt.manager.peer_tier`:
  JAX's transfer server, not a device program, so it runs beside the training step). At
  most one local save is in flight; the next one waits for it and re-raises its error.
- **restoring**: every process publishes what it holds, all decide alike which step and
  which tiers (:mod:`objckpt.manager.tier_agreement`), try them fastest first, and agree
  after each that every process succeeded before moving on. Each process logs the tier
  and the seconds it took; :attr:`Tiers.last_restore` keeps them.

Every method here that agrees (``latest_step``, ``restore``, ``save`` with peers,
``close`` with peers) is called by every process of the job, as the manager's are.

A peer copy waits for a process that makes no progress at most :data:`PEER_STALL_SECONDS`
(or ``Options.barrier_timeout`` if shorter), well inside JAX's own heartbeat timeout (100 s by
default), after which JAX's coordination service stops every process of a job that lost one.
So a process that dies leaves its peers a :class:`~objckpt.errors.CoordinationError` naming
it, raised by their next ``save`` or ``wait`` (and peer copies off), not a process stopped
by JAX. Any other failure of a peer copy (no transfer server, a copy that does not parse)
turns peer copies off with a warning and training goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from objckpt.errors import (
    CheckpointNotFoundError,
    CoordinationError,
    FormatError,
    PartialCopyError,
    PeerCopyUnavailableError,
)
from objckpt.manager.local_snapshot import snapshot
from objckpt.manager.local_tier import MANIFEST_LIMIT, LocalTier, local_path, step_dirs
from objckpt.manager.tier_agreement import LOCAL, PEER, STORE, Inventory, agree, all_succeeded, decide
from objckpt.manager.tier_keys import RunKeys
from objckpt.multihost import Coordinator, operation_tag
from objckpt.options import Options
from objckpt.storage.base import Store
from objckpt.transfer import runtime

log = logging.getLogger("objckpt")

Keeper = Callable[[int, int], int]

#: The longest a peer copy waits, at each barrier or chunk, for a process that makes no progress.
PEER_STALL_SECONDS = 30.0


@dataclass(frozen=True)
class TierRestore:
    """Where a restore came from: the step, the tier (``"local"``, ``"peer"``, ``"store"``), seconds.

    Attributes:
        step: the step restored.
        tier: ``"local"``, ``"peer"`` or ``"store"``.
        seconds: how long the restore took.
    """

    step: int
    tier: str
    seconds: float


@dataclass(frozen=True)
class TierStatus:
    """What each tier holds, as this process sees it (:meth:`CheckpointManager.tier_status`).

    Attributes:
        process: this process's index.
        local_dir: this process's directory of the local tier.
        local_steps: complete steps in it.
        torn_steps: step directories without a manifest (a save in flight or cut off).
        local_bytes: bytes the local tier holds for this process, peer copies included.
        peer_held: the steps of other processes this one keeps (``{owner: steps}``).
        store_url: the manager's root.
        store_steps: the object store's committed steps.
        peers: whether peer copies are being made.
        last_restore: where this manager's last restore came from (step, tier, seconds); None
            before any.
    """

    process: int
    local_dir: str
    local_steps: list[int]
    torn_steps: list[int]
    local_bytes: int
    peer_held: dict[int, list[int]]
    store_url: str
    store_steps: list[int]
    peers: bool
    last_restore: TierRestore | None = None


class Tiers:
    """A manager's local tier and peer copies (see the module docstring)."""

    def __init__(
        self,
        root_url: str,
        local: Any,
        interval: int,
        keep_last: int,
        peers: int,
        keeper_of: Keeper | None,
        coordinator: Coordinator,
        timeout: float,
        *,
        store: Store,
        options: Options,
    ) -> None:
        """``store``: the manager's root, where each run's key lives (:mod:`objckpt.manager.tier_keys`);
        ``options``: the manager's, which its restores from the local tier use too."""
        if interval < 1:
            raise ValueError(f"local_interval_steps must be at least 1, got {interval}")
        if peers not in (0, 1):
            raise ValueError(f"peers must be 0 or 1 (one peer copy), got {peers}")
        root = local_path(local)
        if "://" not in root_url or root_url.startswith("file://"):
            store_dir = local_path(root_url)
            if root == store_dir or store_dir in root.parents:
                raise ValueError(f"local={str(root)!r} is inside the manager's root {root_url}: gc would sweep it")
        self.url = root_url
        self.options = options
        self.coordinator = coordinator
        self.keys = RunKeys(store)
        index, count = coordinator.process_index, coordinator.process_count
        self.tier = LocalTier(root, index, count, keep_last, url=root_url, key_of=self.keys)
        self.interval = interval
        self.keeper_of = keeper_of
        self.timeout = timeout
        self.peer_timeout = min(timeout, PEER_STALL_SECONDS)
        self.peers = bool(peers) and coordinator.process_count > 1
        if self.peers:
            from objckpt.manager.peer_copy import keeper_map, peer_copy_unavailable

            keeper_map(coordinator.process_count, keeper_of)  # a ValueError now, not at the first copy
            why = peer_copy_unavailable()
            if why is not None:
                log.warning("objckpt local tier: peer copies are off: %s", why)
                self.peers = False
        self.run_id = self._agree_run_id()
        self._pending: concurrent.futures.Future[None] | None = None
        self.last_restore: TierRestore | None = None

    def _agree_run_id(self) -> str:
        """One id for this run's local saves, the primary's, on every process (a step two runs both
        reached, a restart re-running it, is never taken for one save), and the run's key: the
        primary writes it to the root (:mod:`objckpt.manager.tier_keys`) and sends it to the others."""
        mine = None
        if self.coordinator.is_primary:
            run_id = uuid.uuid4().hex
            mine = f"{run_id}:{self.keys.create(run_id).hex()}".encode()
        tag = operation_tag("local_tier", self.url)
        try:
            run_id, key = self.coordinator.broadcast(f"{tag}/run", mine, timeout=self.timeout).decode().split(":")
        finally:
            self.coordinator.release(tag)
        self.keys.known(run_id, bytes.fromhex(key))
        return run_id

    # ------------------------------------------------------------------ saving

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def save(self, step: int, tree: Any, metadata: dict[str, Any]) -> float:
        """Snapshot ``tree`` as local step ``step``, then write it and send it to the keeper in
        the background; the seconds blocked.

        First waits for the previous local save and its peer copy (re-raising its error).
        """
        self.wait()
        started = time.perf_counter()
        snap = snapshot(
            tree,
            root=self.url,
            step=step,
            save_id=self.run_id,
            process_index=self.tier.process_index,
            process_count=self.tier.process_count,
            metadata=metadata,
        )
        self._pending = runtime.submit(asyncio.to_thread(self._write_and_send, snap))
        return time.perf_counter() - started

    def _write_and_send(self, snap: Any) -> None:
        """Write the step here, then (with peers) send it to the keeper, whatever the write did:
        every process takes part in every peer copy, an empty one when its write failed."""
        started = time.perf_counter()
        try:
            manifest = self.tier.write(snap)
        except BaseException:
            if self.peers:
                self._send(None)
            raise
        log.info(
            "objckpt local tier: step %d written by process %d (%d bytes) in %.3f s",
            manifest.step,
            self.tier.process_index,
            manifest.data_size,
            time.perf_counter() - started,
        )
        if self.peers:
            self._send(manifest.step)

    def _send(self, step: int | None) -> None:
        from objckpt.manager.peer_tier import send_to_keepers

        started = time.perf_counter()
        try:
            got = send_to_keepers(self.tier, step, timeout=self.peer_timeout, keeper_of=self.keeper_of)
        except CoordinationError as e:  # a process gone or failing: the job cannot go on as it was
            log.error("objckpt local tier: peer copy of step %s failed, peer copies are off from now: %s", step, e)
            self.peers = False
            raise
        except (PeerCopyUnavailableError, OSError, FormatError) as e:
            log.warning("objckpt local tier: peer copy failed, peer copies are off from now: %s", e)
            self.peers = False
            return
        log.info(
            "objckpt local tier: peer copy of step %s sent, step %s received, in %.3f s",
            step,
            got,
            time.perf_counter() - started,
        )

    def wait(self) -> None:
        """Wait for the local save in flight and its peer copy; re-raise the save's error (once)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the local save in flight and its peer copy; re-raise its error."""
        self.wait()

    # ------------------------------------------------------------------ agreeing

    def _inventory(self, store_steps: Callable[[], list[int]]) -> Inventory:
        own = {s: (m.save_id, m.process_count) for s, m in self.tier.steps().items()}
        held = {o: {s: m.save_id for s, m in steps.items()} for o, steps in self.tier.held().items()}
        store = store_steps() if self.coordinator.is_primary else None
        return Inventory(self.tier.process_index, own, held, self.peers, store)

    def _decide(self, want: int | None, store_steps: Callable[[], list[int]]) -> Any:
        self.wait()
        invs = agree(self.coordinator, self.url, self._inventory(store_steps), timeout=self.timeout)
        keepers = None
        if self.peers:
            from objckpt.manager.peer_copy import keeper_map

            keepers = keeper_map(self.coordinator.process_count, self.keeper_of)
        return decide(invs, self.coordinator.process_count, want=want, keepers=keepers)

    def latest_step(self, store_steps: Callable[[], list[int]]) -> int | None:
        """The newest step complete in some tier, the same on every process."""
        return self._decide(None, store_steps).step  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ restoring

    def restore(
        self,
        step: int | None,
        target: Any,
        *,
        partial: bool,
        store_steps: Callable[[], list[int]],
        from_store: Callable[[int], Any],
    ) -> Any:
        """``step`` (None: the newest anywhere) from the fastest tier that serves every process."""
        started = time.perf_counter()
        decision = self._decide(step, store_steps)
        if decision.step is None or not decision.tiers:
            where = f"step {step}" if step is not None else "a step"
            raise CheckpointNotFoundError(
                f"{where} is in no tier: not in the local tier {self.tier.root} of every process"
                f"{' nor in their peer copies' if self.peers else ''}, not committed under {self.url}"
            )
        why: list[str] = []
        for tier in decision.tiers:
            if tier == STORE:
                out = from_store(decision.step)
                return self._done(decision.step, STORE, started, out)
            received, fetch_error = self._fetch(decision) if tier == PEER else (None, None)
            out, failed = self._try_local(decision, target, partial, received, fetch_error)
            if not failed:
                if received is not None:  # restored from memory: now into this process's own directory
                    self._pending = runtime.submit(asyncio.to_thread(self._keep, received))
                return self._done(decision.step, tier, started, out)
            why.append(f"{tier}: " + "; ".join(f"process {p}: {e}" for p, e in sorted(failed.items())))
            log.warning("objckpt: step %d not restored from the %s tier: %s", decision.step, tier, why[-1])
        raise CheckpointNotFoundError(f"step {decision.step} could not be restored from any tier: {' | '.join(why)}")

    def _fetch(self, decision: Any) -> tuple[Any, str | None]:
        """This process's lost step brought back from its keeper (None if it lost none), or why not.

        Every process takes part; a failure is returned, not raised, so every process still
        reaches the agreement on the outcome (:meth:`_try_local`)."""
        from objckpt.manager.peer_tier import fetch_from_keepers

        try:
            received = fetch_from_keepers(
                self.tier, decision.step, decision.fetch, timeout=self.peer_timeout, keeper_of=self.keeper_of
            )
        except (PeerCopyUnavailableError, CoordinationError, OSError, FormatError) as e:
            log.warning("objckpt: bringing step %d back from the peer copies failed: %s", decision.step, e)
            return None, f"the copy could not be brought back: {type(e).__name__}: {e}"
        if received is None and self.tier.process_index in decision.fetch:
            return None, f"process {decision.fetch[self.tier.process_index]} sent no copy of step {decision.step}"
        return received, None

    def _keep(self, received: Any) -> None:
        """Write a step brought back from the keeper into this process's own directory (a failure is logged:
        the restore it served has succeeded)."""
        from objckpt.manager.peer_tier import keep_received

        try:
            keep_received(self.tier, received)
        except OSError as e:
            log.warning("objckpt local tier: the step brought back from the keeper was not kept: %s", e)

    def _try_local(
        self, decision: Any, target: Any, partial: bool, received: Any = None, fetch_error: str | None = None
    ) -> tuple[Any, dict[int, str]]:
        """Restore from this process's step (``received``: its copy brought back, in memory) through the
        one restore (:func:`objckpt.restoring.api.restore_copy`), then agree with every process that
        each one succeeded: ``{process: error}`` of those that did not.

        Two agreements, on every process whatever happens: one once each has opened its part (a
        restore that reshards on the devices runs a collective, which every process must join),
        one at the end."""
        from objckpt.layouts.process_copy import open_process_copy
        from objckpt.restoring.api import restore_copy

        out, error, checkpoint = None, fetch_error, None
        if error is None:
            try:
                directory = self.tier.step_dir(decision.step)
                manifest = received.manifest if received is not None else self.tier.read(directory)
                if manifest.save_id != decision.save_id:
                    raise PartialCopyError(f"step {decision.step} here is another run's save")
                data = received.data if received is not None else self.tier.data(directory, manifest)
                name = f"local tier of {self.url}, step {decision.step}"  # the same on every process
                checkpoint = open_process_copy(name, manifest, data, size_limit=MANIFEST_LIMIT)
            except Exception as e:  # any failure here: report it, so no process waits for this one alone
                error = f"{type(e).__name__}: {e}"
        failed = all_succeeded(self.coordinator, self.url, error, timeout=self.timeout)
        if not failed and checkpoint is not None:
            try:
                out = restore_copy(checkpoint, target, partial=partial, options=self.options)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        failed = all_succeeded(self.coordinator, self.url, error, timeout=self.timeout) or failed
        return (None if failed else out), failed

    def _done(self, step: int, tier: str, started: float, out: Any) -> Any:
        seconds = time.perf_counter() - started
        self.last_restore = TierRestore(step, tier, seconds)
        log.info(
            "objckpt: process %d restored step %d from the %s tier in %.3f s",
            self.tier.process_index,
            step,
            tier,
            seconds,
        )
        return out

    def status(self, store_steps: list[int]) -> TierStatus:
        own = self.tier.steps()
        return TierStatus(
            process=self.tier.process_index,
            local_dir=str(self.tier.own),
            local_steps=sorted(own),
            torn_steps=sorted(s for s in step_dirs(self.tier.own) if s not in own),
            local_bytes=self.tier.nbytes(),
            peer_held={o: sorted(steps) for o, steps in self.tier.held().items()},
            store_url=self.url,
            store_steps=store_steps,
            peers=self.peers,
            last_restore=self.last_restore,
        )


__all__ = ["LOCAL", "PEER", "STORE", "TierRestore", "TierStatus", "Tiers"]
