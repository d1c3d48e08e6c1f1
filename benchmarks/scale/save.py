"""The save side at pod scale: one save of the state, planned host by host on demand with the
library's own functions (grid pieces, blob packing, index object, the report to the primary),
and the root manifest the primary's commit builds from every report."""

from __future__ import annotations

import json
import math
import time
import zlib
from dataclasses import replace
from typing import Any

from benchmarks.scale.state import DEVICES_PER_HOST

SAVE_ID = "5ca1e" * 6 + "40"  # 32 hex digits, like uuid4().hex


class Saver:
    """One save of ``leaves`` (objckpt.core.tree.Leaf of ShapeDtypeStructs), planned host by host on demand."""

    def __init__(self, leaves: list[Any], processes: int, repeats: int = 1) -> None:
        from objckpt.options import Options

        self.leaves = leaves
        self.processes = processes
        self.options = Options()
        self.repeats = repeats  # timed plans of hosts 0 and 1: the least CPU time of this many
        self._indices: dict[tuple[Any, tuple[int, ...]], dict[int, tuple[Any, ...]]] = {}
        self.plans: dict[int, dict[str, Any]] = {}  # by process, once planned
        self.entries: list[Any] = []
        self.meshes: list[Any] = []

    def _device_indices(self, sds: Any) -> dict[int, tuple[Any, ...]]:
        key = (sds.sharding, tuple(sds.shape))
        found = self._indices.get(key)
        if found is None:
            found = self._indices[key] = {
                d.id: index for d, index in sds.sharding.devices_indices_map(sds.shape).items()
            }
        return found

    def shards(self, host: int) -> list[list[tuple[int, tuple[Any, ...], None]]]:
        """Per leaf, host ``host``'s shards as :func:`objckpt.core.boxes.local_shards` gives them (no data)."""
        ids = range(DEVICES_PER_HOST * host, DEVICES_PER_HOST * (host + 1))
        out = []
        for leaf in self.leaves:
            indices = self._device_indices(leaf.value)
            out.append([(d, indices[d], None) for d in ids if d in indices])
        return out

    def plan(self, host: int) -> dict[str, Any]:
        """Host ``host``'s save: classify and grid pieces for every leaf, then pack blobs (timed;
        hosts 0 and 1: the least of ``repeats`` runs); its index object (encode timed) and the
        report it sends the primary."""
        found = self.plans.get(host)
        if found is not None:
            return found
        from objckpt.core.boxes import MeshTable, describe_sharding, grid_of, grid_pieces
        from objckpt.core.checksum import crc32c
        from objckpt.core.dtypes import dtype_name
        from objckpt.core.format import LeafEntry
        from objckpt.core.format.index import index_key
        from objckpt.core.format.index3_encode import index3_encode, item_breaks
        from objckpt.core.pieces import Piece
        from objckpt.core.plan import blob_key, packing_order, plan_blobs
        from objckpt.saving.blob_sizing import save_blob_size, split_pieces

        shards = self.shards(host)  # outside the timed region: a real host reads them off its arrays
        slab_bytes = self.options.split_replicas_above
        plan_cpu = math.inf
        for _ in range(self.repeats if host <= 1 else 1):
            started = time.process_time()
            meshes = MeshTable(process_of=lambda d: d.id // DEVICES_PER_HOST)
            entries, owned = [], []
            for i, leaf in enumerate(self.leaves):  # as objckpt.saving.classify does for a jax.Array
                sds = leaf.value
                entry = LeafEntry(
                    leaf.path,
                    "array",
                    dtype_name(sds.dtype),
                    tuple(sds.shape),
                    sharding=describe_sharding(sds.sharding),
                )
                grid = grid_of(i, sds, meshes, slab_bytes=slab_bytes)
                assert grid is not None, f"{leaf.path}: not a grid"
                entries.append(replace(entry, writers=grid[1]))
                owned.extend(grid_pieces(i, grid[0], shards[i]))
            owned.sort(key=packing_order)  # as saving.api does (a synchronous save's blob size)
            owned = split_pieces(owned, max_bytes=self.options.blob_size)
            host_bytes = sum(p.nbytes for p in owned)
            blob_size = save_blob_size(self.options, host_bytes, processes=self.processes, hold_uploads=False)
            blobs = plan_blobs(owned, blob_size=blob_size, key=lambda seq: blob_key(SAVE_ID, host, seq))
            plan_cpu = min(plan_cpu, time.process_time() - started)

        # The records its uploads return. A crc32c stands in for each piece's (same digits as a real one).
        records = [
            (
                placed.piece.leaf,
                Piece(
                    placed.piece.start,
                    placed.piece.stop,
                    blob.key,
                    placed.offset,
                    placed.piece.nbytes,
                    zlib.crc32(f"{blob.key}@{placed.offset}".encode()),
                ),
            )
            for blob in blobs
            for placed in blob.pieces
        ]
        sizes: dict[str, int] = {}  # as saving.commit._blob_sizes: where each blob's last piece ends
        for _, p in records:
            sizes[p.blob] = max(sizes.get(p.blob, 0), p.offset + p.length)
        started = time.process_time()
        breaks = item_breaks([leaf.path for leaf in self.leaves])  # as saving.commit does
        encoded = index3_encode(SAVE_ID, host, records, sizes, breaks=breaks)  # format version 3: a head, then frames
        index = encoded.data
        encode_cpu = time.process_time() - started
        report = {  # as saving.commit.Commit._write_index returns it, sent as json.dumps(...).encode()
            "key": index_key(SAVE_ID, host),
            "size": len(index),
            "crc32c": crc32c(index[: encoded.head]),
            "blobs": len(sizes),
            "blob_bytes": sum(sizes.values()),
            "head": encoded.head,
        }
        found = self.plans[host] = {
            "plan_cpu_s": plan_cpu,
            "pieces": len(records),  # as stored: large boxes split to fit blobs
            "blobs": len(blobs),
            "blob_bytes": sum(b.size for b in blobs),
            "index": index,
            "index_encode_cpu_s": encode_cpu,
            "report": json.dumps(report).encode(),
        }
        if not self.entries:
            self.entries, self.meshes = entries, list(meshes.meshes)
        return found

    def report_of(self, process: int) -> bytes:
        """The report ``process`` sends: its own when planned, else host 1's under its key (the same size)."""
        from objckpt.core.format.index import index_key

        found = self.plans.get(process)
        if found is not None:
            return found["report"]
        doc = json.loads(self.plans[min(1, self.processes - 1)]["report"])
        doc["key"] = index_key(SAVE_ID, process)
        return json.dumps(doc).encode()

    def manifest(self, skeleton: dict[str, Any], reports: dict[int, bytes] | None) -> Any:
        """The root manifest as ``Commit._commit_or_abort`` builds it (``reports`` None: placeholders,
        enough for ``writers_of``, which reads only the leaves' layouts)."""
        from objckpt.core.format import FORMAT_VERSION, IndexRef, Manifest

        if reports is None:
            refs = [IndexRef(f"p{p}", 0, 0) for p in range(self.processes)]
        else:
            docs = {p: json.loads(reports[p]) for p in range(self.processes)}
            errors = [p for p, d in docs.items() if "error" in d]
            assert not errors
            refs = [
                IndexRef(d["key"], d["size"], d["crc32c"], d["blobs"], d["blob_bytes"], None, d["head"])
                for _, d in sorted(docs.items())
            ]
        return Manifest(
            save_id=SAVE_ID,
            created="2026-01-01T00:00:00.000+00:00",
            tree=skeleton,
            leaves=tuple(self.entries),
            blobs=(),
            num_processes=self.processes,
            metadata={},
            version=FORMAT_VERSION,
            meshes=tuple(self.meshes),
            indexes=tuple(refs),
            slab_bytes=self.options.split_replicas_above,
            shared_save_id=True,
        )
