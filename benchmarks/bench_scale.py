"""objckpt's own planning and format code at pod scale, with no data (issue #40).

A Llama-3-405B-shaped training state (params bf16, fp32 master copy, Adam mu and
nu: ~5.7 TB) is "saved" from N forced CPU devices by N/4 hosts (host h owns
devices 4h..4h+3) and "restored" onto other meshes. Nothing is allocated: the
leaves are ``jax.ShapeDtypeStruct`` with a ``NamedSharding``, and every figure
comes from the library's own functions (grid layout, blob packing, index and
root encoding, strict parsing, restore planning), run for one host.

Save side (host 1; host 0, the primary, separately): plan CPU seconds, pieces,
blobs and bytes per PUT, its index object, the report it sends the primary, and
the primary's commit (decode every report, build and encode the root manifest).
Restore side, for one host of each target mesh: strict parse of the root, the
leaf plans, the index objects the layouts name (``restoring.indexes.read_needed_indexes``
on an in-memory store of the index objects), the read plan (``restoring.fetch.plan``), the
exact-coverage check; CPU seconds, metadata bytes read, extra peak memory
(tracemalloc, a second run), GETs per 16 MiB and read amplification. The plans
are made for the host's 4 devices with ``plan_leaf(..., devices=...)``, which
looks those devices up in JAX's global index map (cached per sharding and
shape, as the addressable map a real host asks for is), so the figure is what
a real host pays.

Only the index objects of the processes some restoring host reads are built
(by planning that process's save); the root lists every other process with
host 1's figures (they are the same size by symmetry: the output gives the
min and max of those built).

    python -m benchmarks.bench_scale [--devices 8,64,512,4096] [--layouts unstacked,stacked]
        [--out benchmarks/results/scale.json] [--layers 126] [--repeats 2]

Each device count runs in a child process of its own (``--child``): the number
of forced CPU devices is fixed when JAX starts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
import tracemalloc
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
DEVICES_PER_HOST = 4

# Llama-3-405B.
D_MODEL, FFN, VOCAB, LAYERS = 16384, 53248, 128256, 126
N_HEADS, N_KV_HEADS, HEAD_DIM = 128, 8, 128
COPIES = (("params", "bfloat16"), ("master", "float32"), ("mu", "float32"), ("nu", "float32"))
LAYOUTS = ("unstacked", "stacked")
TARGETS = ("same", "tensor16", "half")
SAVE_ID = "5ca1e" * 6 + "40"  # 32 hex digits, like uuid4().hex


def layer_matrices() -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Per layer: each weight's shape and MaxText-like partition spec (mesh axes 'fsdp', 'tensor')."""
    q, kv = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    return {
        "wq": ((D_MODEL, q), ("fsdp", "tensor")),
        "wk": ((D_MODEL, kv), ("fsdp", "tensor")),
        "wv": ((D_MODEL, kv), ("fsdp", "tensor")),
        "wo": ((q, D_MODEL), ("tensor", "fsdp")),
        "w1": ((D_MODEL, FFN), ("fsdp", "tensor")),
        "w3": ((D_MODEL, FFN), ("fsdp", "tensor")),
        "w2": ((FFN, D_MODEL), ("tensor", "fsdp")),
        "attn_norm": ((D_MODEL,), ()),
        "ffn_norm": ((D_MODEL,), ()),
    }


