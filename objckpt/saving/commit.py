"""The background half of a save: wait for the uploads, write this process's index, commit.

Format version 2: every process checks that its blobs are there at their sizes,
writes its own index object (its pieces) to the store, and sends the coordinator
one small report (the index object's key, size and crc32c, or its error). After a
barrier the primary reads those reports, writes the root ``manifest.json`` with
create-if-absent, and publishes the outcome; each process releases the save's
coordinator keys once it has read it, the last one deleting them. Nothing a
process sends or reads grows with the size of the job but the primary's
O(processes) list of reports. A process's ``PerProcess`` values ride in its report
(where each lies in its blobs: a few dozen bytes each), and the primary lists them in
the root's leaf table, in process order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from objckpt.core.checksum import crc32c, sha256_hex
from objckpt.core.codecs import CODEC
from objckpt.core.format import (
    IndexRef,
    LeafEntry,
    Manifest,
)
from objckpt.core.format.index import index_key, index_to_json
from objckpt.core.format.index3_encode import index3_encode, item_breaks
from objckpt.core.writer_rule import Mesh
from objckpt.errors import (
    CheckpointExistsError,
    CoordinationError,
    IntegrityError,
    ObjectNotFoundError,
    StoreError,
)
from objckpt.layouts.manifest_io import Unreadable, commit_manifest
from objckpt.multihost import Coordinator
from objckpt.saving.live_markers import LiveMarker, MarkerGroup
from objckpt.saving.upload import PieceRecord
from objckpt.transfer.handle import Handle

log = logging.getLogger("objckpt")
#: The bytes of a commit report that the ``PerProcess`` values' locations may take (about 130
#: each: some 20 items), so a report stays within the coordinator's 4 KiB per process.
_ITEMS_REPORT_MAX = 3072


@dataclass(frozen=True)
class Save:
    """One save being written (:func:`objckpt.saving.writer.write`): where, by which process,
    under which id and coordination tag, and the live-save marker that keeps deleters off it."""

    handle: Handle
    coordinator: Coordinator
    tag: str
    save_id: str
    marker: LiveMarker | MarkerGroup
    #: an incremental save's rows that reference a base (:mod:`objckpt.saving.incremental`), the
    #: blobs they name (reference key -> size) and the bases a reference may lead to
    refs: tuple[PieceRecord, ...] = ()
    ref_blobs: dict[str, int] = field(default_factory=dict)
    bases: tuple[tuple[str, str], ...] = ()


class Commit:
    """The background half of a save: wait for uploads, write this process's index, commit."""

    def __init__(
        self,
        save: Save,
        *,
        skeleton: dict[str, Any],
        entries: list[LeafEntry],
        meshes: tuple[Mesh, ...],
        metadata: dict[str, Any],
        coded: frozenset[int] = frozenset(),
        check: Callable[[list[PieceRecord]], None] | None = None,
        reports: dict[int, bytes] | None = None,
        processes: int = 0,
    ) -> None:
        self.store = save.handle.store
        self.check = check  # the source's last word on its records (raising stops the commit)
        self.reports = reports or {}  # the commit reports of processes this one wrote for
        self.process_count = processes or save.coordinator.process_count
        self.coded = coded  # the leaves whose pieces are compressed (Options.compression)
        self.engine = save.handle.engine
        self.options = save.handle.options
        self.coordinator = save.coordinator
        self.tag = save.tag
        self.save_id = save.save_id
        self.marker = save.marker
        self.skeleton = skeleton
        self.entries = entries
        self.meshes = meshes
        self.metadata = metadata
        self.index_key = index_key(save.save_id, save.coordinator.process_index)
        self.refs, self.ref_blobs, self.bases = save.refs, save.ref_blobs, save.bases

    async def run(self, uploads: list[concurrent.futures.Future[list[PieceRecord]]], started: float) -> None:
        """Wait for the uploads, commit or abort, then delete this process's live-save marker."""
        try:
            await self._run(uploads, started)
        finally:
            await self.marker.end()

    async def _run(self, uploads: list[concurrent.futures.Future[list[PieceRecord]]], started: float) -> None:
        local_error: BaseException | None = None
        records: list[PieceRecord] = []
        try:
            for result in await asyncio.gather(*(asyncio.wrap_future(f) for f in uploads)):
                records.extend(result)
            if self.marker.lapsed():
                raise StoreError(f"save to {self.store.url} was not committed: {self.marker.lapse_error()}")
            if self.check is not None:
                self.check(records)
            blobs = _blob_sizes(records)
            blobs.update(self.ref_blobs)  # HEADed too: a base's blob deleted meanwhile stops the commit
            await self._check_own_blobs(blobs)
            report = await self.index_report(records, process=self.coordinator.process_index, blobs=blobs)
            if self.ref_blobs:
                report["bases"] = sorted({k.split("/")[1] for k in self.ref_blobs})
        except BaseException as e:  # report to peers before raising, so nobody waits for us
            local_error = e
            report = _error_report(e)
        outcome = await self._agree(json.dumps(report).encode())
        if local_error is not None:
            raise local_error
        status = json.loads(outcome)
        if status["status"] == "exists":
            await self._delete_own_objects(records)
            raise CheckpointExistsError(f"a committed checkpoint already exists at {self.store.url}")
        if status["status"] != "committed":
            raise StoreError(f"save to {self.store.url} was not committed: {status['why']}")
        seconds = time.perf_counter() - started
        stats = self.engine.stats
        stats.seconds = seconds
        log.info(
            "objckpt saved %s: %d bytes in %d objects, %d requests, %d retries (%d throttled), %.2f s, %.3f GiB/s (this process)",
            self.store.url,
            stats.bytes_written,
            stats.objects_written,
            stats.requests,
            stats.retries,
            stats.throttled,
            seconds,
            stats.bytes_written / max(seconds, 1e-9) / 2**30,
        )

    async def report_failure(self, error: BaseException) -> None:
        """Report ``error``, this process's failure before its commit, and wait for the outcome."""
        await self._agree(json.dumps(_error_report(error)).encode())

    async def _agree(self, report: bytes) -> bytes:
        """Send this process's report, wait for all, commit on the primary; the outcome, as JSON.

        The coordinator carries one report of a few hundred bytes per process and
        the outcome; this process releases them once it has read the outcome (the
        last to do so deletes them), or, on a coordination failure, deletes them.
        """
        coordinator, tag, timeout = self.coordinator, self.tag, self.options.barrier_timeout
        try:
            await asyncio.to_thread(coordinator.publish, f"{tag}/report", report)
            await asyncio.to_thread(coordinator.barrier, f"{tag}/reported", timeout=timeout)
            outcome: bytes | None = None
            if coordinator.is_primary:
                reports = {**self.reports, **await asyncio.to_thread(coordinator.collect, f"{tag}/report")}
                outcome = await self._commit_or_abort(reports)
            outcome = await asyncio.to_thread(coordinator.broadcast, f"{tag}/outcome", outcome, timeout=timeout)
        except CoordinationError:
            await asyncio.to_thread(coordinator.forget, tag)
            raise
        await asyncio.to_thread(coordinator.release, tag)
        return outcome

    async def _check_own_blobs(self, blobs: dict[str, int]) -> None:
        """Is every blob this process wrote still there, at its size? (A HEAD each, in parallel.)

        The HEADs go through the engine, so they share the uploads' adaptive window
        (a throttling store is met at the pace it allowed them, not with a burst of
        ``max_concurrency`` HEADs) and count in this process's figures.

        Raises:
            ObjectNotFoundError: a blob is missing (deleted while the save ran); no manifest is written.
            IntegrityError: a blob has another size than was written.
        """

        async def size(key: str) -> int | None:
            try:
                info = await self.engine.head(key)
            except FileNotFoundError:
                return None
            return info.size

        sizes = await asyncio.gather(*(size(k) for k in blobs))
        missing = [k for k, got in zip(blobs, sizes) if got is None]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ObjectNotFoundError(
                f"save to {self.store.url} was not committed: blob {missing[0]}{more} is missing (deleted while"
                " the save ran, by gc, rm or retention?); no manifest was written"
            )
        for (key, want), got in zip(blobs.items(), sizes):
            if got != want:
                raise IntegrityError(
                    f"save to {self.store.url} was not committed: blob {key} is {got} bytes, {want} were"
                    " written; no manifest was written"
                )

    async def index_report(
        self, records: list[PieceRecord], *, process: int, blobs: dict[str, int] | None = None
    ) -> dict[str, Any]:
        """Write ``process``'s index object (its ``records`` and this save's references) and return
        its commit report, with its ``PerProcess`` values; ``blobs``: the blobs' sizes, by default
        from the records."""
        values, indexed = self._own_values(records)
        report = await self._write_index(
            [*indexed, *self.refs], _blob_sizes(records) if blobs is None else blobs, process
        )
        if values:
            report["items"] = values
        return report

    def _own_values(self, records: list[PieceRecord]) -> tuple[dict[str, dict[str, Any]], list[PieceRecord]]:
        """This process's ``per_process`` values (by leaf index, as the root lists them), and the
        records that go into its index object (all the others).

        A value is one piece of one of this process's blobs; the report carries where it lies,
        so the root, not the index object, says where each process's value is.
        """
        items = {i: e for i, e in enumerate(self.entries) if e.kind == "per_process"}
        if not items:
            return {}, records
        mine: dict[int, list[Any]] = {i: [] for i in items}
        indexed: list[PieceRecord] = []
        for record in records:
            (mine[record[0]] if record[0] in mine else indexed).append(record)
        values = {}
        for i, pieces in mine.items():
            local = items[i].value
            if len(pieces) > 1:
                raise ValueError(
                    f"leaf {items[i].path}: this process's value ({local['length']} bytes) is larger than"
                    " Options.blob_size and was cut into pieces; raise Options.blob_size or save it as an array"
                )
            ref: dict[str, Any] = {"encoding": local["encoding"], "length": local["length"], "crc32c": 0}
            if pieces:
                piece = pieces[0][1]
                ref.update(blob=piece.blob, offset=piece.offset, crc32c=piece.crc32c)
                if piece.sha256 is not None:  # Options.digest: the root pins these bytes too
                    ref["sha256"] = piece.sha256
            values[str(i)] = ref
        size = len(json.dumps(values))
        if size > _ITEMS_REPORT_MAX:
            raise ValueError(
                f"{len(values)} PerProcess items take {size} bytes of this process's commit report, over"
                f" {_ITEMS_REPORT_MAX} (a report stays within 4 KiB): put them in one PerProcess (a dict of them)"
            )
        return values, indexed

    def _with_values(self, docs: dict[int, dict[str, Any]]) -> list[LeafEntry]:
        """The leaf table with each ``per_process`` leaf's values from every process's report."""
        return [
            replace(e, value=tuple(docs[p]["items"][str(i)] for p in sorted(docs))) if e.kind == "per_process" else e
            for i, e in enumerate(self.entries)
        ]

    async def _write_index(self, records: list[PieceRecord], blobs: dict[str, int], process: int) -> dict[str, Any]:
        """Write ``process``'s index object; its key, size and crc32c (and SHA-256 with
        ``Options.digest``), to report."""
        digest = self.options.digest is not None
        head = 0  # version 3: the root pins the head (which pins each frame), not the whole object
        if self.options.format_version >= 3:
            breaks = item_breaks([e.path for e in self.entries])
            lengths = self.options.compression is not None  # version 4: rows with stored lengths
            encoded = index3_encode(
                self.save_id, process, records, blobs, digest=digest, breaks=breaks, lengths=lengths
            )
            data, head = encoded.data, encoded.head
        else:
            data = index_to_json(self.save_id, process, records, blobs, digest=digest)
        key = index_key(self.save_id, process)
        await self.engine.put(key, data, crc32c=crc32c(data))  # the store checks and keeps it
        pinned = data[:head] if head else data
        report: dict[str, Any] = {
            "key": key,
            "size": len(data),
            "crc32c": crc32c(pinned),
            "blobs": len(blobs),
            "blob_bytes": sum(blobs.values()),
        }
        if head:
            report["head"] = head
        if digest:
            report["sha256"] = sha256_hex(pinned)
        return report

    async def _commit_or_abort(self, reports: dict[int, bytes]) -> bytes:
        count = self.process_count
        silent = [p for p in range(count) if p not in reports]
        if silent:
            why = f"processes {', '.join(map(str, silent))} sent no report"
            return json.dumps({"status": "aborted", "why": why}).encode()
        docs = {p: json.loads(reports[p]) for p in range(count)}
        errors = [f"process {p}: {d['error']}" for p, d in docs.items() if "error" in d]
        if errors:
            return json.dumps({"status": "aborted", "why": "; ".join(errors)}).encode()
        if self.marker.lapsed():
            return json.dumps({"status": "aborted", "why": self.marker.lapse_error()}).encode()
        if len({"sha256" in d for d in docs.values()}) > 1:
            why = "the processes disagree on Options.digest (some index objects have digests, others not)"
            return json.dumps({"status": "aborted", "why": why}).encode()
        if len({"head" in d for d in docs.values()} | {self.options.format_version >= 3}) > 1:
            why = "the processes disagree on Options.format_version"
            return json.dumps({"status": "aborted", "why": why}).encode()
        used = {name for d in docs.values() for name in d.get("bases", ())}
        manifest = self._manifest(
            self._with_values(docs),
            [
                IndexRef(
                    d["key"], d["size"], d["crc32c"], d["blobs"], d["blob_bytes"], d.get("sha256"), d.get("head", 0)
                )
                for _, d in sorted(docs.items())
            ],
            bases=tuple(b for b in self.bases if b[0] in used),
        )
        try:
            limit = self.options.manifest_size_limit
            ours = await commit_manifest(self.engine, manifest, store=self.store, size_limit=limit)
        except Unreadable as e:
            return json.dumps({"status": "aborted", "why": str(e)}).encode()
        except BaseException as e:
            return json.dumps({"status": "aborted", "why": f"manifest write failed: {e}"}).encode()
        return json.dumps({"status": "committed" if ours else "exists"}).encode()

    def _manifest(
        self, entries: list[LeafEntry], indexes: list[IndexRef], bases: tuple[tuple[str, str], ...] = ()
    ) -> Manifest:
        version = self.options.format_version
        if self.options.compression is not None:  # version 4: every leaf with blob bytes is encoded
            version = 4
            entries = [replace(e, codec=CODEC) if i in self.coded else e for i, e in enumerate(entries)]
        return Manifest(
            save_id=self.save_id,
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
            tree=self.skeleton,
            leaves=tuple(entries),
            blobs=(),
            num_processes=self.process_count,
            metadata=self.metadata,
            version=version,
            meshes=self.meshes,
            indexes=tuple(indexes),
            slab_bytes=self.options.split_replicas_above,
            shared_save_id=True,
            bases=bases,
        )

    async def _delete_own_objects(self, records: list[PieceRecord]) -> None:
        """Best effort: the blobs and index of a save that lost the commit race are never referenced."""
        for key in [*{p.blob for _, p in records if p.blob not in self.ref_blobs}, self.index_key]:
            try:
                await self.store.delete(key)
            except Exception:  # gc removes whatever remains
                pass


def _blob_sizes(records: list[PieceRecord]) -> dict[str, int]:
    """Each blob's size, from where its last piece ends."""
    blobs: dict[str, int] = {}
    for _, p in records:
        blobs[p.blob] = max(blobs.get(p.blob, 0), p.offset + p.length)
    return blobs


def _error_report(error: BaseException) -> dict[str, str]:
    """A process's commit report of its failure: what the others' errors name it by."""
    return {"error": f"{type(error).__name__}: {error}"[:2000]}
