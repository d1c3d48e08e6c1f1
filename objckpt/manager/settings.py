"""A manager's settings grouped by concern, as Orbax v1's options are: retention, local copies, replicas.

With :class:`~objckpt.manager.save_policy.SavePolicy` these are what ``CheckpointManager`` takes: frozen
dataclasses that check their values when made. :func:`grouped` folds in the keywords the manager took
before, each with a ``DeprecationWarning`` naming its new place (they go in the next release).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from objckpt.manager.retention import KeepBest, KeepEvery, KeepLast, RetentionPolicy
from objckpt.manager.save_policy import SavePolicy
from objckpt.restoring.locations import Location


@dataclass(frozen=True)
class Retention:
    """Which committed steps a manager keeps: with none of these, all; the latest always.

    Attributes:
        keep_last: keep the N most recent steps.
        keep_every: keep every step that is a multiple of K, forever.
        keep_best: keep the N best steps by ``best_metric``.
        best_metric: the name of a metric passed to ``save(..., metrics=...)``.
        best_mode: "max" (the highest values are best) or "min".
        policies: more :class:`~objckpt.manager.retention.RetentionPolicy` objects; a step
            any policy keeps is kept.
        delete_orbax_steps: rank and delete Orbax's steps under the root with objckpt's own;
            by default they are neither counted nor deleted.
        gc_grace_seconds: ``gc`` leaves uncommitted blobs younger than this alone.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "max"
    policies: Sequence[RetentionPolicy] = ()
    delete_orbax_steps: bool = False
    gc_grace_seconds: float = 3600.0

    def __post_init__(self) -> None:
        self.all_policies()  # a wrong value fails here, not at the first retention pass

    def all_policies(self) -> list[RetentionPolicy]:
        """``policies`` plus those the ``keep_*`` settings name.

        Raises:
            ValueError: ``keep_every`` is not positive, ``keep_best`` has no ``best_metric``,
                or ``best_mode`` is neither "max" nor "min".
        """
        out = list(self.policies)
        if self.keep_last is not None:
            out.append(KeepLast(self.keep_last))
        if self.keep_every is not None:
            if self.keep_every <= 0:
                raise ValueError(f"keep_every must be positive, got {self.keep_every}")
            out.append(KeepEvery(self.keep_every))
        if self.keep_best is not None:
            if not self.best_metric:
                raise ValueError("keep_best needs best_metric")
            out.append(KeepBest(self.keep_best, self.best_metric, self.best_mode))
        return out


@dataclass(frozen=True)
class LocalCopies:
    """Copies of each process's own shards on its host, and of a peer's (docs/TIERS.md).

    Attributes:
        path: a directory on each host (a path or ``file://`` URL; a disk, NVMe or
            ``/dev/shm``), with no object-store traffic.
        interval_steps: :meth:`~objckpt.CheckpointManager.save` saves locally every K
            steps, whatever the object-store save rules say.
        keep_last: each process keeps its N newest local steps.
        peers: 1 (with more than one process): each process also keeps a copy of another
            process's newest local step, sent through JAX's transfer server; 0: none.
        peer_of: ``peer_of(p, P)`` is the process whose steps process ``p`` of ``P`` keeps;
            default ``(p + P // 2) % P``, a process half the job away.
    """

    path: str | os.PathLike[str]
    interval_steps: int = 1
    keep_last: int = 2
    peers: int = 1
    peer_of: Callable[[int, int], int] | None = None

    def __post_init__(self) -> None:
        if self.interval_steps < 1 or self.keep_last < 1:
            raise ValueError(f"LocalCopies: interval_steps and keep_last must be at least 1, got {self}")
        if self.peers not in (0, 1):
            raise ValueError(f"LocalCopies.peers must be 0 or 1 (one peer copy), got {self.peers}")


@dataclass(frozen=True)
class Replication:
    """Other roots every committed step is copied to (:mod:`objckpt.manager.replication`).

    Attributes:
        locations: URLs, or :class:`objckpt.Location` with their own storage options.
        timeout: seconds :meth:`~objckpt.CheckpointManager.close` waits for the replicas
            to hold every step the root keeps before it stops replicating.
    """

    locations: Sequence[str | Location] = ()
    timeout: float = 600.0


#: Each keyword the manager took before its settings were grouped: its group and its field there.
_MOVED = {
    **{f.name: ("save_rules", f.name) for f in dataclasses.fields(SavePolicy)},
    **{f.name: ("retention", f.name) for f in dataclasses.fields(Retention)},
    **{f"local_{k}": ("local", k) for k in ("interval_steps", "keep_last")},
    **{k: ("local", k) for k in ("peers", "peer_of")},
    "replication_timeout": ("replicas", "timeout"),
}
_GROUPS: dict[str, type] = dict(save_rules=SavePolicy, retention=Retention, local=LocalCopies, replicas=Replication)
_BARE = {"local": "path", "replicas": "locations"}  # the group given as a bare value: the field it fills


def grouped(groups: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """``groups`` (save_rules, retention, local, replicas) as settings objects, ``old`` keywords folded in.

    Raises:
        TypeError: a keyword the manager never took.
        ValueError: an old keyword given beside its group's settings object.
    """
    moved: dict[str, dict[str, Any]] = {}
    for name, value in old.items():
        if name not in _MOVED:
            raise TypeError(f"CheckpointManager() got an unexpected keyword argument {name!r}")
        group, field = _MOVED[name]
        new = f"{group}=objckpt.{_GROUPS[group].__name__}({field}=...)"
        if isinstance(groups[group], _GROUPS[group]):
            raise ValueError(f"CheckpointManager() got {name}= and {group}=: give {new} only")
        warnings.warn(f"{name}= is deprecated: use {new}", DeprecationWarning, stacklevel=3)
        moved.setdefault(group, {})[field] = value
    out = {}
    for group, cls in _GROUPS.items():
        given, fields = groups[group], moved.get(group, {})
        if isinstance(given, cls) or (group == "local" and given is None):  # no local copies: nothing to fold
            out[group] = given
        elif given is None or group in _BARE:
            out[group] = cls(**({} if given is None else {_BARE[group]: given}), **fields)
        else:
            raise TypeError(f"CheckpointManager({group}=...) takes an objckpt.{cls.__name__}, got {given!r}")
    return out
