"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``) with default options,
through its fsspec storage layer (``FsspecWriter`` / ``FsspecReader``) on s3fs (gcsfs on
GCS), in one process without a process group (``no_dist=True``).

The state is the same values as torch CPU tensors of the same shapes and nesting
(plus the step as a Python int); there is no device mesh in a single torch process,
so tensors are whole. Restore loads in place into preallocated tensors, DCP's API.
``pip install torch==2.13.0`` (CPU build).
"""

from __future__ import annotations

from typing import Any

from benchmarks.rivals import workloads
from benchmarks.rivals.common import Context

NAME = "dcp"


def env(ctx: Context) -> dict[str, str]:
    return {}


def supports(ctx: Context) -> str | None:
    try:
        import torch.distributed.checkpoint._fsspec_filesystem  # noqa: F401
    except ImportError:
        return "torch not installed (pip install torch==2.13.0)"
    return None


def prepare_save(ctx: Context, workload: workloads.Workload) -> Any:
    import torch

    values = [torch.from_numpy(workloads.leaf_values(leaf)) for leaf in workload.leaves]
    return workloads.nest(workload, values, workload.step)


def prepare_restore(ctx: Context, workload: workloads.Workload, resharded: bool) -> Any:
    return None


def save(ctx: Context, workload: workloads.Workload, state: Any) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    dcp.save(state, storage_writer=FsspecWriter(ctx.url, **ctx.fsspec_options()), no_dist=True)
    return {}


def restore(ctx: Context, workload: workloads.Workload, target: Any) -> tuple[list, dict]:
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    values = [torch.empty(leaf.shape, dtype=getattr(torch, np.dtype(leaf.dtype).name)) for leaf in workload.leaves]
    state = workloads.nest(workload, values, 0)
    dcp.load(state, storage_reader=FsspecReader(ctx.url, **ctx.fsspec_options()), no_dist=True)
    if state["step"] != workload.step:
        raise RuntimeError(f"step restored as {state['step']!r}")
    return [t.numpy() for t in workloads.flat(workload, state)], {}
