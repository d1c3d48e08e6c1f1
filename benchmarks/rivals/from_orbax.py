"""objckpt reading Orbax's checkpoints: Orbax saves (``StandardCheckpointer``, as the
``orbax`` system does), then objckpt restores that same checkpoint through tensorstore,
onto the saved mesh (``restore``) and onto another (``restore_resharded``), and converts it
into its own format (``convert``, written next to it).

Compared with the ``orbax`` system's restore of its own checkpoint in the same run (the
migration issue's target: objckpt restoring an Orbax checkpoint at ≥ 1.0× Orbax's speed,
peak memory ≤ the restored bytes + 256 MiB). Orbax's save goes where the ``orbax`` system's
does (natively on GCS, through s3fs-fuse on S3); objckpt reads it straight from the store.
"""

from __future__ import annotations

from typing import Any

from benchmarks.rivals import orbax_ckpt, workloads
from benchmarks.rivals.common import Context

NAME = "objckpt reading orbax"


def env(ctx: Context) -> dict[str, str]:
    return orbax_ckpt.env(ctx)


def supports(ctx: Context) -> str | None:
    why = orbax_ckpt.supports(ctx)
    if why is not None:
        return why
    try:
        import tensorstore  # noqa: F401
    except ImportError:
        return "tensorstore not installed (pip install -e '.[orbax]')"
    import objckpt  # noqa: F401

    return None


def finish(ctx: Context) -> None:
    orbax_ckpt.finish(ctx)


def prepare_save(ctx: Context, workload: workloads.Workload) -> Any:
    return orbax_ckpt.prepare_save(ctx, workload)


def save(ctx: Context, workload: workloads.Workload, state: Any) -> dict:
    return orbax_ckpt.save(ctx, workload, state)


def prepare_restore(ctx: Context, workload: workloads.Workload, resharded: bool) -> Any:
    return workloads.abstract_tree(workload, "reshard" if resharded else "save")


def restore(ctx: Context, workload: workloads.Workload, target: Any) -> tuple[list | None, dict]:
    import jax

    import objckpt

    options = ctx.fsspec_options()
    stats = objckpt.TransferStats()
    if ctx.phase == "convert":
        done = objckpt.convert_orbax(
            ctx.url, f"{ctx.url}-objckpt", src_storage_options=options, dst_storage_options=options
        )
        return None, {"bytes_read": done.bytes_read, "bytes_written": done.bytes_written}
    tree = objckpt.restore(ctx.url, target, storage_options=options, stats=stats)
    jax.block_until_ready(tree)
    if int(tree["step"]) != workload.step:
        raise RuntimeError(f"step restored as {tree['step']!r}")
    return workloads.flat(workload, tree), {"requests": stats.requests, "bytes_read": stats.bytes_read}
