"""Offline jobs (verify, cp, export, convert) fanned out as tasks on a Dask cluster.

A job cuts its work by bytes into tasks (:func:`fan_out`: keys derived from the job, so a task a
dead worker held is run again under the same key and writes the same objects), and the caller's
process commits once at the end.
Dask (``distributed``) is the optional extra ``objckpt[dask]``, imported only here, when asked.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from objckpt.errors import StoreNotAvailableError


@contextlib.contextmanager
def cluster(workers: int | None, scheduler: str | None, memory_per_worker: int | None = None) -> Iterator[Any]:
    """A ``distributed.Client``: on the cluster at ``scheduler``, or on a ``LocalCluster`` of ``workers``
    one-thread processes, each limited to ``memory_per_worker`` bytes of data (plus 1 GiB for the
    interpreter and imports), started here and stopped on exit; None when neither is given."""
    if not workers and not scheduler:
        yield None
        return
    try:
        import distributed as dask
    except ImportError:
        raise StoreNotAvailableError("running on Dask needs the extra: pip install 'objckpt[dask]'") from None
    if scheduler:
        with dask.Client(scheduler) as client:
            yield client
        return
    limit = memory_per_worker + (1 << 30) if memory_per_worker else "auto"
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


def fan_out(
    client: Any, job: str, fn: Callable[..., Any], items: Sequence[tuple[Any, int]], **kwargs: Any
) -> list[Any]:
    """``fn(run, **kwargs)`` on ``client``'s cluster for each run of ``items`` (``(item, bytes)`` in order, cut
    into runs of about equal bytes, 4 per worker thread), the results in order, a task retried where a worker
    dies. ``job`` names the job (``"verify s3://b/ckpt"``) in the tasks' keys."""
    parts, total, held = 4 * max(1, sum(client.nthreads().values())), sum(n for _, n in items), 0
    groups: list[list[Any]] = [[]]
    for item, n in items:
        if groups[-1] and held * parts >= total * len(groups) and len(groups) < parts:
            groups.append([])
        groups[-1].append(item)
        held += n
    token = f"{zlib.crc32(job.encode()):08x}"
    keys = [f"objckpt-{job.split()[0]}-{token}-{i}" for i in range(len(groups))]
    futures = client.map(fn, list(groups), key=keys, retries=3, **kwargs)
    try:
        return list(client.gather(futures))
    except BaseException:
        client.cancel(futures)
        raise
