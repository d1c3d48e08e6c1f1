"""Offline jobs (verify, cp, export, convert) fanned out as tasks on a Dask cluster.

A job splits its work by bytes (:func:`split`), runs one task per group on the cluster
(:func:`fan_out`: keys derived from the job, so a task a dead worker held is run again under
the same key and writes the same objects), and the caller's process commits once at the end.
Dask (``distributed``) is the optional extra ``objckpt[dask]``, imported only here, when asked.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from objckpt.errors import StoreNotAvailableError

T = TypeVar("T")

#: Bytes a worker holds beyond its tasks' data (the interpreter and objckpt's imports).
WORKER_OVERHEAD = 1 << 30


def _distributed() -> Any:
    try:
        import distributed
    except ImportError:
        raise StoreNotAvailableError("running on Dask needs the extra: pip install 'objckpt[dask]'") from None
    return distributed


@contextlib.contextmanager
def cluster(workers: int | None, scheduler: str | None, memory_per_worker: int | None = None) -> Iterator[Any]:
    """A ``distributed.Client``: on the cluster at ``scheduler``, or on a ``LocalCluster`` of ``workers``
    one-thread processes, each limited to ``memory_per_worker`` bytes of data (plus
    :data:`WORKER_OVERHEAD`), started here and stopped on exit; None when neither is given."""
    if not workers and not scheduler:
        yield None
        return
    dask = _distributed()
    if scheduler:
        with dask.Client(scheduler) as client:
            yield client
        return
    limit = memory_per_worker + WORKER_OVERHEAD if memory_per_worker else "auto"
    chatty = logging.getLogger("distributed")  # its scheduler, here, logs every step at INFO
    level = chatty.level
    chatty.setLevel(logging.ERROR)
    try:
        with (
            dask.LocalCluster(
                n_workers=workers, threads_per_worker=1, memory_limit=limit, dashboard_address=None
            ) as lc,
            dask.Client(lc) as client,
        ):
            yield client
    finally:
        chatty.setLevel(level)


def split(items: Sequence[T], size: Callable[[T], int], parts: int) -> list[list[T]]:
    """``items`` in order, cut into at most ``parts`` runs of about equal bytes (none empty)."""
    total, held, groups, run = sum(map(size, items)), 0, list[list[T]](), list[T]()
    for item in items:
        run.append(item)
        held += size(item)
        if held * parts >= total * (len(groups) + 1) and len(groups) < parts - 1:
            groups.append(run)
            run = []
    return [*groups, run] if run else groups


def tasks_for(client: Any) -> int:
    """How many tasks to cut a job into on ``client``'s cluster: a few per worker thread."""
    return 4 * max(1, sum(client.nthreads().values()))


def fan_out(client: Any, job: str, fn: Callable[..., T], groups: Sequence[Any], **kwargs: Any) -> list[T]:
    """``fn(group, **kwargs)`` for every group on ``client``'s cluster, in order, retried where a
    worker dies. ``job`` names the job (e.g. ``"verify s3://b/ckpt"``) in the tasks' keys."""
    token = f"{zlib.crc32(job.encode()):08x}"
    keys = [f"objckpt-{job.split()[0]}-{token}-{i}" for i in range(len(groups))]
    futures = client.map(fn, list(groups), key=keys, retries=3, **kwargs)
    try:
        return list(client.gather(futures))
    except BaseException:
        client.cancel(futures)
        raise
