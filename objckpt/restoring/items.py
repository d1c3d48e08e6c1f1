"""The last step of a restore for items: each process's ``PerProcess`` value, and stateful objects loaded.

Arrays come from the read plan and ``Json`` documents from the root itself
(:func:`objckpt.restoring.selection.inline_value`); a ``per_process`` leaf's
values lie in the blobs of the processes that saved them, where the root's leaf
entry says. This process reads its own value (the one saved by the process of its
index), or every process's for a ``PerProcess(all=True)`` target: one ranged GET
each, checked against its length and crc32c (a mismatch is read again, as pieces are:
``RetryConfig.checksum_reads``). Then a target item holding a
:class:`objckpt.Stateful` object gets ``load_state_dict`` with what was saved.
"""

from __future__ import annotations

import asyncio
from typing import Any

import jax

from objckpt.core.checksum import crc32c, sha256_hex
from objckpt.core.format import Manifest
from objckpt.core.items import PerProcess, decode_value, is_item, load_into
from objckpt.errors import (
    ChecksumMismatchError,
    FormatError,
    ObjectNotFoundError,
    PartialCopyError,
    TargetMismatchError,
)
from objckpt.transfer import runtime
from objckpt.transfer.handle import Handle


def finish_items(
    handle: Handle, manifest: Manifest, selection: dict[int, Any], values: dict[int, Any]
) -> dict[int, Any]:
    """``values`` (by leaf) with every ``per_process`` leaf read and every stateful target loaded.

    Raises:
        TargetMismatchError: a ``per_process`` leaf saved by another number of processes,
            restored without ``PerProcess(all=True)``.
        FormatError: a value's bytes are not where the root says (outside its blob) or not
            valid for their encoding.
        ChecksumMismatchError: a value's bytes do not match its crc32c.
    """
    wanted: dict[int, list[int]] = {}  # leaf: the processes whose values it needs
    for i, target in selection.items():
        entry = manifest.leaves[i]
        if entry.kind != "per_process":
            continue
        if type(target) is PerProcess and target.all:
            wanted[i] = list(range(manifest.num_processes))
            continue
        count, me = jax.process_count(), jax.process_index()
        if count != manifest.num_processes:
            raise TargetMismatchError(
                f"leaf {entry.path}: a PerProcess item saved by {manifest.num_processes} processes, restored on"
                f" {count}; ask for every process's value with objckpt.PerProcess(all=True) and re-split it"
            )
        wanted[i] = [me]
    out = dict(values)
    if wanted:
        read = runtime.run_sync(_read_values(handle, manifest, wanted))
        for i, processes in wanted.items():
            target = selection[i]
            got = [read[(i, p)] for p in processes]
            out[i] = got if type(target) is PerProcess and target.all else got[0]
    for i, target in selection.items():
        if is_item(target):
            out[i] = load_into(target, out[i])
    return out


async def _read_values(handle: Handle, manifest: Manifest, wanted: dict[int, list[int]]) -> dict[tuple[int, int], Any]:
    """Each wanted (leaf, process) value, read in parallel and decoded."""
    pairs = [(i, p) for i, processes in wanted.items() for p in processes]
    values = await asyncio.gather(*(_read_one(handle, manifest, i, p) for i, p in pairs))
    return dict(zip(pairs, values))


async def _read_one(handle: Handle, manifest: Manifest, leaf: int, process: int) -> Any:
    entry = manifest.leaves[leaf]
    ref = entry.value[process]
    if ref is None:  # a copy of one process's part (objckpt.layouts.process_copy) holds only its own value
        raise PartialCopyError(f"leaf {entry.path}: process {process}'s value is not in {handle.url}")
    length = ref["length"]
    data = b""
    where = f"leaf {entry.path}: process {process}'s value"
    reads = handle.options.retry.checksum_reads
    for attempt in range(reads if length else 0):  # a mismatch is read again: a bit flipped in flight
        blob, start = ref["blob"], ref["offset"]
        try:
            got = await handle.engine.get_range(blob, start, start + length)
        except ObjectNotFoundError as e:
            raise ObjectNotFoundError(f"{where}: blob {handle.url}/{blob} is missing ({e})") from e
        data = bytes(got)
        if len(data) != length:
            raise FormatError(
                f"{where} lies outside blob {handle.url}/{blob}: [{start}, {start + length}) gave {len(data)} bytes"
            )
        wrong = "crc32c" if crc32c(data) != ref["crc32c"] else None
        if wrong is None and "sha256" in ref and sha256_hex(data) != ref["sha256"]:
            wrong = "sha256"
        if wrong is None:
            break
        if attempt + 1 == reads:
            raise ChecksumMismatchError(
                f"{where}: blob {handle.url}/{blob} bytes [{start}, {start + length}) do not match their {wrong}"
                f" (persisted over {reads} reads)"
            )
        handle.stats.add(checksum_retries=1)
    try:
        return decode_value(data, ref["encoding"])
    except ValueError as e:
        raise FormatError(f"{where} is not valid {ref['encoding']}: {e}") from None
