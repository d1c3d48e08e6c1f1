"""What a root holds, from one listing: its committed steps (from its replicas when the root
does not answer), and the checkpoints under a prefix as ``objckpt ls`` shows them.

:func:`committed_steps` reads the steps of a manager root from one listing: a step
is committed iff ``step_<N>/manifest.json`` is there (:mod:`objckpt.roots.step_names`),
and, when asked, Orbax's committed steps too (:mod:`objckpt.roots.orbax_steps`).

A resume script asks ``CheckpointManager.latest_step()`` first; with the root's
region down, that listing would fail after every retry although each replica
holds the steps (and ``restore`` reads from them). With replicas, the root is
asked with a short budget (:func:`~objckpt.restoring.locations.probing_store`:
two attempts, a probe's timeout); when it does not answer, every replica is
listed at once, and the steps are those committed at any replica that answered
(a restore of any of them finds a location that holds it), with a warning
naming the root's error and the replicas that answered: a replica may lag
behind the root. Retention and ``gc`` never use this: they act on the root's
own listing only.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import StoreError
from objckpt.options import Options
from objckpt.restoring.locations import Location, open_locations, probing_store
from objckpt.roots.orbax_steps import COMMIT_FILE, orbax_steps_in, renames_to_commit
from objckpt.roots.references import Unknown, referenced
from objckpt.roots.step_names import STEP_DIR
from objckpt.saving.live_markers import is_marker
from objckpt.storage import ObjectInfo, Store
from objckpt.transfer import runtime
from objckpt.transfer.retries import RetryingStore, close_store, opened_store
from objckpt.transfer.stats import TransferStats

log = logging.getLogger("objckpt")

#: The committed steps under one manager root store (one listing).
Lister = Callable[[Store], Coroutine[Any, Any, list[int]]]


async def committed_steps(store: Store, *, orbax: bool = False) -> list[int]:
    """The committed steps under the manager root ``store``, ascending (one listing, no blob read);
    with ``orbax``, Orbax's too (:func:`~objckpt.roots.orbax_steps.orbax_steps_in`)."""
    return sorted(step_dirs(await store.list("" if orbax else "step_"), store.url))


def step_dirs(objects: Iterable[ObjectInfo], url: str) -> dict[int, str]:
    """The committed steps in one listing of the root at ``url``: step → its directory's name
    (``step_0000000042`` for objckpt's, ``42`` for Orbax's; objckpt's wins a number both hold)."""
    objects = list(objects)
    steps = {step: str(step) for step in orbax_steps_in(objects, url)}
    for obj in objects:
        head, _, tail = obj.key.partition("/")
        match = STEP_DIR.match(head)
        if match and tail == MANIFEST_KEY:
            steps[int(match.group(1))] = head
    return steps


def root_steps(
    root_url: str, storage_options: dict[str, Any] | None = None, options: Options | None = None
) -> list[int]:
    """The committed steps of the objckpt manager root at ``root_url`` (one listing), ascending."""
    with opened_store(root_url, storage_options, options or Options()) as store:
        return runtime.run_sync(committed_steps(store))


def list_steps(root: Store, replicas: Sequence[Location], options: Options, lister: Lister) -> list[int]:
    """The committed steps under ``root``; when it does not answer, under its ``replicas``.

    Raises:
        StoreError: neither the root nor any replica answered (each one's error named).
    """
    if not replicas:
        return runtime.run_sync(lister(root))
    try:
        probe = probing_store(root, options) if isinstance(root, RetryingStore) else root
        return runtime.run_sync(lister(probe))
    except OSError as e:  # StoreError, timeouts, refused connections: the replicas may answer
        root_error: OSError = e
    stores = open_locations(replicas, options, TransferStats())
    try:
        answers = runtime.run_sync(_list_all(stores, options, lister))
    finally:
        for store in stores:
            close_store(store)
    answered = {store.url: found for store, found in zip(stores, answers, strict=True) if isinstance(found, list)}
    failed = {store.url: found for store, found in zip(stores, answers, strict=True) if not isinstance(found, list)}
    why = f"{type(root_error).__name__}: {root_error}"
    if not answered:
        said = "; ".join(f"{url}: {type(e).__name__}: {e}" for url, e in failed.items())
        raise StoreError(
            f"cannot list the steps under {root.url} ({why}), nor under any replica ({said})"
        ) from root_error
    steps = sorted(set().union(*answered.values()))
    log.warning(
        "objckpt listed the steps under %s from its replicas %s: the root did not answer (%s)%s;"
        " a replica may lag behind the root",
        root.url,
        ", ".join(answered),
        why,
        "".join(f"; {url} did not answer either ({type(e).__name__})" for url, e in failed.items()),
    )
    return steps


