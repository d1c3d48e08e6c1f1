"""Which step to restore, and from which tier: every process decides alike from what all hold.

Each process publishes its :class:`Inventory` through JAX's coordination service
(:class:`objckpt.multihost.Coordinator`: one barrier with a timeout); every process then reads
them all and runs the same pure :func:`decide`, so all reach the same answer without another
message. Its rules (when a step is local, peer or store; the tiers fastest first; a step of a
deleted line left out; the local tier tried for a step of another process count) are
docs/TIERS.md's "Restoring" and "One line of steps".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from objckpt.errors import CoordinationError
from objckpt.multihost import Coordinator, operation_tag

LOCAL, PEER, STORE = "local", "peer", "store"


@dataclass(frozen=True)
class Inventory:
    """What one process holds (see the module docstring)."""

    process: int
    own: dict[int, tuple[str, int]] = field(default_factory=dict)  # step: (save id, process count)
    held: dict[int, dict[int, str]] = field(default_factory=dict)  # owner: {step: save id}
    can_exchange: bool = False
    store: list[int] | None = None  # the primary's listing of the object store
    stored: dict[int, int] = field(default_factory=dict)  # step held: the newest store step seen committed before it

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "own": {str(s): list(v) for s, v in self.own.items()},
                "held": {str(o): {str(s): i for s, i in steps.items()} for o, steps in self.held.items()},
                "x": self.can_exchange,
                "store": self.store,
                "stored": {str(s): v for s, v in self.stored.items()},
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, process: int, data: bytes) -> Inventory:
        doc = json.loads(data)
        return cls(
            process,
            own={int(s): (str(v[0]), int(v[1])) for s, v in doc["own"].items()},
            held={int(o): {int(s): str(i) for s, i in steps.items()} for o, steps in doc["held"].items()},
            can_exchange=bool(doc["x"]),
            store=None if doc["store"] is None else [int(s) for s in doc["store"]],
            stored={int(s): int(v) for s, v in doc["stored"].items()},
        )


@dataclass(frozen=True)
class Decision:
    """The step to restore (None: none anywhere) and the tiers to try for it, fastest first.

    ``fetch``: for the peer tier, each process whose own copy is missing and the keeper
    that holds it (``{owner: keeper}``); ``save_id``: the save the local and peer tiers hold.
    """

    step: int | None
    tiers: tuple[str, ...] = ()
    save_id: str | None = None
    fetch: dict[int, int] = field(default_factory=dict)


def _local(invs: dict[int, Inventory], count: int, step: int, *, strict: bool) -> str | None:
    """The save id every process holds ``step`` under, if all do (and, ``strict``, saved by ``count`` processes)."""
    ids = set()
    for p in range(count):
        got = invs[p].own.get(step) if p in invs else None
        if got is None or (strict and got[1] != count):
            return None
        ids.add(got[0])
    return ids.pop() if len(ids) == 1 else None


def _peer(invs: dict[int, Inventory], count: int, step: int, keepers: list[int]) -> tuple[str, dict[int, int]] | None:
    """The save id and ``{owner: keeper}`` fetches that make ``step`` whole through peer copies."""
    if len(keepers) != count or not all(p in invs and invs[p].can_exchange for p in range(count)):
        return None
    for save_id in sorted({v[0] for i in invs.values() for s, v in i.own.items() if s == step and v[1] == count}):
        fetch = {}
        for p in range(count):
            own = invs[p].own.get(step)
            if own == (save_id, count):
                continue
            keeper = keepers[p]
            if invs[keeper].held.get(p, {}).get(step) != save_id:
                break
            fetch[p] = keeper
        else:
            return save_id, fetch
    return None


def decide(invs: dict[int, Inventory], count: int, *, want: int | None, keepers: list[int] | None) -> Decision:
    """The step and tiers every process takes (pure: the same inventories give the same answer).

    ``want``: the step asked for (None: the newest in any tier); ``keepers``: the peer-copy
    keeper of each process, or None when the manager keeps no peer copies.
    """
    store = {s for i in invs.values() if i.store is not None for s in i.store}
    head = max(store, default=-1)
    deleted_line = {s for i in invs.values() for s, seen in i.stored.items() if seen > head}
    candidates = {s for i in invs.values() for s in i.own} | store
    if want is not None:
        candidates = {want}
    for step in sorted(candidates, reverse=True):
        tiers: list[str] = []
        live = step not in deleted_line
        save_id = _local(invs, count, step, strict=True) if live else None
        fetch: dict[int, int] = {}
        if save_id is not None:
            tiers.append(LOCAL)
        elif live and keepers is not None and (peer := _peer(invs, count, step, keepers)) is not None:
            save_id, fetch = peer
            tiers.append(PEER)
        if step in store:
            relaxed = _local(invs, count, step, strict=False) if save_id is None else None
            if relaxed is not None:
                save_id = relaxed
                tiers.append(LOCAL)
            tiers.append(STORE)
        if tiers or want is not None:
            return Decision(step, tuple(tiers), save_id, fetch)
    return Decision(None)


def agree(coordinator: Coordinator, url: str, mine: Inventory, *, timeout: float) -> dict[int, Inventory]:
    """Every process's inventory, once all have published theirs (one barrier with ``timeout``).

    Raises:
        CoordinationError: the barrier timed out, naming the processes that did not arrive.
    """
    if coordinator.process_count == 1:
        return {mine.process: mine}
    tag = operation_tag("tiers", url)
    try:
        coordinator.publish(f"{tag}/inventory", mine.to_json())
        coordinator.barrier(f"{tag}/barrier", timeout=timeout)
        out = {p: Inventory.from_json(p, v) for p, v in coordinator.collect(f"{tag}/inventory").items()}
    except CoordinationError:
        coordinator.forget(tag)
        raise
    coordinator.release(tag)
    return out


def all_succeeded(coordinator: Coordinator, url: str, error: str | None, *, timeout: float) -> dict[int, str]:
    """Agree that every process succeeded at one tier; the failures by process (empty: all did)."""
    if coordinator.process_count == 1:
        return {coordinator.process_index: error} if error else {}
    tag = operation_tag("tier_outcome", url)
    try:
        if error is not None:
            coordinator.publish(f"{tag}/failed", error[:1000].encode())
        coordinator.barrier(f"{tag}/barrier", timeout=timeout)
        failed = {p: v.decode() for p, v in coordinator.collect(f"{tag}/failed").items()}
    except CoordinationError:
        coordinator.forget(tag)
        raise
    coordinator.release(tag)
    return failed