def model_tree(mesh: Any, dtype: Any, layout: str, layers: int) -> dict[str, Any]:
    """One copy of the model as ShapeDtypeStructs on ``mesh`` (no data)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def leaf(shape: tuple[int, ...], spec: tuple[str | None, ...]) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))

    matrices = layer_matrices()
    if layout == "unstacked":
        stack: Any = [{name: leaf(shape, spec) for name, (shape, spec) in matrices.items()} for _ in range(layers)]
    else:  # nn.scan: a leading layer axis, never sharded
        stack = {name: leaf((layers, *shape), (None, *spec)) for name, (shape, spec) in matrices.items()}
    return {
        "embed": leaf((VOCAB, D_MODEL), ("tensor", "fsdp")),
        "layers": stack,
        "final_norm": leaf((D_MODEL,), ()),
        "lm_head": leaf((D_MODEL, VOCAB), ("fsdp", "tensor")),
    }


def state_tree(mesh: Any, layout: str, layers: int) -> dict[str, Any]:
    import jax.numpy as jnp

    return {name: model_tree(mesh, getattr(jnp, dtype), layout, layers) for name, dtype in COPIES}


def retarget(tree: Any, mesh: Any) -> Any:
    """The same leaves with the same specs on another mesh."""
    import jax
    from jax.sharding import NamedSharding

    return jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, s.sharding.spec)), tree
    )


def make_mesh(fsdp: int, tensor: int) -> Any:
    """fsdp × tensor over the first fsdp·tensor devices: consecutive ids are consecutive tensor indices."""
    import jax
    import numpy as np

    devices = sorted(jax.devices(), key=lambda d: d.id)[: fsdp * tensor]
    return jax.sharding.Mesh(np.array(devices).reshape(fsdp, tensor), ("fsdp", "tensor"))


def target_shapes(n: int) -> dict[str, tuple[int, int] | None]:
    """(fsdp, tensor) of each target mesh at ``n`` devices; None where it does not fit."""
    return {
        "same": (max(1, n // 8), 8),
        "tensor16": (n // 16, 16) if n >= 16 else None,
        "half": (n // 16, 8) if n >= 16 else (1, 4),  # n/2 devices, n/8 hosts
    }


# ----------------------------------------------------------------------------- save side


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
        from objckpt.core.format.index import index_key, index_to_json
        from objckpt.core.pieces import Piece
        from objckpt.core.plan import blob_key, packing_order, plan_blobs

        shards = self.shards(host)  # outside the timed region: a real host reads them off its arrays
        slab_bytes, blob_size = self.options.split_replicas_above, self.options.blob_size
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
                entries.append(replace(entry, layout=grid[1]))
                owned.extend(grid_pieces(i, grid[0], shards[i]))
            owned.sort(key=packing_order)  # as saving.api does
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
        index = index_to_json(SAVE_ID, host, records, sizes)
        encode_cpu = time.process_time() - started
        report = {  # as saving.commit.Commit._write_index returns it, sent as json.dumps(...).encode()
            "key": index_key(SAVE_ID, host),
            "size": len(index),
            "crc32c": crc32c(index),
            "blobs": len(sizes),
            "blob_bytes": sum(sizes.values()),
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
                IndexRef(d["key"], d["size"], d["crc32c"], d["blobs"], d["blob_bytes"]) for _, d in sorted(docs.items())
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
        )


# ----------------------------------------------------------------------------- restore side


class IndexStore:
    """Just enough of a store for objckpt's own index reads: the index objects, from memory, counted."""

    url = "memory://bench-scale"

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.bytes_read = 0

    async def get_range(self, key: str, *, start: int, end: int) -> bytes:
        data = self.objects.get(key)
        if data is None:  # a process whose index object the benchmark did not build
            raise RuntimeError(f"bench_scale built no index object {key}")
        data = data[start:end]
        self.bytes_read += len(data)
        return data


def restore_plan(root: bytes, targets: list[Any], devices: frozenset[Any], store: IndexStore) -> dict[str, Any]:
    """One host's restore up to its reads, with ``objckpt.restoring.api``'s own steps: parse the
    root, plan the leaves, read the index objects the layouts name (``read_needed_indexes``: only
    the leaves it needs from each), plan the reads (``restoring.fetch.plan``), check coverage; the CPU seconds
    of each (of every thread: the index reads run on objckpt's I/O thread)."""
    from objckpt.core.format import parse_manifest
    from objckpt.layouts.native import NativeCheckpoint
    from objckpt.options import Options
    from objckpt.restoring.fetch import plan as _plan
    from objckpt.restoring.indexes import read_needed_indexes
    from objckpt.restoring.leaf_plan import plan_leaf

    options = Options()
    clock = [time.process_time()]
    phases: dict[str, float] = {}

    def lap(name: str) -> None:
        clock.append(time.process_time())
        phases[name] = clock[-1] - clock[-2]

    manifest = parse_manifest(root, size_limit=options.manifest_size_limit)
    lap("parse_root")
    plans = {i: plan_leaf(manifest.leaves[i], t, devices=devices) for i, t in enumerate(targets)}
    lap("make_jobs")
    checkpoint = NativeCheckpoint(store, manifest, size_limit=options.manifest_size_limit)
    manifest = read_needed_indexes(checkpoint, plans)
    plans = {i: p.with_entry(manifest.leaves[i]) for i, p in plans.items()}
    lap("indexes")
    requests = _plan(manifest, plans, options, streamed=True)
    lap("plan")
    gaps = {i: box for i, p in plans.items() if (box := p.uncovered()) is not None}
    lap("coverage")
    return {
        "processes": set(manifest.loaded),
        "requests": requests,
        "plans": plans,
        "gaps": gaps,
        "phases": phases,
        "cpu_s": clock[-1] - clock[0],
    }