async def _list_all(
    stores: Sequence[RetryingStore], options: Options, lister: Lister
) -> list[list[int] | BaseException]:
    async def one(store: RetryingStore) -> list[int]:
        return await lister(probing_store(store, options))

    return list(await asyncio.gather(*(one(s) for s in stores), return_exceptions=True))


@dataclass
class Listed:
    """One checkpoint (or step directory) found under a root."""

    name: str  # relative to the root; "" for the root itself
    step: int | None
    committed: bool
    nbytes: int
    objects: int
    time: float | None
    format: str = "objckpt"  # or "orbax"
    referenced: int = 0  # without a manifest: its objects that committed checkpoints beside it reference

    @property
    def status(self) -> str:
        """``yes``, ``no``, or ``referenced``: no manifest, but blobs that committed steps reference."""
        return "yes" if self.committed else "referenced" if self.referenced else "no"


async def mark_referenced(store: Store, entries: list[Listed], objects: list[ObjectInfo], size_limit: int) -> None:
    """Count the objects (``objects``: the listing) of each uncommitted directory of ``entries``
    that committed checkpoints beside it reference; read only when there is such a directory."""
    top = [e for e in entries if e.format == "objckpt" and e.name and "/" not in e.name]
    bare = {e.name for e in top if not e.committed}
    try:
        heads = [e.name for e in top if e.committed] if bare else []
        found = await referenced(store, heads, [o.key for o in objects if o.key.partition("/")[0] in bare], size_limit)
    except Unknown:
        return  # a manifest cannot be read: left unsaid
    for e in top:
        e.referenced = sum(k.startswith(f"{e.name}/") for k in found)


#: Files that mark an Orbax checkpoint (a step of Orbax's CheckpointManager, or one item).
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")
_ORBAX_STEP = re.compile(r"^(\d+)$")


def group_checkpoints(objects: list[ObjectInfo], url: str = "") -> list[Listed]:
    """Checkpoints under a root from one listing: every directory holding a manifest, plus
    every manager step directory (committed or not), plus Orbax's: a step directory of its
    ``CheckpointManager`` (``<step>/``, committed once ``_CHECKPOINT_METADATA`` is there and,
    in a bucket (``url``), ``commit_success.txt``: :mod:`objckpt.roots.orbax_steps`) or
    an Orbax item at the root. Each object counts toward the deepest one; live-save
    markers (:mod:`objckpt.saving.live_markers`) count toward none."""
    objects = [o for o in objects if not is_marker(o.key)]
    dirs: set[str] = set()
    orbax: set[str] = set()
    for o in objects:
        if o.key == MANIFEST_KEY:
            dirs.add("")
        elif o.key.endswith("/" + MANIFEST_KEY):
            dirs.add(o.key[: -len(MANIFEST_KEY) - 1])
        head, slash, rest = o.key.partition("/")
        if slash and STEP_DIR.match(head):
            dirs.add(head)
        if o.key in _ORBAX_MARKERS:
            orbax.add("")
        elif slash and _ORBAX_STEP.match(head) and rest.rpartition("/")[2] in _ORBAX_MARKERS:
            orbax.add(head)
    dirs |= orbax
    found: dict[str, Listed] = {}
    for o in objects:
        parts = o.key.split("/")[:-1]
        owner = next(("/".join(parts[:n]) for n in range(len(parts), -1, -1) if "/".join(parts[:n]) in dirs), None)
        if owner is None:
            continue
        match = STEP_DIR.match(owner) or _ORBAX_STEP.match(owner)
        kind = "orbax" if owner in orbax else "objckpt"
        entry = found.setdefault(owner, Listed(owner, int(match.group(1)) if match else None, False, 0, 0, None, kind))
        entry.nbytes += o.size
        entry.objects += 1
        rel = o.key[len(owner) + 1 :] if owner else o.key
        if rel == MANIFEST_KEY or (kind == "orbax" and rel in _ORBAX_MARKERS):
            entry.committed = True
            entry.time = o.last_modified
        elif not entry.committed and o.last_modified is not None:
            entry.time = max(entry.time or 0.0, o.last_modified)
    if url and not renames_to_commit(url):  # an Orbax save in a bucket is committed by its commit file
        keys = {o.key for o in objects}
        for e in found.values():
            e.committed = e.committed and (e.format != "orbax" or f"{e.name}/{COMMIT_FILE}".lstrip("/") in keys)
    return sorted(found.values(), key=lambda e: (e.step is None, e.step or 0, e.name))
