"""Restoring a manager's step from the nearest location that holds it on every process.

:class:`StepLocations` has every process publish what it holds and all decide alike which step
and which locations, fastest first (:mod:`objckpt.locations.agreement`), then tries them in that
order: a local step or peer copy (:mod:`objckpt.locations.local_dirs`, :mod:`objckpt.peers.copies`)
is opened as a checkpoint of one process's part (:func:`objckpt.layouts.process_copy.open_part`)
and read by the one restore (:func:`objckpt.restoring.api.restore_copy`); the object store by the
manager's own restore. After each location every process says whether it succeeded, and all
move to the next together if any did not. The step restored is where the job goes on from: every
process retires its local steps above it. docs/TIERS.md ("Restoring") says the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import (
    CheckpointNotFoundError,
    CoordinationError,
    FormatError,
    PartialCopyError,
    PeerCopyUnavailableError,
)
from objckpt.locations.agreement import PEER, STORE, Inventory, agree, all_succeeded, decide
from objckpt.locations.local_dirs import MANIFEST_LIMIT, LocalDir, read_regular, step_dirs
from objckpt.multihost import Coordinator
from objckpt.options import Options
from objckpt.roots.step_names import step_dir
from objckpt.transfer import runtime

log = logging.getLogger("objckpt")


class PeerCopies(Protocol):
    """The peer copies of a job's local steps, as a restore uses them (:class:`objckpt.peers.copies.Keepers`)."""

    def keepers(self) -> list[int]:
        """The process that keeps each process's copy, by process."""

    def fetch(self, step: int, fetch: dict[int, int]) -> Any:
        """Bring the lost copies of ``step`` back (``{owner: keeper}``; every process calls it):
        this process's step in memory, or None when it was sent none."""

    def keep(self, received: Any) -> None:
        """Write a copy brought back into this process's own directory."""