def writers_needed(manifest: Any, targets: list[Any], devices: frozenset[Any]) -> set[int]:
    """The processes whose index objects a host of these devices reads (untimed: to know which to build)."""
    from objckpt.core.format.v2 import leaves_by_writer
    from objckpt.restoring.leaf_plan import plan_leaf

    boxes = {i: plan_leaf(manifest.leaves[i], t, devices=devices).read_boxes for i, t in enumerate(targets)}
    return set(leaves_by_writer(manifest, boxes))


# ----------------------------------------------------------------------------- child


def run_child(n: int, layouts: list[str], layers: int, repeats: int = 2) -> dict[str, Any]:
    """Every figure at ``n`` forced CPU devices: one record per (layout, target), save side first.

    CPU times are the least of ``repeats`` runs (other work on the machine only ever adds to them).
    """
    import jax

    from objckpt.core.checksum import crc32c
    from objckpt.core.format import manifest_to_json
    from objckpt.core.format.index import index_key
    from objckpt.core.tree import flatten

    have = len(jax.devices())
    if have < n:
        raise SystemExit(f"--child --devices {n}: JAX has {have} devices (set XLA_FLAGS and JAX_PLATFORMS=cpu)")
    wall = time.perf_counter()
    by_id = {d.id: d for d in jax.devices()}
    processes = n // DEVICES_PER_HOST
    saved_mesh = make_mesh(max(1, n // 8), 8)
    meshes = {name: (make_mesh(*shape) if shape else None) for name, shape in target_shapes(n).items()}
    records = []
    for layout in layouts:
        state = state_tree(saved_mesh, layout, layers)
        leaves, skeleton = flatten(state)
        saver = Saver(leaves, processes, repeats)
        host0, host1 = saver.plan(0), saver.plan(min(1, processes - 1))

        # Which processes' index objects each restoring host reads: build those.
        provisional = saver.manifest(skeleton, None)
        restores = {}
        for name, mesh in meshes.items():
            if mesh is None:
                continue
            targets = [leaf.value for leaf in flatten(retarget(state, mesh) if name != "same" else state)[0]]
            hosts = mesh.devices.size // DEVICES_PER_HOST
            host = min(1, hosts - 1)
            devices = frozenset(by_id[i] for i in range(DEVICES_PER_HOST * host, DEVICES_PER_HOST * (host + 1)))
            restores[name] = (targets, devices, host)
            for p in writers_needed(provisional, targets, devices):
                saver.plan(p)

        # The primary's commit: decode every report, build the root, encode it.
        reports = {p: saver.report_of(p) for p in range(processes)}
        started = time.process_time()
        root = manifest_to_json(saver.manifest(skeleton, reports))
        crc32c(root)
        commit_cpu = time.process_time() - started

        built = [plan["index"] for plan in saver.plans.values()]
        state_bytes = sum(math.prod(leaf.value.shape) * leaf.value.dtype.itemsize for leaf in leaves)
        records.append(
            {
                "devices": n,
                "layout": layout,
                "target_mesh": None,
                "layers": layers,
                "layers_measured": layers,
                "leaves": len(leaves),
                "processes": processes,
                "state_bytes": state_bytes,
                "save_plan_cpu_s": host1["plan_cpu_s"],
                "save_plan_cpu_s_primary": host0["plan_cpu_s"],
                "save_pieces": host1["pieces"],
                "save_blobs": host1["blobs"],
                "save_pieces_primary": host0["pieces"],
                "save_blobs_primary": host0["blobs"],
                "bytes_per_put": host1["blob_bytes"] / max(1, host1["blobs"]),
                "index_bytes": len(host1["index"]),
                "index_bytes_primary": len(host0["index"]),
                "index_encode_cpu_s": host1["index_encode_cpu_s"],
                "index_objects_built": len(built),
                "index_bytes_min": min(map(len, built)),
                "index_bytes_max": max(map(len, built)),
                "index_note": "index objects of unbuilt processes are listed with host 1's size (symmetry)",
                "report_bytes": max(len(plan["report"]) for plan in saver.plans.values()),
                "outcome_bytes": len(json.dumps({"status": "committed"}).encode()),
                "coordination_bytes": max(len(plan["report"]) for plan in saver.plans.values())
                + len(json.dumps({"status": "committed"}).encode()),
                "commit_cpu_s": commit_cpu,
                "root_bytes": len(root),
            }
        )
        objects = {index_key(SAVE_ID, p): plan["index"] for p, plan in saver.plans.items()}

        for name in TARGETS:
            if name not in restores:
                records.append({"devices": n, "layout": layout, "target_mesh": name, "skipped": "does not fit"})
                continue
            targets, devices, host = restores[name]
            store = IndexStore(objects)
            got = restore_plan(root, targets, devices, store)
            for _ in range(repeats - 1):
                again = restore_plan(root, targets, devices, IndexStore(objects))
                if again["cpu_s"] < got["cpu_s"]:
                    got["cpu_s"], got["phases"] = again["cpu_s"], again["phases"]
                del again
            if got["gaps"]:  # restore would read every index object, then call the checkpoint malformed
                raise AssertionError(f"{layout} → {name}: uncovered boxes {list(got['gaps'].items())[:3]}")
            requests, plans = got["requests"], got["plans"]
            needed = sum(
                math.prod(b - a for a, b in zip(*box)) * p.dtype.itemsize
                for p in plans.values()
                for box in p.read_boxes
            )
            read = sum(r.length for r in requests)
            pieces_read = sum(part.piece.length for r in requests for part in r.parts)
            record = {
                "devices": n,
                "layout": layout,
                "target_mesh": name,
                "target_shape": list(target_shapes(n)[name] or ()),
                "restore_host": host,
                "index_objects_read": len(got["processes"]),
                "metadata_bytes": len(root) + store.bytes_read,
                "parse_plan_cpu_s": got["cpu_s"],
                "phases_cpu_s": got["phases"],
                "uncovered": None,
                "requests": len(requests),
                "needed_bytes": needed,
                "read_bytes": read,
                "gets_per_16mib": len(requests) / (needed / (16 * MiB)) if needed else 0.0,
                "amplification": read / needed if needed else 1.0,
                # Without the spacing between pieces that a read may span (free bytes, see plan.SPACER).
                "piece_bytes_read": pieces_read,
                "piece_amplification": pieces_read / needed if needed else 1.0,
            }
            del got, requests, plans
            tracemalloc.start()  # a second run, traced: tracing slows allocation, so not timed
            try:
                tracemalloc.reset_peak()
                again = restore_plan(root, targets, devices, IndexStore(objects))
                record["extra_peak_mib"] = tracemalloc.get_traced_memory()[1] / MiB
            finally:
                tracemalloc.stop()
            del again
            records.append(record)
        del saver, objects, restores, state, leaves, root
    return {"devices": n, "wall_s": time.perf_counter() - wall, "records": records}


def spawn_child(n: int, layouts: list[str], layers: int, *, timeout: float, repeats: int = 2) -> dict[str, Any]:
    """``run_child`` in a fresh Python with ``n`` forced CPU devices; killed (its whole group) on timeout."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    argv = [sys.executable, "-m", "benchmarks.bench_scale", "--child", "--devices", str(n)]
    argv += ["--layouts", ",".join(layouts), "--layers", str(layers), "--repeats", str(repeats)]
    proc = subprocess.Popen(
        argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"bench_scale child at {n} devices ran past {timeout:.0f} s") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench_scale child at {n} devices failed (exit {proc.returncode}):\n{err[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


# ----------------------------------------------------------------------------- report

KiB = 1 << 10


def _mib(x: float) -> str:
    return f"{x / MiB:.2f} MiB"


# (label, field, format, target text, passes); target None: information only.
SAVE_ROWS: list[tuple[str, str, Callable[[Any], str], str | None, Callable[[Any], bool] | None]] = [
    ("state", "state_bytes", lambda v: f"{v / 1e12:.2f} TB", None, None),
    ("leaves / processes", "leaves", str, None, None),
    ("save plan CPU-s (host 1)", "save_plan_cpu_s", lambda v: f"{v:.3f}", "≤ 1", lambda v: v <= 1),
    ("save plan CPU-s (host 0, primary)", "save_plan_cpu_s_primary", lambda v: f"{v:.3f}", "≤ 1", lambda v: v <= 1),
    ("pieces / blobs (host 1)", "save_pieces", str, None, None),
    ("bytes per PUT (host 1)", "bytes_per_put", _mib, "≥ 16 MiB", lambda v: v >= 16 * MiB),
    ("index object (host 1)", "index_bytes", lambda v: f"{v / KiB:.0f} KiB", None, None),
    ("index encode CPU-s (host 1)", "index_encode_cpu_s", lambda v: f"{v:.3f}", None, None),
    ("coordination bytes / process", "coordination_bytes", lambda v: f"{v} B", "≤ 4 KiB", lambda v: v <= 4 * KiB),
    ("primary commit CPU-s", "commit_cpu_s", lambda v: f"{v:.3f}", "≤ 5", lambda v: v <= 5),
    ("root manifest", "root_bytes", _mib, "≤ 16 MiB", lambda v: v <= 16 * MiB),
]


def restore_rows(target: str) -> list[tuple[str, str, Callable[[Any], str], str | None, Callable[[Any], bool] | None]]:
    same = target == "same"
    return [
        (f"{target}: index objects read", "index_objects_read", str, None, None),
        (f"{target}: metadata read", "metadata_bytes", _mib, "≤ 64 MiB", lambda v: v <= 64 * MiB),
        (f"{target}: parse+plan CPU-s", "parse_plan_cpu_s", lambda v: f"{v:.3f}", "≤ 2", lambda v: v <= 2),
        (f"{target}: extra peak", "extra_peak_mib", lambda v: f"{v:.1f} MiB", "≤ 256 MiB", lambda v: v <= 256),
        (
            f"{target}: GETs / 16 MiB",
            "gets_per_16mib",
            lambda v: f"{v:.3f}",
            "≤ 1" if same else "≤ 4",
            (lambda v: v <= 1) if same else (lambda v: v <= 4),
        ),
        (
            f"{target}: read amplification",
            "amplification",
            lambda v: f"{v:.4f}",
            "1.0" if same else "≤ 1.5",
            (lambda v: round(v, 4) == 1.0) if same else (lambda v: v <= 1.5),
        ),
    ]


def markdown(records: list[dict[str, Any]], layout: str) -> str:
    counts = sorted({r["devices"] for r in records if r["layout"] == layout})
    find = {(r["devices"], r["target_mesh"]): r for r in records if r["layout"] == layout}
    lines = [
        f"### {layout}",
        "",
        "| metric | " + " | ".join(f"{n} devices" for n in counts) + " | target |",
        "|---|" + "---:|" * len(counts) + "---|",
    ]
    rows = [(None, row) for row in SAVE_ROWS] + [(t, row) for t in TARGETS for row in restore_rows(t)]
    for target, (label, key, fmt, goal, ok) in rows:
        cells = []
        for n in counts:
            r = find.get((n, target))
            if r is None or "skipped" in r or key not in r:
                cells.append("n/a")
                continue
            value = r[key]
            text = fmt(value)
            if key == "leaves":
                text = f"{value} / {r['processes']}"
            elif key == "save_pieces":
                text = f"{value} / {r['save_blobs']}"
            if ok is not None and not ok(value):
                text += " ✗"
            cells.append(text)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {goal or ''} |")
    measured = {r.get("layers_measured") for r in records if r["layout"] == layout and r["target_mesh"] is None}
    lines += ["", f"Layers measured: {', '.join(map(str, sorted(measured)))} (of {LAYERS})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="8,64,512,4096", help="comma-separated device counts")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="unstacked, stacked or both")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each CPU figure (the least is kept)")
    parser.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per device count")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.devices.split(",") if x]
    layouts = [x for x in args.layouts.split(",") if x]
    if unknown := set(layouts) - set(LAYOUTS):
        parser.error(f"unknown layouts {sorted(unknown)}")
    if any(n < 8 or n % 8 for n in counts):
        parser.error("device counts must be multiples of 8")
    if args.child:
        (n,) = counts
        print("RESULT " + json.dumps(run_child(n, layouts, args.layers, args.repeats)), flush=True)
        return
    records: list[dict[str, Any]] = []
    for n in counts:
        result = spawn_child(n, layouts, args.layers, timeout=args.timeout, repeats=args.repeats)
        print(f"{n} devices: {result['wall_s']:.1f} s", file=sys.stderr, flush=True)
        for r in result["records"]:
            r.setdefault("child_wall_s", result["wall_s"])
        records.extend(result["records"])
    for layout in layouts:
        print(markdown(records, layout) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
