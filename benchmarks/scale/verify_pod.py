"""A full ``verify(read_data=False)`` of bench_scale's 405B save (≈ 45k objects), with no data.

The save is planned host by host with the library's own functions (:class:`Saver`): every
process's index object is built, and the root manifest. They are served by :class:`PodStore`,
an in-process store that holds those objects' bytes and, for each blob, only its size and
the CRC-32C its save sent (the pieces' CRCs combined, as ``saving.upload`` combines them).
Every request it answers waits ``rtt`` seconds on the event loop (a store at that round
trip, serving as many requests at once as the client keeps in flight); a listing answers
1,000 objects a page, one page after another. The verify is objckpt's own, from the URL
on: root manifest, every index object, whole tiling, the expected CRC-32C of every blob,
one LIST and (S3) one HEAD per blob under the transfer engine's window.

What it does not cost: a real client's per-request CPU (botocore's HEAD, signing, TLS);
``bench_verify``'s store part measures that on the local S3 and adds it.
"""

from __future__ import annotations

import asyncio
import builtins
import time
from typing import Any

from benchmarks.scale.save import Saver
from objckpt.core.checksum import blob_crc32c
from objckpt.core.format.index import index_key
from objckpt.storage.base import ObjectInfo, PutMode, Store
from objckpt.storage.checksums import StoredChecksum

#: Objects per listing page (both clouds).
PAGE = 1000


class PodStore(Store):
    """Metadata objects as bytes, blobs as (size, crc32c) only; every request waits ``rtt``."""

    keeps_checksums = True

    def __init__(
        self, url: str, objects: dict[str, bytes], blobs: dict[str, tuple[int, int]], *, rtt: float, lists: bool
    ) -> None:
        self.url = url
        self.objects, self.blobs, self.rtt = objects, blobs, rtt
        self.lists_checksums = lists  # GCS: the listing carries each crc32c; S3: one HEAD per blob
        self.counts = {"get": 0, "list_pages": 0, "head": 0}

    async def _wait(self, kind: str, n: int = 1) -> None:
        self.counts[kind] += n
        await asyncio.sleep(self.rtt)

    async def get_range(self, key: str, *, start: int, end: int) -> bytes:
        await self._wait("get")
        if key not in self.objects:
            from objckpt.errors import ObjectNotFoundError

            raise ObjectNotFoundError(f"get {self.url}/{key}: no such object")
        return self.objects[key][start:end]

    async def get(self, key: str) -> bytes:
        return await self.get_range(key, start=0, end=1 << 40)

    async def head(self, key: str) -> ObjectInfo:
        await self._wait("head")
        data = self.objects.get(key)
        return ObjectInfo(key, len(data) if data is not None else self.blobs[key][0])

    async def list_checksums(self, prefix: str = "") -> builtins.list[StoredChecksum]:
        out = [StoredChecksum(k, len(v), None) for k, v in self.objects.items()]
        out += [StoredChecksum(k, s, c if self.lists_checksums else None) for k, (s, c) in self.blobs.items()]
        for _ in range(0, len(out), PAGE):  # pages come one after another
            await self._wait("list_pages")
        return out

    async def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        return [ObjectInfo(c.key, c.size) for c in await self.list_checksums(prefix)]

    async def head_checksum(self, key: str) -> StoredChecksum:
        await self._wait("head")
        size, crc = self.blobs[key]
        return StoredChecksum(key, size, crc)

    async def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        raise NotImplementedError("read-only")

    async def delete(self, key: str) -> None:
        raise NotImplementedError("read-only")

    def child(self, subpath: str) -> Store:
        raise NotImplementedError("no children")


def build_save(
    leaves: list[Any], skeleton: Any, processes: int
) -> tuple[dict[str, bytes], dict[str, tuple[int, int]], dict[str, Any]]:
    """Every process's index object and the root manifest (planned with :class:`Saver`), and each
    blob's size and CRC-32C as its upload sends it; with the save's figures."""
    from objckpt.core.checksum import crc32c
    from objckpt.core.format import MANIFEST_KEY, manifest_to_json
    from objckpt.core.format.index3_frames import parse_index3

    saver = Saver(leaves, processes)
    started = time.perf_counter()
    for p in range(processes):
        saver.plan(p)
    plan_wall = time.perf_counter() - started
    reports = {p: saver.report_of(p) for p in range(processes)}
    root = manifest_to_json(saver.manifest(skeleton, reports))
    crc32c(root)
    provisional = saver.manifest(skeleton, reports)
    objects = {MANIFEST_KEY: root}
    blobs: dict[str, tuple[int, int]] = {}
    for p, plan in saver.plans.items():
        objects[index_key(saver_id(), p)] = plan["index"]
        doc = parse_index3(plan["index"], provisional, p)
        per_blob: dict[str, list[tuple[int, int, int]]] = {}
        for piece in (q for pieces in doc.pieces.values() for q in pieces):
            per_blob.setdefault(piece.blob, []).append((piece.offset, piece.length, piece.crc32c))
        for key, size in doc.blobs.items():
            blobs[key] = (size, blob_crc32c(per_blob.get(key, []), size))
    figures = {
        "processes": processes,
        "pieces": sum(plan["pieces"] for plan in saver.plans.values()),
        "blobs": len(blobs),
        "index_objects": processes,
        "index_bytes": sum(len(plan["index"]) for plan in saver.plans.values()),
        "root_bytes": len(root),
        "plan_wall_s": plan_wall,
    }
    return objects, blobs, figures


def saver_id() -> str:
    from benchmarks.scale.save import SAVE_ID

    return SAVE_ID


def one_process(leaves: list[Any], skeleton: Any, processes: int, host: int = 1) -> dict[str, Any]:
    """A layout too large to build every index object here (unstacked: 14k pieces a process):
    the CPU a ``--no-read`` verify spends on one process's index object (parse, and the expected
    CRC-32C of each of its blobs), times ``processes``; requests as in the stacked layout."""
    from objckpt.core.format import BlobEntry
    from objckpt.core.format.index3_frames import parse_index3
    from objckpt.tools.verify_stored import expected_crc32c

    saver = Saver(leaves, processes)
    plan = saver.plan(host)
    saver.plan(0)
    manifest = saver.manifest(skeleton, {p: saver.report_of(p) for p in range(processes)})
    started = time.process_time()
    doc = parse_index3(plan["index"], manifest, host)
    parse = time.process_time() - started
    per_blob: dict[str, list[Any]] = {}
    for leaf, pieces in doc.pieces.items():
        for piece in pieces:
            per_blob.setdefault(piece.blob, []).append((str(leaf), piece))
    started = time.process_time()
    for key, size in doc.blobs.items():
        expected_crc32c(BlobEntry(key, size), per_blob.get(key, []))
    combine = time.process_time() - started
    return {
        "processes": processes,
        "pieces_per_process": sum(len(v) for v in doc.pieces.values()),
        "blobs_per_process": len(doc.blobs),
        "index_bytes_per_process": len(plan["index"]),
        "parse_cpu_s_per_process": parse,
        "combine_cpu_s_per_process": combine,
        "parse_cpu_s": parse * processes,
        "combine_cpu_s": combine * processes,
        "extrapolated": True,
    }
