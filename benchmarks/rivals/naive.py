"""Naive: one object per array with s3fs (gcsfs on GCS), one leaf after the other.

Save: ``np.asarray`` gathers each jax.Array to the host, ``pipe_file`` writes it;
the step goes in a small JSON object. Restore: ``cat_file`` each object,
``np.frombuffer``, ``jax.device_put`` onto the target sharding. What a training
script does when it has no checkpoint library.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from benchmarks.rivals import workloads
from benchmarks.rivals.common import Context

NAME = "naive"


def env(ctx: Context) -> dict[str, str]:
    return {}


def supports(ctx: Context) -> str | None:
    # The client library is imported untimed, as every system's is.
    if ctx.store == "s3":
        import s3fs  # noqa: F401
    else:
        import gcsfs  # noqa: F401
    return None


def _fs(ctx: Context) -> Any:
    if ctx.store == "s3":
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **ctx.fsspec_options())
    import gcsfs

    return gcsfs.GCSFileSystem(skip_instance_cache=True, **ctx.fsspec_options())


def _path(ctx: Context, leaf: workloads.LeafSpec) -> str:
    return f"{ctx.bucket}/{ctx.prefix}/{leaf.name}.npy-raw"


def prepare_save(ctx: Context, workload: workloads.Workload) -> Any:
    return workloads.jax_tree(workload)


def prepare_restore(ctx: Context, workload: workloads.Workload, resharded: bool) -> Any:
    return workloads.abstract_tree(workload, "reshard" if resharded else "save")


def save(ctx: Context, workload: workloads.Workload, state: Any) -> dict:
    fs = _fs(ctx)
    for leaf, value in zip(workload.leaves, workloads.flat(workload, state)):
        fs.pipe_file(_path(ctx, leaf), np.asarray(value).tobytes())
    fs.pipe_file(f"{ctx.bucket}/{ctx.prefix}/step.json", json.dumps({"step": state["step"]}).encode())
    return {"objects": len(workload.leaves) + 1}


def restore(ctx: Context, workload: workloads.Workload, target: Any) -> tuple[list, dict]:
    import jax

    fs = _fs(ctx)
    values = []
    for leaf, abstract in zip(workload.leaves, workloads.flat(workload, target)):
        data = fs.cat_file(_path(ctx, leaf))
        host = np.frombuffer(data, dtype=leaf.dtype).reshape(leaf.shape)
        values.append(jax.device_put(host, abstract.sharding))
    step = json.loads(fs.cat_file(f"{ctx.bucket}/{ctx.prefix}/step.json"))["step"]
    jax.block_until_ready(values)
    if step != workload.step:
        raise RuntimeError(f"step restored as {step!r}")
    return values, {}
