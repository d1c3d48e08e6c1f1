"""export_safetensors: an objckpt checkpoint → Hugging Face's sharded safetensors layout, in any store.

The export is planned before any read (:mod:`objckpt.safetensors.shards`): which
leaves, their tensor names, their files. Then file by file, the file's leaves
are read from the checkpoint with :func:`objckpt.restore` (ranged reads of their
pieces only, checked against their crc32c, as host numpy) and the file is
written as one object from its header and the arrays' own buffers, with no
join into one buffer where the destination's client sends parts as they are
(obstore, local disk; large objects go as multipart uploads). Host memory holds
one file's tensors at a time, so an export needs about ``max_shard_bytes`` plus
the restore's window, whatever the checkpoint's size. The index
(``model.safetensors.index.json``) is written last, so a directory with an index
has every file it names.

An export over an earlier one (``overwrite=True``) first deletes the earlier
index and ``model.safetensors``, the files loaders open first, so that until the
new export's index (or single file) lands no reader takes old and new files for
one export; then it deletes the earlier shard files the new export does not name.

Several processes can export one checkpoint together: ``part=(k, n)`` writes the
files whose number is ``k`` modulo ``n`` (the plan is the same on every
process); every part checks the destination (or clears it, overwriting) before
it writes; the process with ``k == 0`` writes the index once its own files are
written, so the caller starts it last or waits for the others before using the
index.
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from objckpt.errors import FormatError, ObjectExistsError, ObjectNotFoundError
from objckpt.layouts.native import NativeCheckpoint
from objckpt.layouts.registry import open_checkpoint
from objckpt.options import Options
from objckpt.progress import ProgressArg, finish_from_caller, start
from objckpt.restoring.api import restore
from objckpt.restoring.casts import cast_values
from objckpt.restoring.locations import as_locations
from objckpt.safetensors.header import encode_header, numpy_dtype
from objckpt.safetensors.shards import (
    INDEX_FILE,
    SINGLE_FILE,
    ExportTensor,
    Names,
    choose_tensors,
    dotted_names,
    file_names,
    index_document,
    plan_shards,
)
from objckpt.transfer import dask_jobs, runtime
from objckpt.transfer.handle import Handle, opened
from objckpt.transfer.stats import TransferStats

log = logging.getLogger("objckpt")

#: The default largest file of an export: 5 GiB, S3's largest single PUT and Hugging Face's own default size.
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
#: A sharded export's file name (``model-00001-of-00003.safetensors``).
_SHARD_FILE = re.compile(r"model-\d+-of-\d+\.safetensors")
#: What an export's files carry in ``__metadata__``: the format Hugging Face loaders accept for plain tensors.
FILE_METADATA = {"format": "pt"}


@dataclass
class ExportStats:
    """What :func:`export_safetensors` did.

    Attributes:
        files: the files this process wrote, in order (the index included when it wrote it).
        tensors: how many tensors those files hold.
        tensor_bytes: bytes of tensor data written.
        bytes_read: bytes read from the checkpoint.
        bytes_written: bytes written to the destination (headers and index included).
        seconds: wall time.
    """

    files: list[str] = field(default_factory=list)
    tensors: int = 0
    tensor_bytes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0


#: What export says of a checkpoint of another layout, and what to run instead.
_NOT_NATIVE = {
    "orbax": "an Orbax checkpoint: export reads objckpt checkpoints; convert it first (`objckpt cp URL NEW_URL`"
    " or objckpt.convert_orbax), then export NEW_URL",
    "safetensors": "a safetensors checkpoint already: export reads objckpt checkpoints; copy its files as they are,"
    " or restore it (objckpt.restore)",
}


def export_safetensors(
    url: str,
    dest: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    names: Names = None,
    dtype: str | None = None,
    subtree: str | None = None,
    src_storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    overwrite: bool = False,
    part: tuple[int, int] | None = None,
    progress: ProgressArg = False,
    storage_options: dict[str, Any] | None = None,
    dest_storage_options: dict[str, Any] | None = None,
    client: Any = None,
) -> ExportStats:
    """Write the checkpoint at ``url`` as safetensors files under ``dest``.

    Args:
        url: an objckpt checkpoint (any store URL).
        dest: a directory or prefix (a local path, ``s3://``, ``gs://``...).
        max_shard_bytes: the most tensor bytes in one file; an export that fits one is
            ``model.safetensors``, else ``model-0000k-of-0000n.safetensors`` files and
            ``model.safetensors.index.json`` (``weight_map``, ``metadata.total_size``).
        names: tensor names: a mapping from the default names (leaf keys joined with
            ``.``, relative to ``subtree``) to others, or a function of the default name
            returning the name or ``None`` to leave the leaf out.
        dtype: a floating dtype (``"bfloat16"``) that floating leaves are written in
            (checked: a finite value that overflows fails the export); others keep theirs.
        subtree: export only the leaves under this ``.``-joined prefix (``"params"``).
        src_storage_options: the source's store options; the destination's too when
            ``dst_storage_options`` is not given and ``dest`` is the same kind of store
            (S3, GCS, local disk...).
        dst_storage_options: the destination's store options.
        options: tuning (the restore's reads; the writes' concurrency, timeouts, retries).
        overwrite: replace an earlier export at ``dest``, leaving none of its files; without
            it a destination holding ``model.safetensors``, the index or this part's first
            file is refused.
        part: ``(k, n)``: this process writes the files numbered ``k`` modulo ``n``.
        progress: as for :func:`objckpt.restore` (operation ``"export"``).
        storage_options: deprecated spelling of ``src_storage_options`` (a DeprecationWarning).
        dest_storage_options: deprecated spelling of ``dst_storage_options`` (a DeprecationWarning).
        client: a ``distributed.Client``: the files are written by tasks on its Dask cluster, a few
            per worker, split by bytes (:mod:`objckpt.transfer.dask_jobs`); this process writes the index.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``url``.
        FormatError: a leaf safetensors cannot hold (named), names that clash, nothing to export.
        ObjectExistsError: ``dest`` already holds an export (and ``overwrite`` is false).
        TypeError: an option given in both its spellings (``storage_options`` and ``src_storage_options``).
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    k, n = part or (0, 1)
    if not (0 <= k < n):
        raise ValueError(f"part must be (k, n) with 0 <= k < n, got {part!r}")
    options = options or Options()
    storage_options = _renamed("storage_options", storage_options, "src_storage_options", src_storage_options)
    dest_options = _renamed("dest_storage_options", dest_storage_options, "dst_storage_options", dst_storage_options)
    if dest_options is None:
        dest_options = as_locations([dest], storage_options, primary=url)[0].storage_options
    started = time.perf_counter()
    read_stats, write_stats = TransferStats(), TransferStats()
    plan: dict[str, Any] = {"max_shard_bytes": max_shard_bytes, "names": names, "dtype": dtype, "subtree": subtree}
    shards, files = _plan(url, storage_options, options, **plan)
    mine = [i for i in range(len(shards)) if i % n == k]
    total = sum(t.nbytes for i in mine for t in shards[i])
    stats = ExportStats()
    with opened(dest, dest_options, options, write_stats) as out:
        runtime.run_sync(_clear_or_refuse(out, [files[i] for i in mine[:1]], overwrite))
        reporter = start(
            progress,
            "export",
            str(out.url),
            total,
            lambda: (min(read_stats.bytes_read, total) + stats.tensor_bytes) // 2,
            read_stats,
            write_stats,
        )
        complete = False
        try:
            if client is not None:
                sized = [(i, sum(t.nbytes for t in shards[i])) for i in mine]
                kw = {"url": url, "dest": dest, "src": storage_options, "dst": dest_options, "options": options}
                for done in dask_jobs.fan_out(client, f"export {url} {dest}", _export_task, sized, plan=plan, **kw):
                    for name in ("tensors", "tensor_bytes", "bytes_read"):
                        setattr(stats, name, getattr(stats, name) + getattr(done, name))
                    stats.files += done.files
                    write_stats.add(bytes_written=done.bytes_written)
            for i in [] if client is not None else mine:
                _write_file(out, url, shards[i], files[i], storage_options, options, read_stats, stats)
                if reporter is not None:
                    reporter.update()
            if k == 0 and len(shards) > 1:
                runtime.run_sync(out.engine.put(INDEX_FILE, index_document(shards, files)))
                stats.files.append(INDEX_FILE)
            if k == 0 and overwrite:
                runtime.run_sync(_remove_stale(out, files))
            complete = True
        finally:
            finish_from_caller(reporter, complete=complete)
    stats.bytes_read += read_stats.bytes_read
    stats.bytes_written = write_stats.bytes_written
    stats.seconds = time.perf_counter() - started
    log.info(
        "objckpt exported %s to %s: %d files, %d tensors, %d bytes in %.2f s",
        url,
        dest,
        len(stats.files),
        stats.tensors,
        stats.tensor_bytes,
        stats.seconds,
    )
    return stats


def _plan(
    url: str, storage_options: Any, options: Options, *, max_shard_bytes: int, names: Names, **kw: Any
) -> tuple[list[list[ExportTensor]], list[str]]:
    """The export's files (:func:`~objckpt.safetensors.shards.plan_shards`) and their names, from the manifest."""
    with opened(url, storage_options, options) as source:
        checkpoint = open_checkpoint(source.store, options=options, storage_options=storage_options)
        if not isinstance(checkpoint, NativeCheckpoint):
            what = _NOT_NATIVE.get(checkpoint.format, f"a {checkpoint.format} checkpoint: export reads objckpt's")
            raise FormatError(f"{url} is {what}")
        manifest = checkpoint.manifest
    leaves = list(manifest.leaves)
    shards = plan_shards(
        choose_tensors(leaves, dotted_names(manifest.tree, len(leaves)), names=names, **kw), max_shard_bytes
    )
    return shards, file_names(len(shards))


def _write_file(
    out: Handle,
    url: str,
    shard: list[ExportTensor],
    file: str,
    src: Any,
    options: Options,
    read: TransferStats,
    stats: ExportStats,
) -> None:
    """Read one file's leaves and write the file (an earlier run's file at its name is replaced)."""
    arrays = _read_shard(url, shard, src, options, read)
    header = encode_header([(t.name, t.dtype, t.shape, t.nbytes) for t in shard], FILE_METADATA)
    parts = [memoryview(header), *(_bytes_of(a) for a in arrays)]
    runtime.run_sync(out.engine.put(file, [p for p in parts if len(p)] or [memoryview(header)]))
    del arrays, parts
    stats.files.append(file)
    stats.tensors += len(shard)
    stats.tensor_bytes += sum(t.nbytes for t in shard)


def _export_task(mine: list[int], url: str, dest: str, src: Any, dst: Any, options: Options, plan: Any) -> ExportStats:
    """A task of an export on Dask: the files numbered ``mine`` of the export's plan."""
    shards, files = _plan(url, src, options, **plan)
    stats, read = ExportStats(), TransferStats()
    with opened(dest, dst, options) as out:
        for i in mine:
            _write_file(out, url, shards[i], files[i], src, options, read, stats)
        stats.bytes_read, stats.bytes_written = read.bytes_read, out.stats.bytes_written
    return stats


def _renamed(old: str, old_value: Any, new: str, new_value: Any) -> Any:
    """The value of keyword ``new``, or of its deprecated spelling ``old`` (with a warning naming ``new``)."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"export_safetensors: pass {new}= alone ({old}= is its deprecated spelling)")
    warnings.warn(f"export_safetensors({old}=) is deprecated: pass {new}=", DeprecationWarning, stacklevel=3)
    return old_value


async def _clear_or_refuse(out: Any, first: list[str], overwrite: bool) -> None:
    """Before a part's first write: with ``overwrite``, delete the destination's index and single
    file, an export's entry points, so that no reader takes old and new files for one export until
    the new one's last file lands; without it, refuse a destination holding either of them or the
    part's ``first`` file."""
    if overwrite:
        for key in (INDEX_FILE, SINGLE_FILE):
            await out.store.delete(key)
        return
    for key in dict.fromkeys([INDEX_FILE, SINGLE_FILE, *first]):
        try:
            await out.store.head(key)
        except (ObjectNotFoundError, FileNotFoundError):
            continue
        raise ObjectExistsError(
            f"{out.url}/{key} exists: the destination holds an export (pass overwrite=True to replace it)"
        )


async def _remove_stale(out: Any, files: list[str]) -> None:
    """Delete the shard files at the destination that the export just written does not name
    (an earlier export's, or a cut-off one's): none of them can pass for part of it."""
    for info in await out.store.list("model-"):
        if info.key not in files and _SHARD_FILE.fullmatch(info.key):
            await out.store.delete(info.key)


def _read_shard(
    url: str, shard: list[ExportTensor], storage_options: dict[str, Any] | None, options: Options, stats: TransferStats
) -> list[np.ndarray]:
    """One file's leaves as C-contiguous host arrays in the written dtype, read with ranged reads."""
    values = restore(
        url,
        _Selection(tuple(t.path for t in shard)),
        partial=True,
        storage_options=storage_options,
        options=options,
        stats=stats,
    ).values
    out = []
    for t, value in zip(shard, values, strict=True):
        array = _c_order(np.asarray(value))
        want = numpy_dtype(t.dtype)
        if array.dtype != want:
            array = _c_order(cast_values(t.path, array, want, unsafe=False))
        if tuple(array.shape) != t.shape:  # pragma: no cover  (restore returns the saved shape)
            raise FormatError(f"leaf {t.path}: read shape {array.shape}, manifest shape {t.shape}")
        out.append(array)
    return out


def _c_order(array: np.ndarray) -> np.ndarray:
    """``array`` in C order, its shape kept (``np.ascontiguousarray`` makes a 0-d array 1-d)."""
    return array if array.flags.c_contiguous else array.copy(order="C")


def _bytes_of(array: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, without a copy."""
    return memoryview(array.reshape(-1).view(np.uint8).data)


class _PathKey:
    """A pytree key whose string is a whole saved leaf path, so a target names leaves of any tree."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"_PathKey({self.path!r})"


class _Selection:
    """A restore target naming saved leaves by path (``None``: host numpy), whatever their containers."""

    def __init__(self, paths: tuple[str, ...], values: tuple[Any, ...] | None = None) -> None:
        self.paths = paths
        self.values = values if values is not None else (None,) * len(paths)


jax.tree_util.register_pytree_with_keys(
    _Selection,
    lambda s: ([(_PathKey(p), v) for p, v in zip(s.paths, s.values, strict=True)], s.paths),
    lambda paths, values: _Selection(paths, tuple(values)),
)
