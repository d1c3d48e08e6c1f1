"""One restoring host's figures, and the worst and median host of a sample.

Every figure comes from ``objckpt.restoring``'s own steps, run for the host's devices: the
root's strict parse, the leaf plans, the index objects the layouts name, the read plan and the
coverage check. A target's figures are those of a sample of its hosts (host 0 and 1, hosts
outside processes 0–7 and the last host), reported as the worst and the median host, never one
chosen host.
"""

from __future__ import annotations

import math
import statistics
import time
import tracemalloc
from typing import Any

MiB = 1 << 20


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


def restore_plan(
    root: bytes, targets: dict[int, Any], devices: frozenset[Any], store: IndexStore, *, per_host: int
) -> dict[str, Any]:
    """One host's restore up to its reads, with ``objckpt.restoring.api._restore``'s own steps:
    parse the root, choose the leaves read on the saved grid and resharded on the devices
    (``plan_read_shardings``, hosts of ``per_host`` devices by id), plan each leaf on its read
    sharding (those) or its target, read the index objects the layouts name
    (``read_needed_indexes``: only the leaves it needs from each), plan the reads
    (``restoring.fetch.plan``), check coverage; the CPU seconds of each (of every thread: the
    index reads run on objckpt's I/O thread). Planning caches start empty, as in a host's own
    restore (restore empties them when it ends)."""
    from objckpt.core.format import parse_manifest
    from objckpt.layouts.native import NativeCheckpoint
    from objckpt.options import Options
    from objckpt.restoring.fetch import plan as _plan
    from objckpt.restoring.indexes import read_needed_indexes
    from objckpt.restoring.leaf_plan import clear_planning_caches, plan_leaf
    from objckpt.restoring.read_sharding import ReadPlanner, plan_read_shardings

    clear_planning_caches()  # as a host's restore starts: nothing planned by an earlier host or run
    options = Options()
    clock = [time.process_time()]
    phases: dict[str, float] = {}

    def lap(name: str) -> None:
        clock.append(time.process_time())
        phases[name] = clock[-1] - clock[-2]

    manifest = parse_manifest(root, size_limit=options.manifest_size_limit)
    lap("parse_root")
    planner = ReadPlanner(process_of=lambda d: d.id // per_host)
    reads = plan_read_shardings(manifest, targets, planner=planner)
    lap("read_shardings")
    planned = {i: reads[i].read_target(t) if i in reads else t for i, t in targets.items()}
    plans = {i: plan_leaf(manifest.leaves[i], t, devices=devices) for i, t in sorted(planned.items())}
    lap("make_jobs")
    # IndexStore has the one method index reads use (get_range), not a whole Store.
    checkpoint = NativeCheckpoint(store, manifest, size_limit=options.manifest_size_limit)  # type: ignore[arg-type]
    manifest = read_needed_indexes(checkpoint, plans)
    plans = {i: p.with_entry(manifest.leaves[i]) for i, p in plans.items()}
    lap("indexes")
    requests = _plan(manifest, plans, options, streamed=True)
    lap("plan")
    gaps = {i: box for i, p in plans.items() if (box := p.uncovered()) is not None}
    lap("coverage")
    return {
        "processes": set(manifest.loaded),
        "manifest": manifest,
        "requests": requests,
        "plans": plans,
        "reads": reads,
        "gaps": gaps,
        "phases": phases,
        "cpu_s": clock[-1] - clock[0],
    }


def writers_needed(manifest: Any, targets: dict[int, Any], devices: frozenset[Any], per_host: int) -> set[int]:
    """The processes whose index objects a host of these devices reads, its resharded leaves
    planned on their read shardings as restore plans them (untimed: to know which to build)."""
    from objckpt.core.format.v2 import leaves_by_writer
    from objckpt.restoring.leaf_plan import plan_leaf
    from objckpt.restoring.read_sharding import ReadPlanner, plan_read_shardings

    reads = plan_read_shardings(manifest, targets, planner=ReadPlanner(process_of=lambda d: d.id // per_host))
    planned = {i: reads[i].read_target(t) if i in reads else t for i, t in targets.items()}
    boxes = {i: plan_leaf(manifest.leaves[i], t, devices=devices).read_boxes for i, t in planned.items()}
    return set(leaves_by_writer(manifest, boxes))


def box_bytes(boxes: Any, itemsize: int) -> int:
    """Bytes of ``boxes`` ((start, stop) pairs)."""
    return sum(math.prod(b - a for a, b in zip(*box)) * itemsize for box in boxes)


def needed_bytes(got: dict[str, Any], devices: frozenset[Any], per_host: int) -> int:
    """Bytes of the host's devices' TARGET boxes: a resharded leaf's from its choice (the union
    of the host's target boxes, the read boxes are other ones), every other leaf's from its plan."""
    host = next(iter(devices)).id // per_host
    reads, total = got["reads"], 0
    for i, p in got["plans"].items():
        if i in reads:
            choice = reads[i].choice
            total += int(choice.needed[choice.hosts.index(host)])
        else:
            total += box_bytes(p.read_boxes, p.dtype.itemsize)
    return total


# ----------------------------------------------------------------------------- the sample of hosts

# Per host, each figure that the issue bounds (larger is worse for every one).
WORST_OF = (
    "index_objects_read",
    "metadata_bytes",
    "parse_plan_cpu_s",
    "extra_peak_mib",
    "gets_per_16mib",
    "amplification",
    "piece_amplification",
    "moved_bytes",
)


def sample_hosts(hosts: int) -> list[int]:
    """Hosts 0 and 1 (the first hold the small replicated cells), host 8 and three spread through
    the rest (outside processes 0–7), and the last two hosts; all of them when there are 8 or fewer."""
    if hosts <= 8:
        return list(range(hosts))
    picks = {0, 1, 8, hosts // 3, hosts // 2 + 1, (2 * hosts) // 3 + 2, hosts - 2, hosts - 1}
    return sorted(h for h in picks if 0 <= h < hosts)


def host_devices(by_id: dict[int, Any], host: int, per_host: int) -> frozenset[Any]:
    """The devices of restoring host ``host``: ids per_host·host .. per_host·(host + 1) − 1."""
    return frozenset(by_id[i] for i in range(per_host * host, per_host * (host + 1)))


def measure_host(
    root: bytes,
    targets: dict[int, Any],
    devices: frozenset[Any],
    objects: dict[str, bytes],
    repeats: int,
    *,
    per_host: int,
) -> dict[str, Any]:
    """One host's figures: CPU the least of ``repeats`` runs, extra peak memory from one more
    (traced: tracing slows allocation, so not timed). Bytes needed are those of the host's
    devices' target boxes; bytes fetched those of its planned reads; bytes moved those the
    reshard brings to its devices from other devices (resharded leaves only)."""
    store = IndexStore(objects)
    got = restore_plan(root, targets, devices, store, per_host=per_host)
    for _ in range(repeats - 1):
        again = restore_plan(root, targets, devices, IndexStore(objects), per_host=per_host)
        if again["cpu_s"] < got["cpu_s"]:
            got["cpu_s"], got["phases"] = again["cpu_s"], again["phases"]
        del again
    if got["gaps"]:  # restore would read every index object, then call the checkpoint malformed
        raise AssertionError(f"uncovered boxes {list(got['gaps'].items())[:3]}")
    requests, reads = got["requests"], got["reads"]
    ids = [d.id for d in devices]
    record = {
        "index_objects_read": len(got["processes"]),
        "metadata_bytes": len(root) + store.bytes_read,
        "parse_plan_cpu_s": got["cpu_s"],
        "phases_cpu_s": got["phases"],
        "requests": len(requests),
        "needed_bytes": needed_bytes(got, devices, per_host),
        "read_bytes": sum(r.length for r in requests),
        # Without the spacing between pieces that a read may span (free bytes, see plan.SPACER).
        "piece_bytes_read": sum(part.piece.length for r in requests for part in r.parts),
        "moved_bytes": sum(r.choice.moved_to(ids) for r in reads.values()),
        "resharded_leaves": len(reads),
    }
    del got, requests, reads
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        again = restore_plan(root, targets, devices, IndexStore(objects), per_host=per_host)
        record["extra_peak_mib"] = tracemalloc.get_traced_memory()[1] / MiB
    finally:
        tracemalloc.stop()
    del again
    return with_ratios(record)


def with_ratios(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with GETs per 16 MiB and the read amplifications from its counts."""
    needed = record["needed_bytes"]
    record["gets_per_16mib"] = record["requests"] / (needed / (16 * MiB)) if needed else 0.0
    record["amplification"] = record["read_bytes"] / needed if needed else 1.0
    record["piece_amplification"] = record["piece_bytes_read"] / needed if needed else 1.0
    return record


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` (its per-host figures under "hosts") with the worst host and the median of each
    figure; its top-level figures are the worst host's."""
    hosts = record["hosts"]
    record["worst"], record["worst_host"], record["median"] = {}, {}, {}
    for key in WORST_OF:
        values = [h[key] for h in hosts]
        worst = max(hosts, key=lambda h: h[key])
        record["worst"][key] = record[key] = worst[key]
        record["worst_host"][key] = worst["host"]
        record["median"][key] = statistics.median(values)
    for key in ("requests", "needed_bytes", "read_bytes", "resharded_leaves"):
        record[key] = max(h.get(key, 0) for h in hosts)
    return record


# ----------------------------------------------------------------------------- fewer layers

SAVE_LINEAR = (
    "state_bytes",
    "leaves",
    "save_plan_cpu_s",
    "save_plan_cpu_s_primary",
    "save_pieces",
    "save_blobs",
    "save_pieces_primary",
    "save_blobs_primary",
    "index_bytes",
    "index_bytes_primary",
    "index_encode_cpu_s",
    "index_bytes_min",
    "index_bytes_max",
    "commit_cpu_s",
    "root_bytes",
)
HOST_LINEAR = (
    "metadata_bytes",
    "parse_plan_cpu_s",
    "extra_peak_mib",
    "requests",
    "needed_bytes",
    "read_bytes",
    "piece_bytes_read",
    "moved_bytes",
)


def extrapolate(low: list[dict[str, Any]], high: list[dict[str, Any]], layers: int) -> list[dict[str, Any]]:
    """Records at ``layers`` layers fitted to a straight line through runs at two smaller layer
    counts (``low`` and ``high``: the same device counts, layouts and targets), marked
    ``extrapolated``. Index objects read and coordination bytes do not grow with layers: the
    larger run's. Ratios are recomputed from the fitted counts."""
    by_key = {(r["devices"], r["layout"], r["target_mesh"]): r for r in low}
    out = []
    for b in high:
        a = by_key[(b["devices"], b["layout"], b["target_mesh"])]
        if "skipped" in b:
            out.append(dict(b, layers=layers, extrapolated=True))
            continue
        la, lb = a["layers_measured"], b["layers_measured"]

        def fit(x: float, y: float, la: int = la, lb: int = lb) -> float:
            v = x + (y - x) * (layers - la) / (lb - la)
            return round(v) if isinstance(x, int) and isinstance(y, int) else v

        r = dict(b, layers=layers, layers_measured=[la, lb], extrapolated=True)
        if b["target_mesh"] is None:
            r.update({k: fit(a[k], b[k]) for k in SAVE_LINEAR})
            r.pop("save_puts", None)  # not linear in layers: a process's blobs grow with its bytes
        else:
            hosts_a = {h["host"]: h for h in a["hosts"]}
            r["hosts"] = []
            for hb in b["hosts"]:
                ha = hosts_a[hb["host"]]
                h = dict(hb, **{k: fit(ha[k], hb[k]) for k in HOST_LINEAR})
                h["index_objects_read"] = max(ha["index_objects_read"], hb["index_objects_read"])
                if "resharded_leaves" in hb:  # a count of leaves: on the same line as they are
                    h["resharded_leaves"] = fit(ha["resharded_leaves"], hb["resharded_leaves"])
                r["hosts"].append(with_ratios(h))
            summarize(r)
        out.append(r)
    return out
