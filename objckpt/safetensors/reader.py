"""Safetensors as a layout: what :func:`objckpt.layouts.registry.open_checkpoint` opens.

The registry names :func:`open_safetensors` by dotted path and calls it on a
prefix with no objckpt manifest (after Orbax's opener): a URL naming a
``.safetensors`` object, or a directory holding ``model.safetensors.index.json``
or ``model.safetensors`` (:mod:`objckpt.safetensors.files`). Its
:class:`SafetensorsReader` describes the tensors (``inspect``), reads every
byte of every file with their headers checked again (``verify``: safetensors
holds no checksums) and restores onto any target (:mod:`objckpt.safetensors.restore`).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

from objckpt.errors import CheckpointNotFoundError, FormatError, ObjectNotFoundError
from objckpt.layouts.base import CheckpointInfo, LeafInfo, OpenRequest, VerifyProblem, VerifyReport
from objckpt.options import Options
from objckpt.progress import ProgressArg, reporting
from objckpt.safetensors.files import Tensors, find_files, read_header, read_tensors, split_file_url
from objckpt.safetensors.header import parse_header
from objckpt.safetensors.shards import INDEX_FILE, SINGLE_FILE, nested
from objckpt.transfer import runtime
from objckpt.transfer.engine import TransferEngine
from objckpt.transfer.handle import bulk_of
from objckpt.transfer.retries import opened_store
from objckpt.transfer.stats import TransferStats

#: The layout's name, as its readers report it.
FORMAT = "safetensors"
#: Bytes per read when ``verify`` reads a file whole.
VERIFY_CHUNK = 16 * 2**20


class SafetensorsReader:
    """The safetensors files of one URL, their headers read and checked.

    The files are read from the store the registry opened, or, for a URL naming
    one file, from a store of its directory opened for each operation.
    """

    format = FORMAT
    version = 0  # safetensors files carry no format version

    def __init__(
        self,
        url: str,
        tensors: Tensors,
        *,
        store: Any,
        directory: str | None,
        storage_options: dict[str, Any] | None,
        options: Options,
    ) -> None:
        self._url = url
        self.tensors = tensors
        self._store = store
        self._directory = directory
        self.storage_options = storage_options
        self.options = options

    @property
    def url(self) -> str:
        """The URL as the caller named it (a directory or one file)."""
        return self._url

    @contextlib.contextmanager
    def _files_store(self, options: Options, stats: TransferStats | None = None) -> Iterator[Any]:
        if self._directory is None:
            yield bulk_of(self._store)
            return
        with opened_store(self._directory, self.storage_options, options, stats) as store:
            yield bulk_of(store)

    def info(self) -> CheckpointInfo:
        """Every tensor's name, dtype, shape and size, from the headers alone."""
        leaves = {
            name: LeafInfo(name, "array", entry.shape, entry.dtype, entry.nbytes)
            for name, entry in self.tensors.by_name.items()
        }
        metadata: dict[str, Any] = {}
        for header in self.tensors.files.values():
            metadata.update(header.metadata)
        return CheckpointInfo(
            url=self.url,
            tree=nested(leaves),
            leaves=leaves,
            total_bytes=sum(leaf.nbytes for leaf in leaves.values()),
            num_blobs=len(self.tensors.files),
            format_version=0,
            created="unknown",
            save_id="",
            num_processes=1,
            metadata=metadata,
            format=FORMAT,
        )

    def restore(
        self,
        target: Any,
        *,
        partial: bool,
        options: Options,
        stats: TransferStats,
        cast: str,
        names: Mapping[str, str] | None = None,
    ) -> Any:
        """The tensors as a tree (nested by ``.``), or the ``target``'s part of them."""
        from objckpt.safetensors.restore import restore_tensors  # JAX loads when arrays are read

        with self._files_store(options, stats) as store:
            return restore_tensors(
                store,
                self.tensors,
                self.url,
                target,
                partial=partial,
                options=options,
                stats=stats,
                cast=cast,
                names=names,
            )

    def verify(self, options: Options, stats: TransferStats, progress: ProgressArg) -> VerifyReport:
        """Every file's header read again and compared with the one checked at open (by its
        SHA-256; one that differs is checked again), its size compared, every byte read."""
        started = time.perf_counter()
        report = VerifyReport(url=self.url, format=FORMAT, checks="headers held to the spec, every byte read")
        total = sum(self.tensors.sizes.values())
        with self._files_store(options, stats) as store:
            with reporting(progress, "verify", self.url, total, lambda: stats.bytes_read, stats):
                report.problems = runtime.run_sync(_verify_files(store, self.tensors, options, stats))
        report.arrays = len(self.tensors.by_name)
        report.bytes_read, report.requests, report.retries = stats.bytes_read, stats.requests, stats.retries
        report.seconds = time.perf_counter() - started
        return report


