"""Describe an Orbax checkpoint as ``objckpt.inspect`` describes its own: leaves, shapes,
dtypes, sizes and saved shardings, from the metadata files and each array's zarr
header (no array data read)."""

from __future__ import annotations

import math
from typing import Any

from objckpt.errors import FormatError, StoreError
from objckpt.layouts.base import CheckpointInfo, LeafInfo
from objckpt.options import Options
from objckpt.orbax.layout import OrbaxItem, OrbaxLeaf, numpy_dtype
from objckpt.orbax.tensorstore_io import Waiter, array_spec, describe_kvstore, import_tensorstore, kvstore_for


def inspect_orbax(
    item: OrbaxItem, storage_options: dict[str, Any] | None, options: Options | None = None
) -> CheckpointInfo:
    """The :class:`~objckpt.layouts.base.CheckpointInfo` of an Orbax item (``format="orbax"``);
    each header's open waits at most ``options.request_timeout`` without an answer."""
    ts = import_tensorstore()
    infos: list[LeafInfo] = []
    with kvstore_for(item.url, storage_options) as (kvstore, context_spec):
        context = ts.Context(context_spec)
        opened: dict[str, Any] = {}
        waiter = Waiter((options or Options()).request_timeout, describe_kvstore(kvstore), lambda: opened.values())
        opened |= {
            leaf.name: ts.open(
                array_spec(kvstore, leaf.name, use_ocdbt=item.use_ocdbt, use_zarr3=item.use_zarr3),
                open=True,
                context=context,
            )
            for leaf in item.leaves
            if leaf.kind in ("array", "scalar")
        }
        for leaf in item.leaves:
            infos.append(_leaf_info(item, leaf, opened.get(leaf.name), waiter))
    return CheckpointInfo(
        url=item.url,
        tree=item.skeleton(lambda i: infos[i]),
        leaves={info.path: info for info in infos},
        total_bytes=sum(info.nbytes for info in infos),
        num_blobs=0,
        format_version=0,
        created=item.created,
        save_id="",
        num_processes=item.num_processes,
        metadata={},
        format="orbax",
    )


def _leaf_info(item: OrbaxItem, leaf: OrbaxLeaf, future: Any, waiter: Waiter) -> LeafInfo:
    if leaf.kind == "string":
        return LeafInfo(leaf.path, "str", None, None, 0, None, item.strings[leaf.name])
    if future is None:
        return LeafInfo(leaf.path, leaf.kind, None, None, 0)
    try:
        array = waiter.wait(future, f"opening leaf {leaf.path} ({leaf.name}) of the Orbax checkpoint {item.url}")
    except StoreError:
        raise
    except Exception as exc:  # tensorstore raises ValueError for every failure
        raise FormatError(f"Orbax checkpoint {item.url}: cannot open leaf {leaf.path} ({leaf.name}): {exc}") from exc
    dtype = numpy_dtype(array.dtype)
    shape = tuple(int(n) for n in array.shape)
    nbytes = math.prod(shape) * dtype.itemsize  # Python ints: a header may declare any shape
    kind = "array" if leaf.kind == "array" else "scalar"
    return LeafInfo(leaf.path, kind, shape, dtype.name, nbytes, _sharding(leaf.sharding))


def _sharding(described: dict[str, Any] | None) -> dict[str, Any] | None:
    """Orbax's description of a saved sharding, in the shape objckpt's own manifests use."""
    if not described:
        return None
    kind = described.get("sharding_type")
    if kind == "NamedSharding":
        axes, sizes = described.get("axis_names") or [], described.get("shape") or []
        return {
            "type": "NamedSharding",
            "mesh": {str(a): int(n) for a, n in zip(axes, sizes, strict=False)},
            "spec": list(described.get("partition_spec") or []),
        }
    if kind == "SingleDeviceSharding":
        return {"type": "SingleDeviceSharding", "devices": 1}
    return {"type": str(kind)}
