"""inspect: what a checkpoint holds, from its manifest alone (no array data read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from objckpt.core.format import LeafEntry, Manifest
from objckpt.errors import CheckpointNotFoundError
from objckpt.options import Options
from objckpt.progress import human_bytes
from objckpt.transfer import runtime
from objckpt.transfer.engine import opened_store
from objckpt.layouts.manifest_io import read_manifest


@dataclass(frozen=True)
class LeafInfo:
    """One saved leaf: its path, kind, shape, dtype and size in bytes."""

    path: str
    kind: str
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int
    sharding: dict[str, Any] | None = None
    value: Any = None  # for inline leaves (int, float, bool, None)

    @property
    def key_type(self) -> str | None:
        """For a typed PRNG key array, its JAX key type (``key<threefry2x32>``); the leaf's
        ``dtype`` and ``shape`` are those of the stored key data (``jax.random.key_data``),
        whose last dimension holds one key's words."""
        impl = (self.sharding or {}).get("prng_impl")
        return f"key<{impl}>" if impl is not None else None

    def __str__(self) -> str:
        if self.shape is None:
            return f"{self.path}  {self.kind} = {self.value!r}"
        if self.key_type is not None:
            return (
                f"{self.path}  {self.key_type}{list(self.shape[:-1])} (stored as {self.dtype}{list(self.shape)})"
                f"  {human_bytes(self.nbytes)}  ({self.kind})"
            )
        return f"{self.path}  {self.dtype}{list(self.shape)}  {human_bytes(self.nbytes)}  ({self.kind})"


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`inspect` returns.

    Attributes:
        url: the checkpoint.
        tree: the saved tree with a :class:`LeafInfo` at every leaf.
        leaves: the same leaves by path, in manifest order.
        total_bytes: array bytes over all leaves.
        num_blobs: objects holding the array data.
        format_version, created, save_id, num_processes, metadata: from the manifest.
        format: ``"objckpt"``, or ``"orbax"`` for an Orbax checkpoint (format_version 0,
            no save_id; its arrays are in Orbax's own files, not blobs).
    """

    url: str
    tree: Any
    leaves: dict[str, LeafInfo]
    total_bytes: int
    num_blobs: int
    format_version: int
    created: str
    save_id: str
    num_processes: int
    metadata: dict[str, Any]
    format: str = "objckpt"

    def __str__(self) -> str:
        if self.format == "orbax":
            summary = f"  Orbax checkpoint, created {self.created}, {len(self.leaves)} leaves, {human_bytes(self.total_bytes)}"
        else:
            summary = (
                f"  format v{self.format_version}, created {self.created}, {self.num_processes} process(es),"
                f" {len(self.leaves)} leaves, {human_bytes(self.total_bytes)} in {self.num_blobs} blobs"
            )
        lines = [f"checkpoint {self.url}", summary]
        if self.metadata:
            lines.append(f"  metadata: {self.metadata}")
        lines.extend(f"  {leaf}" for leaf in self.leaves.values())
        return "\n".join(lines)


def leaf_info(entry: LeafEntry) -> LeafInfo:
    return LeafInfo(entry.path, entry.kind, entry.shape, entry.dtype, entry.nbytes, entry.sharding, entry.value)


def info_from_manifest(url: str, manifest: Manifest) -> CheckpointInfo:
    from objckpt.core.tree import build  # imports JAX: here, so that importing this module does not

    infos = [leaf_info(e) for e in manifest.leaves]
    return CheckpointInfo(
        url=url,
        tree=build(manifest.tree, lambda i: infos[i]),
        leaves={i.path: i for i in infos},
        total_bytes=manifest.total_bytes,
        num_blobs=manifest.num_blobs,
        format_version=manifest.version,
        created=manifest.created,
        save_id=manifest.save_id,
        num_processes=manifest.num_processes,
        metadata=manifest.metadata,
    )


def inspect(
    url: str, *, storage_options: dict[str, Any] | None = None, options: Options | None = None
) -> CheckpointInfo:
    """Describe a committed checkpoint without reading any array data.

    An Orbax checkpoint is described from its metadata and its arrays' zarr
    headers (:func:`objckpt.orbax.inspect.inspect_orbax`).
    """
    options = options or Options()
    with opened_store(url, storage_options, options) as store:
        try:
            manifest = runtime.run_sync(read_manifest(store, size_limit=options.manifest_size_limit))
        except CheckpointNotFoundError:
            from objckpt.orbax import orbax_item_at
            from objckpt.orbax.inspect import inspect_orbax

            item = orbax_item_at(store)
            if item is None:
                raise
            return inspect_orbax(item, storage_options)
    return info_from_manifest(store.url, manifest)
