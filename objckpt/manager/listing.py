"""A manager's committed steps, from its replicas when its root does not answer.

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
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from objckpt.errors import StoreError
from objckpt.options import Options
from objckpt.restoring.locations import Location, open_locations, probing_store
from objckpt.storage import Store
from objckpt.transfer import runtime
from objckpt.transfer.engine import RetryingStore, TransferStats, close_store

log = logging.getLogger("objckpt")

#: The committed steps under one manager root store (one listing).
Lister = Callable[[Store], Coroutine[Any, Any, list[int]]]


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