async def _verify_files(store: Any, tensors: Tensors, options: Options, stats: TransferStats) -> list[VerifyProblem]:
    engine = TransferEngine.from_options(store, options, stats)
    problems: list[VerifyProblem] = []
    chunks: list[tuple[str, int, int]] = []
    for key, size in tensors.sizes.items():
        where = f"{store.url}/{key}"
        try:
            raw, now = await read_header(store, key, where=where)
            if now != size or hashlib.sha256(raw).digest() != tensors.digests[key]:
                parse_header(raw, where=where, file_size=now)  # off the spec: unreadable; else changed
                problems.append(
                    VerifyProblem("size", key, f"{where} changed since it was opened ({size} → {now} bytes)")
                )
                continue
        except (FormatError, ObjectNotFoundError, FileNotFoundError) as e:
            problems.append(VerifyProblem("missing" if isinstance(e, FileNotFoundError) else "unreadable", key, str(e)))
            continue
        chunks.extend((key, lo, min(size, lo + VERIFY_CHUNK)) for lo in range(0, size, VERIFY_CHUNK))

    async def one(item: tuple[str, int, int]) -> None:
        key, lo, hi = item
        data = await engine.get_range(key, lo, hi)
        if len(data) != hi - lo:
            problems.append(VerifyProblem("short", key, f"{store.url}/{key}: [{lo}, {hi}) read {len(data)} bytes"))

    await engine.for_each(chunks, one, window_bytes=max(VERIFY_CHUNK, options.read_window), size=lambda c: c[2] - c[1])
    return sorted(problems, key=lambda p: (p.blob, p.message))


def open_safetensors(store: Any, request: OpenRequest) -> SafetensorsReader | None:
    """The reader of the safetensors file or directory at ``store``, or None when it holds none.

    Raises:
        FormatError: an index or header is there and off the spec (named).
    """
    split = split_file_url(request.url)
    if split is not None:
        directory, name = split
        with opened_store(directory, request.storage_options, request.options) as parent:
            try:
                tensors = runtime.run_sync(read_tensors(parent, [name]))
            except (ObjectNotFoundError, FileNotFoundError):
                return None
        return SafetensorsReader(
            request.url,
            tensors,
            store=None,
            directory=directory,
            storage_options=request.storage_options,
            options=request.options,
        )
    found = runtime.run_sync(find_files(store))
    if found is None:
        return None
    tensors = runtime.run_sync(read_tensors(store, found))
    return SafetensorsReader(
        request.url,
        tensors,
        store=store,
        directory=None,
        storage_options=request.storage_options,
        options=request.options,
    )


def restore_safetensors(
    url: str,
    target: Any = None,
    *,
    names: Mapping[str, str] | None = None,
    storage_options: dict[str, Any] | None = None,
    partial: bool = False,
    options: Options | None = None,
    stats: TransferStats | None = None,
    cast: str = "checked",
) -> Any:
    """:func:`objckpt.restore` of a safetensors file or directory, with tensor names mapped.

    Args:
        url: a ``.safetensors`` object, or a directory holding ``model.safetensors.index.json``
            or ``model.safetensors``.
        target: as for :func:`objckpt.restore`; its leaves answer to the tensors named by
            their keys joined with ``.``, or by ``names``.
        names: a target leaf's ``.``-joined name → the tensor's name in the files, for the
            names that differ (a model family's conventions).
        storage_options, partial, options, stats, cast: as for :func:`objckpt.restore`.

    Raises:
        CheckpointNotFoundError: no safetensors file or index at ``url``.
        FormatError: an index or header off the spec.
        TargetMismatchError: as for :func:`objckpt.restore`.
    """
    options = options or Options()
    stats = stats if stats is not None else TransferStats()
    with opened_store(url, storage_options, options, stats) as store:
        reader = open_safetensors(store, OpenRequest(url, storage_options, options))
        if reader is None:
            raise CheckpointNotFoundError(f"no safetensors file, {INDEX_FILE} or {SINGLE_FILE} at {url}")
        return reader.restore(target, partial=partial, options=options, stats=stats, cast=cast, names=names)
