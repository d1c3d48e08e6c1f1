"""Leaves read on a read sharding → their target shardings, moved on the devices by JAX.

:mod:`objckpt.restoring.read_sharding` picks the leaves that are read onto a
sharding lined up with the saved pieces; once every such leaf has landed there,
:func:`reshard` moves each one to its target sharding with ``jax.device_put``
(a collective across processes: ICI or DCN on a pod, JAX's CPU collectives on
CPU test processes), one leaf at a time in leaf order (the same order on every
process, so the collectives line up), and frees the read-sharding array right
after, so device memory holds at most one leaf beyond the restored ones.

With several processes, :func:`fetch_agreed` runs the fetch and then agrees,
through the coordination service and with a timeout, that every process
succeeded: a process that failed to read must not leave the others waiting in
a collective, which has no timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax

from objckpt.errors import CoordinationError
from objckpt.multihost import get_coordinator, operation_tag
from objckpt.restoring.read_sharding import Resharded
from objckpt.transfer.stats import TransferStats

log = logging.getLogger("objckpt")


def devices_can_reshard() -> bool:
    """Whether this job's devices can move arrays between processes: one process, an
    accelerator, or CPU devices with JAX's CPU collectives turned on by the user
    (``jax_cpu_collectives_implementation``; objckpt never changes that setting)."""
    if jax.process_count() == 1:
        return True
    if jax.default_backend() != "cpu":
        return True
    return bool(getattr(jax.config, "jax_cpu_collectives_implementation", None))  # absent in older JAX: read directly


def fetch_agreed(run: Callable[[], None], url: str, timeout: float, *, operation: str = "reshard") -> None:
    """Run ``run()`` (this process's reads), then agree with the other processes that all succeeded.

    Whatever collective follows (a reshard here, read-once's sharing) comes only after
    this: a collective has no timeout. Only failures are published (nothing per process
    when all went well); the barrier waits at most ``timeout`` seconds. ``operation``
    names the keys and barrier (:func:`objckpt.multihost.operation_tag`).

    Raises:
        The error ``run`` raised here; CoordinationError naming the processes that failed
        elsewhere, or a barrier that timed out.
    """
    if jax.process_count() == 1:
        run()
        return
    coordinator = get_coordinator()
    tag = operation_tag(operation, url)
    error: BaseException | None = None
    try:
        run()
    except BaseException as e:
        error = e
    try:
        if error is not None:
            coordinator.publish(f"{tag}/failed", f"{type(error).__name__}: {error}"[:2000].encode())
        coordinator.barrier(f"{tag}/fetched", timeout=timeout)
        statuses = coordinator.collect(f"{tag}/failed")
    except CoordinationError:
        coordinator.forget(tag)
        raise
    coordinator.release(tag)
    if error is not None:
        raise error
    failed = [f"process {p}: {s.decode()}" for p, s in sorted(statuses.items())]
    if failed:
        raise CoordinationError(f"restore of {url} failed elsewhere: {'; '.join(failed)}")


def reshard(
    results: dict[int, Any], reads: Mapping[int, Resharded], stats: TransferStats | None = None
) -> dict[int, Any]:
    """``results`` with each leaf of ``reads`` moved from its read sharding to its target one.

    Leaf by leaf in leaf order; each read-sharding array is dropped once its leaf is placed.
    ``stats.device_bytes_moved`` counts the bytes this process's devices receive (from the plan).
    """
    out = dict(results)
    here = jax.process_index()
    moved = 0
    for i in sorted(reads):
        if i not in out:
            continue
        # The read-sharding array goes with its last reference, not by delete(): the placed
        # array may share its buffers where a shard does not move (the CPU backend's does).
        out[i] = jax.block_until_ready(jax.device_put(out[i], reads[i].target))
        moved += reads[i].choice.moved_to(d.id for d in reads[i].target.mesh.devices.flat if d.process_index == here)
    if stats is not None and moved:
        stats.add(device_bytes_moved=moved)
    if reads:
        log.debug("objckpt: %d leaves read on the saved grid and resharded on the devices", len(reads))
    return out
