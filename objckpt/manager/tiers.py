"""The recovery tiers in front of a manager's object store: local, peer copy, then the store.

:class:`Tiers` is what :class:`~objckpt.manager.checkpoint_manager.CheckpointManager` holds when
it is given ``local=`` (docs/TIERS.md: saving, the peer copy, restoring). It decides policy:
which steps save locally, that at most one local save is in flight (the next waits for it),
that a failed local save is a warning (the object store's saves never wait on the local disk),
and when peer copies stop: any failure turns them off with a warning, and a process that makes
no progress for :data:`PEER_STALL_SECONDS` (or ``Options.barrier_timeout`` if shorter; inside
JAX's heartbeat timeout) leaves its peers a :class:`~objckpt.errors.CoordinationError` naming
it, raised by their next ``save`` or ``wait``. Restoring is
:class:`~objckpt.locations.tiers.StepLocations`'.

Every method here that agrees (``latest_step``, ``restore``, ``save`` with peers,
``close`` with peers) is called by every process of the job, as the manager's are.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from objckpt.errors import (
    CoordinationError,
    FormatError,
    PeerCopyUnavailableError,
)
from objckpt.locations.local_dirs import LocalDir, local_path
from objckpt.locations.run_keys import RunKeys
from objckpt.locations.tiers import StepLocations, TierStatus
from objckpt.manager.settings import LocalCopies
from objckpt.multihost import Coordinator, operation_tag
from objckpt.options import Options
from objckpt.saving.api import SaveHandle
from objckpt.saving.local_snapshot import Snapshot, snapshot
from objckpt.storage.base import Store
from objckpt.transfer import runtime

log = logging.getLogger("objckpt")

#: The longest a peer copy waits, at each barrier or chunk, for a process that makes no progress.
PEER_STALL_SECONDS = 30.0


class Tiers:
    """A manager's local tier and peer copies (see the module docstring)."""

    def __init__(
        self,
        root_url: str,
        local: LocalCopies,
        coordinator: Coordinator,
        timeout: float,
        *,
        store: Store,
        options: Options,
    ) -> None:
        """``store``: the manager's root, where each run's key lives (:mod:`objckpt.locations.run_keys`);
        ``options``: the manager's, which its restores from the local tier use too."""
        root, keeper_of = local_path(local.path), local.peer_of
        if "://" not in root_url or root_url.startswith("file://"):
            store_dir = local_path(root_url)
            if root == store_dir or store_dir in root.parents:
                raise ValueError(f"local={str(root)!r} is inside the manager's root {root_url}: gc would sweep it")
        self.url = root_url
        self.options = options
        self.coordinator = coordinator
        self.keys = RunKeys(store)
        index, count = coordinator.process_index, coordinator.process_count
        self.tier = LocalDir(root, index, count, local.keep_last, url=root_url, key_of=self.keys)
        self.interval = local.interval_steps
        self.keeper_of = keeper_of
        self.timeout = timeout
        self.peer_timeout = min(timeout, PEER_STALL_SECONDS)
        keeping = bool(local.peers) and coordinator.process_count > 1
        if keeping:
            from objckpt.peers.transfer import keeper_map, peer_copy_unavailable

            keeper_map(coordinator.process_count, keeper_of)  # a ValueError now, not at the first copy
            why = peer_copy_unavailable()
            if why is not None:
                log.warning("objckpt local tier: peer copies are off: %s", why)
                keeping = False
        self.keepers = None
        if keeping:
            from objckpt.peers.copies import Keepers

            self.keepers = Keepers(self.tier, timeout=self.peer_timeout, keeper_of=keeper_of)
        self.locations = StepLocations(
            self.tier,
            url=root_url,
            coordinator=coordinator,
            options=options,
            timeout=timeout,
            peers=self.keepers,
            before=self.wait,
        )
        self._pending: concurrent.futures.Future[None] | None = None
        # The last local save's buffer once written (Options.keep_snapshot_buffer): the next one
        # copies into it, its pages already in, instead of faulting in a fresh one.
        self._spare: np.ndarray | None = None
        self._reading: SaveHandle | None = None  # the store save that sends from the last snapshot
        self.run_id = self._agree_run_id()

    def _agree_run_id(self) -> str:
        """One id for this run's local saves, the primary's, on every process (a step two runs both
        reached, a restart re-running it, is never taken for one save), and the run's key: the
        primary writes it to the root (:mod:`objckpt.locations.run_keys`) and sends it to the others."""
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
        """Whether ``step`` saves locally; called by every manager save, which ends the decision
        ``latest_step()`` agreed on (the next restore agrees anew)."""
        self.locations.agreed = None
        return step % self.interval == 0

    def save(self, step: int, tree: Any, metadata: dict[str, Any]) -> float:
        """Snapshot ``tree`` as local step ``step``, then write it and send it to the keeper in
        the background; the seconds blocked."""
        started = time.perf_counter()
        self.write(self.snapshot(step, tree, metadata))
        return time.perf_counter() - started

    def snapshot(self, step: int, tree: Any, metadata: dict[str, Any]) -> Snapshot:
        """Local step ``step``'s boxes copied off the devices into one owned buffer: the host stage
        a step due for the store too shares (:func:`objckpt.saving.api.start_save`).

        First waits for the previous local save and its peer copy (re-raising the peer copy's
        CoordinationError; a failed local write was a warning).
        """
        self.wait()
        spare, self._spare = self._spare, None
        if self._reading is not None and not self._reading.done():
            spare = None  # a store save still sends from it (objckpt's own bytes are sent in place)
        return snapshot(
            tree,
            root=self.url,
            step=step,
            save_id=self.run_id,
            process_index=self.tier.process_index,
            process_count=self.tier.process_count,
            metadata=metadata,
            buffer=spare,
        )

    def idle(self) -> bool:
        """Whether no local save is in flight (a snapshot taken now waits for none)."""
        return self._pending is None or self._pending.done()

    def write(self, snap: Snapshot, reading: SaveHandle | None = None) -> None:
        """Write ``snap`` and send it to the keeper in the background; ``reading``: the store save
        that sends from ``snap`` too (its buffer is not reused before that save ends)."""
        self._reading = reading
        self._pending = runtime.submit(asyncio.to_thread(self._write_and_send, snap))

    def _write_and_send(self, snap: Any) -> None:
        """Write the step here, then (with peers) send it to the keeper, whatever the write did:
        every process takes part in every peer copy, an empty one when its write failed."""
        started = time.perf_counter()
        try:
            self.keys.written()  # the primary's: the run's key is in the root before its first local step
            record = self.tier.write(snap, self.options)
        except (OSError, FormatError) as e:  # the disk, not the job: training and the store's saves go on
            log.warning(
                "objckpt local tier: step %d not saved locally by process %d: %s", snap.step, snap.process_index, e
            )
            if self.peers:
                self._send(None)
            return
        except BaseException:
            if self.peers:
                self._send(None)
            raise
        log.info(
            "objckpt local tier: step %d written by process %d (%d bytes) in %.3f s",
            record.step,
            self.tier.process_index,
            snap.nbytes,
            time.perf_counter() - started,
        )
        if self.peers:
            self._send(record.step)
        if self.options.keep_snapshot_buffer:  # written (peers send the files): the next save fills it
            self._spare = snap.buffer

    def _send(self, step: int | None) -> None:
        assert self.keepers is not None
        started = time.perf_counter()
        try:
            got = self.keepers.send(step)
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
        """Wait for the local save in flight and its peer copy (and a copy a restore brought back
        being written); re-raise the save's error (once)."""
        self.locations.wait_kept()
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def deleted(self, step: int, store_steps: list[int]) -> None:
        """After ``delete(step)``: when no committed step at or above ``step`` is left (a roll-back),
        this process's local steps above the newest one left are retired."""
        self.locations.agreed = None
        head = max(store_steps, default=-1)
        if step > head:
            self.wait()
            self.tier.retire(head)

    def close(self) -> None:
        """Wait for the local save in flight and its peer copy; re-raise its error."""
        self.wait()

    # ------------------------------------------------------------------ restoring

    def latest_step(self, store_steps: Callable[[], list[int]]) -> int | None:
        """The newest step complete in some location, the same on every process."""
        return self.locations.latest_step(store_steps)

    def restore(self, step: int | None, target: Any, **how: Any) -> Any:
        """See :meth:`objckpt.locations.tiers.StepLocations.restore`."""
        return self.locations.restore(step, target, **how)

    def status(self, store_steps: list[int]) -> TierStatus:
        return self.locations.status(store_steps)

    @property
    def peers(self) -> bool:
        """Whether peer copies are made (off for the rest of the run once one fails)."""
        return self.locations.peers

    @peers.setter
    def peers(self, on: bool) -> None:
        self.locations.peers = on


__all__ = ["TierStatus", "Tiers"]