@dataclass(frozen=True)
class TierRestore:
    """Where a restore came from: the step, the tier (``"local"``, ``"peer"``, ``"store"``), seconds.

    Attributes:
        step: the step restored.
        tier: ``"local"``, ``"peer"`` or ``"store"``.
        seconds: how long the restore took.
        phases: where those seconds went on this process, in order: ``"decide"`` (which step
            and tier, agreed by every process), per tier tried ``"fetch"`` (a lost step
            brought back from its keeper), ``"open"`` (the copy's record and manifest),
            ``"agree_open"`` and ``"agree_done"`` (waits for every process), ``"restore"``
            (the one restore); ``"store"`` for a restore from the object store.
    """

    step: int
    tier: str
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TierStatus:
    """What each tier holds, as this process sees it (:meth:`CheckpointManager.tier_status`).

    Attributes:
        process: this process's index.
        local_dir: this process's directory of the local tier.
        local_steps: complete steps in it.
        torn_steps: step directories without a record (a save in flight or cut off).
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


class StepLocations:
    """The locations of a manager's steps across the job, and restores from the nearest one.

    Every method that agrees (``latest_step``, ``restore``) is called by every process of the
    job, as the manager's are. ``before``: called first by each (the manager waits there for
    its local save in flight). ``peers``: the job's peer copies, None without them;
    :attr:`peers` turns off for the rest of the run when one fails.
    """

    def __init__(
        self,
        tier: LocalDir,
        *,
        url: str,
        coordinator: Coordinator,
        options: Options,
        timeout: float,
        peers: PeerCopies | None,
        before: Callable[[], None],
    ) -> None:
        self.tier = tier
        self.url = url
        self.coordinator = coordinator
        self.options = options
        self.timeout = timeout
        self.peer_copies = peers
        self.peers = peers is not None
        self.wait = before
        self._pending: Any = None
        self.last_restore: TierRestore | None = None
        self.agreed: Any = None  # latest_step()'s decision, for the restore right after it (see restore)

    def wait_kept(self) -> None:
        """Wait for the copy a restore brought back to be written into this process's directory
        (a failure there is logged, not raised: the restore it served has succeeded)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _inventory(self, store_steps: Callable[[], list[int]]) -> Inventory:
        own = {s: (m.save_id, m.process_count) for s, m in self.tier.steps().items()}
        held = {o: {s: m.save_id for s, m in steps.items()} for o, steps in self.tier.held().items()}
        store = store_steps() if self.coordinator.is_primary else None
        stored = {s: _stored(self.tier.step_dir(s)) for s in own}
        for o, steps in held.items():
            stored.update({s: max(stored.get(s, -1), _stored(self.tier.held_dir(o) / step_dir(s))) for s in steps})
        return Inventory(self.tier.process_index, own, held, self.peers, store, stored)

    def _decide(self, want: int | None, store_steps: Callable[[], list[int]]) -> Any:
        self.wait()
        invs = agree(self.coordinator, self.url, self._inventory(store_steps), timeout=self.timeout)
        keepers = self.peer_copies.keepers() if self.peers and self.peer_copies is not None else None
        return decide(invs, self.coordinator.process_count, want=want, keepers=keepers)

    def latest_step(self, store_steps: Callable[[], list[int]]) -> int | None:
        """The newest step complete in some tier, the same on every process."""
        self.agreed = self._decide(None, store_steps)
        return self.agreed.step  # type: ignore[no-any-return]

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
        phases = _Phases()
        with phases("decide"):
            # a restart calls latest_step() then restore() on every process, with no save or delete
            # between (either clears ``agreed``): that decision stands, one agreement instead of two
            agreed, self.agreed = self.agreed, None
            decision = agreed if agreed is not None and step in (None, agreed.step) else self._decide(step, store_steps)
        if decision.step is None or not decision.tiers:
            where = f"step {step}" if step is not None else "a step"
            raise CheckpointNotFoundError(
                f"{where} is in no tier: not in the local tier {self.tier.root} of every process"
                f"{' nor in their peer copies' if self.peers else ''}, not committed under {self.url}"
            )
        why: list[str] = []
        for tier in decision.tiers:
            if tier == STORE:
                with phases("store"):
                    out = from_store(decision.step)
                return self._done(decision.step, STORE, started, out, phases)
            received, fetch_error = None, None
            if tier == PEER:
                with phases("fetch"):
                    received, fetch_error = self._fetch(decision)
            out, failed = self._try_local(decision, target, partial, received, fetch_error, phases)
            if not failed:
                if received is not None:  # restored from memory: now into this process's own directory
                    self._pending = runtime.submit(asyncio.to_thread(self._keep, received))
                return self._done(decision.step, tier, started, out, phases)
            why.append(f"{tier}: " + "; ".join(f"process {p}: {e}" for p, e in sorted(failed.items())))
            log.warning("objckpt: step %d not restored from the %s tier: %s", decision.step, tier, why[-1])
        raise CheckpointNotFoundError(f"step {decision.step} could not be restored from any tier: {' | '.join(why)}")

    def _fetch(self, decision: Any) -> tuple[Any, str | None]:
        """This process's lost step brought back from its keeper (None if it lost none), or why not.

        Every process takes part; a failure is returned, not raised, so every process still
        reaches the agreement on the outcome (:meth:`_try_local`)."""
        assert self.peer_copies is not None  # the peer location is decided only with peer copies
        try:
            received = self.peer_copies.fetch(decision.step, decision.fetch)
        except (PeerCopyUnavailableError, CoordinationError, OSError, FormatError) as e:
            log.warning("objckpt: bringing step %d back from the peer copies failed: %s", decision.step, e)
            return None, f"the copy could not be brought back: {type(e).__name__}: {e}"
        if received is None and self.tier.process_index in decision.fetch:
            return None, f"process {decision.fetch[self.tier.process_index]} sent no copy of step {decision.step}"
        return received, None

    def _keep(self, received: Any) -> None:
        """Write a step brought back from the keeper into this process's own directory (a failure is logged:
        the restore it served has succeeded)."""
        assert self.peer_copies is not None
        try:
            self.peer_copies.keep(received)
        except OSError as e:
            log.warning("objckpt local tier: the step brought back from the keeper was not kept: %s", e)

    def _try_local(
        self, decision: Any, target: Any, partial: bool, received: Any, fetch_error: str | None, phases: _Phases
    ) -> tuple[Any, dict[int, str]]:
        """Restore from this process's step (``received``: its copy brought back, in memory) through the
        one restore (:func:`objckpt.restoring.api.restore_copy`), then agree with every process that
        each one succeeded: ``{process: error}`` of those that did not.

        Two agreements, on every process whatever happens: one once each has opened its part (a
        restore that reshards on the devices runs a collective, which every process must join),
        one at the end."""
        from objckpt.restoring.api import restore_copy

        out, error, checkpoint = None, fetch_error, None
        if error is None:
            with phases("open"):
                try:
                    directory = self.tier.step_dir(decision.step)
                    record = received.record if received is not None else self.tier.read(directory)
                    if record.save_id != decision.save_id:
                        raise PartialCopyError(f"step {decision.step} here is another run's save")
                    objects = received.objects if received is not None else None
                    checkpoint = self.tier.open(directory, record, objects)
                except Exception as e:  # any failure here: report it, so no process waits for this one alone
                    error = f"{type(e).__name__}: {e}"
        with phases("agree_open"):
            failed = all_succeeded(self.coordinator, self.url, error, timeout=self.timeout)
        if not failed and checkpoint is not None:
            with phases("restore"):
                try:
                    out = restore_copy(checkpoint, target, partial=partial, options=self.options)
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
        with phases("agree_done"):
            failed = all_succeeded(self.coordinator, self.url, error, timeout=self.timeout) or failed
        return (None if failed else out), failed

    def _done(self, step: int, tier: str, started: float, out: Any, phases: _Phases) -> Any:
        seconds = time.perf_counter() - started
        self.last_restore = TierRestore(step, tier, seconds, dict(phases.seconds))
        line = (
            f"objckpt: process {self.tier.process_index} restored step {step} from the {tier} tier in {seconds:.3f} s"
        )
        if log.hasHandlers():
            log.info(line)
        else:  # no logging configured: still one line saying where the state came from
            print(line, file=sys.stderr)
        try:
            self.tier.retire(step)
        except OSError as e:
            log.warning("objckpt local tier: the local steps above step %d were not retired: %s", step, e)
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


def _stored(directory: Path) -> int:
    """The newest store step the manager had seen committed when it saved the step in
    ``directory`` (``metadata["objckpt.manager"]["stored"]`` of its manifest, which its record
    pins); -1 when it says none."""
    try:
        seen = json.loads(read_regular(directory / MANIFEST_KEY, MANIFEST_LIMIT))["metadata"]["objckpt.manager"][
            "stored"
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return -1
    return seen if type(seen) is int else -1


class _Phases:
    """Seconds per named phase of one restore (:attr:`TierRestore.phases`); a phase run again adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
