"""objckpt with default options: ``objckpt.save`` / ``objckpt.restore`` of the sharded tree.

Through its default adapter for each scheme (obstore for ``s3://``, gcsfs for ``gs://``).
``restore_resharded`` restores onto a (2, 4) mesh whose boxes have other shapes than the
saved ones (rows 2-way, columns 4-way), so every device assembles its box from parts
of two saved shards.
"""

from __future__ import annotations

from typing import Any

from benchmarks.rivals import workloads
from benchmarks.rivals.common import Context

NAME = "objckpt"


def env(ctx: Context) -> dict[str, str]:
    return {}


def supports(ctx: Context) -> str | None:
    # Imported here, untimed, as every peer imports its library in ``supports``: a user
    # pays the import once per process, not once per checkpoint (0.16-0.18 s here). The
    # same for the client library of objckpt's default adapter for this store, which it
    # imports on first use (gcsfs: 0.5-0.7 s), and which the raw ceiling imports untimed.
    import objckpt

    # ``import objckpt`` is lazy: its API modules load with the first public name used, as a
    # ``from objckpt import restore`` at the top of a user's script loads them.
    objckpt.save, objckpt.restore, objckpt.TransferStats  # noqa: B018

    if ctx.store == "gcs" and not ctx.real:
        import gcsfs  # noqa: F401
    else:
        import obstore  # noqa: F401
    return None


def _options(ctx: Context) -> dict[str, Any]:
    """The store's options; over HTTPS on GCS also objckpt's ``ca_bundle`` (on S3 the CA
    is already botocore's ``client_kwargs["verify"]``, which objckpt reads too)."""
    options = ctx.fsspec_options()
    if ctx.ca_file and ctx.store == "gcs":
        options["ca_bundle"] = ctx.ca_file
    return options


def prepare_save(ctx: Context, workload: workloads.Workload) -> Any:
    return workloads.jax_tree(workload)


def prepare_restore(ctx: Context, workload: workloads.Workload, resharded: bool) -> Any:
    return workloads.abstract_tree(workload, "reshard" if resharded else "save")


def save(ctx: Context, workload: workloads.Workload, state: Any) -> dict:
    import objckpt

    stats = objckpt.save(ctx.url, state, storage_options=_options(ctx))
    return {"requests": stats.requests, "objects": stats.objects_written, "retries": stats.retries}


def restore(ctx: Context, workload: workloads.Workload, target: Any) -> tuple[list, dict]:
    import jax

    import objckpt

    stats = objckpt.TransferStats()
    tree = objckpt.restore(ctx.url, target, storage_options=_options(ctx), stats=stats)
    jax.block_until_ready(tree)
    if tree["step"] != workload.step:
        raise RuntimeError(f"step restored as {tree['step']!r}")
    return workloads.flat(workload, tree), {
        "requests": stats.requests,
        "bytes_read": stats.bytes_read,
        "retries": stats.retries,
    }
