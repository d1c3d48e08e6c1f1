"""objckpt's own planning and format code at pod scale, with no data (issues #40, #54).

A Llama-3-405B-shaped training state (params bf16, fp32 master copy, Adam mu and
nu: ~5.7 TB) is "saved" from N forced CPU devices (fsdp=N/8 × tensor=8) by N/4 hosts
(host h owns devices 4h..4h+3) and "restored" onto issue #54's target meshes: the same
mesh; tensor=16 with tensor minor and with fsdp minor; every layer matrix with its two
mesh axes swapped; data=3 × fsdp × tensor=8 (3/4 of the devices); half the devices; the
params only onto 1 host × 8 devices and onto 8 hosts × 8 devices. Nothing is allocated:
the leaves are ``jax.ShapeDtypeStruct`` with a ``NamedSharding``, and every figure comes
from the library's own functions (grid layout, blob packing, index and root encoding,
strict parsing, restore planning).

Save side (host 1; host 0, the primary, separately): plan CPU seconds, pieces, blobs and
bytes per PUT (blob sizes as a synchronous save picks them), the whole save's PUTs, its
index object, the report it sends the primary, and the primary's commit (decode every
report, build and encode the root manifest). Restore side, per target, for a sample of
its hosts (``scale.hosts.sample_hosts``: hosts 0, 1, 8, three spread through the rest and
the last two), through restore's own steps as they are now (leaves whose target boxes cut
the saved pieces read on the saved grid and resharded on the devices:
``restoring.read_sharding``): index objects read, metadata bytes, parse + plan CPU-s,
extra peak memory, GETs per 16 MiB, bytes fetched ÷ bytes the host's target boxes need,
and beside them the bytes the reshard moves into the host's devices from others; the
WORST host and the MEDIAN of the sample, and which host was worst (``scale/``).

Only the index objects of the processes some sampled host reads are built (by planning
that process's save); the root lists every other process with host 1's figures (the same
size by symmetry).

    python -m benchmarks.bench_scale [--model 405b|1t] [--devices 64,512,4096,16384] [--layouts unstacked,stacked]
        [--out benchmarks/results/scale.json] [--layers 126] [--fit unstacked=2,8] [--repeats 2] [--jobs 2]
        [--targets same,swapped,...]

``--model 1t``: a ~1.08T-parameter state (d_model 24,576, gated ffn 81,920, 128 layers,
full multi-head attention; ~15 TB with its optimizer state) in place of the 405B one.

``--fit LAYOUT=A,B`` runs LAYOUT at A and at B layers and fits each additive figure (bytes,
CPU-s, requests, memory) to a straight line in the number of layers, reported at
``--layers`` with ``"extrapolated": true``: a full unstacked run at 4,096 devices, where
many hosts read hundreds of index objects, is too slow for this machine.

Each device count runs in a child process of its own (``--child``): the number of forced
CPU devices is fixed when JAX starts.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.scale.hosts import extrapolate, host_devices, measure_host, sample_hosts, summarize, writers_needed
from benchmarks.scale.report import docs_table, markdown
from benchmarks.scale.save import SAVE_ID, Saver
from benchmarks.scale.state import (
    DEVICES_PER_HOST,
    LAYOUTS,
    MODELS,
    TARGETS,
    make_mesh,
    state_tree,
    target_leaves,
    targets_at,
    use_model,
)

__all__ = ["LAYOUTS", "TARGETS", "main", "run_child", "spawn_child"]

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]


def run_child(
    n: int,
    layouts: list[str],
    layers: int,
    repeats: int = 2,
    targets: tuple[str, ...] = TARGETS,
    model: str = "405b",
) -> dict[str, Any]:
    """Every figure at ``n`` forced CPU devices: one record per (layout, target of ``targets``),
    save side first.

    CPU times are the least of ``repeats`` runs (other work on the machine only ever adds to them).
    """
    import jax

    from objckpt.core.checksum import crc32c
    from objckpt.core.format import manifest_to_json
    from objckpt.core.format.index import index_key
    from objckpt.core.tree import flatten

    use_model(model)
    have = len(jax.devices())
    if have < n:
        raise SystemExit(f"--child --devices {n}: JAX has {have} devices (set XLA_FLAGS and JAX_PLATFORMS=cpu)")
    wall = time.perf_counter()
    by_id = {d.id: d for d in jax.devices()}
    processes = n // DEVICES_PER_HOST
    saved_mesh = make_mesh((max(1, n // 8), 8))
    records = []
    for layout in layouts:
        layout_wall = time.perf_counter()
        state = state_tree(saved_mesh, layout, layers)
        leaves, skeleton = flatten(state)
        saver = Saver(leaves, processes, repeats)
        host0, host1 = saver.plan(0), saver.plan(min(1, processes - 1))

        # Which processes' index objects the sampled hosts read: build those.
        provisional = saver.manifest(skeleton, None)
        restores = {}
        for name, target in targets_at(n).items():
            if target is None or name not in targets:
                continue
            wanted = target_leaves(target, layout, layers)
            sample = sample_hosts(target.hosts)
            restores[name] = (target, wanted, sample)
            for h in sample:
                for p in writers_needed(
                    provisional, wanted, host_devices(by_id, h, target.devices_per_host), target.devices_per_host
                ):
                    saver.plan(p)

        # The primary's commit: decode every report, build the root, encode it.
        reports = {p: saver.report_of(p) for p in range(processes)}
        started = time.process_time()
        root = manifest_to_json(saver.manifest(skeleton, reports))
        crc32c(root)
        commit_cpu = time.process_time() - started

        built = [plan["index"] for plan in saver.plans.values()]
        state_bytes = sum(math.prod(leaf.value.shape) * leaf.value.dtype.itemsize for leaf in leaves)
        coordination = max(len(plan["report"]) for plan in saver.plans.values())
        outcome = len(json.dumps({"status": "committed"}).encode())
        save_record = {
            "devices": n,
            "model": model,
            "layout": layout,
            "target_mesh": None,
            "layers": layers,
            "layers_measured": layers,
            "extrapolated": False,
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
            # Every process's blobs (unplanned ones: host 1's count), index objects and live-save markers, and the root.
            "save_puts": sum(saver.plans.get(p, host1)["blobs"] for p in range(processes)) + 2 * processes + 1,
            "index_bytes": len(host1["index"]),
            "index_bytes_primary": len(host0["index"]),
            "index_encode_cpu_s": host1["index_encode_cpu_s"],
            "index_objects_built": len(built),
            "index_bytes_min": min(map(len, built)),
            "index_bytes_max": max(map(len, built)),
            "index_note": "index objects of unbuilt processes are listed with host 1's size (symmetry)",
            "report_bytes": coordination,
            "outcome_bytes": outcome,
            "coordination_bytes": coordination + outcome,
            "commit_cpu_s": commit_cpu,
            "root_bytes": len(root),
        }
        records.append(save_record)
        objects = {index_key(SAVE_ID, p): plan["index"] for p, plan in saver.plans.items()}
        del saver, built

        for name in targets:
            if name not in restores:
                records.append({"devices": n, "layout": layout, "target_mesh": name, "skipped": "does not fit"})
                continue
            target, wanted, sample = restores[name]
            hosts = []
            for h in sample:
                try:
                    devices = host_devices(by_id, h, target.devices_per_host)
                    got = measure_host(root, wanted, devices, objects, repeats, per_host=target.devices_per_host)
                except AssertionError as e:
                    raise AssertionError(f"{layout} → {name}, host {h}: {e}") from None
                hosts.append({"host": h, **got})
            record = {
                "devices": n,
                "model": model,
                "layout": layout,
                "target_mesh": name,
                "target_shape": list(target.shape),
                "target_axes": list(target.axes),
                "minor_axis": target.minor,
                "swapped": target.swapped,
                "params_only": target.params_only,
                "devices_per_host": target.devices_per_host,
                "restore_hosts": target.hosts,
                "sample": sample,
                "leaves_restored": len(wanted),
                "layers": layers,
                "layers_measured": layers,
                "extrapolated": False,
                "cpu_limit_s": target.cpu_limit_s,
                "uncovered": None,  # measure_host raises on any uncovered box
                "hosts": hosts,
            }
            records.append(summarize(record))
        save_record["layout_wall_s"] = time.perf_counter() - layout_wall
        del objects, restores, state, leaves, root
    return {"devices": n, "wall_s": time.perf_counter() - wall, "records": records}


def spawn_child(
    n: int,
    layouts: list[str],
    layers: int,
    *,
    timeout: float,
    repeats: int = 2,
    targets: tuple[str, ...] = TARGETS,
    model: str = "405b",
) -> dict[str, Any]:
    """``run_child`` in a fresh Python with ``n`` forced CPU devices; killed (its whole group) on timeout."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    argv = [sys.executable, "-m", "benchmarks.bench_scale", "--child", "--devices", str(n)]
    argv += ["--layouts", ",".join(layouts), "--layers", str(layers), "--repeats", str(repeats)]
    argv += ["--targets", ",".join(targets), "--model", model]
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="64,512,4096", help="comma-separated device counts")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="unstacked, stacked or both")
    parser.add_argument("--model", choices=sorted(MODELS), default="405b")
    parser.add_argument("--layers", type=int, help="layers of the model (default: all of them)")
    parser.add_argument(
        "--fit",
        action="append",
        default=[],
        metavar="LAYOUT=A,B",
        help="run LAYOUT at A and B layers and extrapolate to --layers (marked extrapolated)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each CPU figure (the least is kept)")
    parser.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per child")
    parser.add_argument("--jobs", type=int, default=1, help="children run at once (CPU figures are per process)")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated target meshes")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--table", type=Path, help="print docs/PERFORMANCE.md's table from this results file")
    args = parser.parse_args(argv)
    if args.table:
        print(docs_table(json.loads(args.table.read_text()), max(int(x) for x in args.devices.split(",") if x)))
        return
    use_model(args.model)
    args.layers = args.layers or MODELS[args.model][3]
    counts = [int(x) for x in args.devices.split(",") if x]
    layouts = [x for x in args.layouts.split(",") if x]
    if unknown := set(layouts) - set(LAYOUTS):
        parser.error(f"unknown layouts {sorted(unknown)}")
    targets = tuple(x for x in args.targets.split(",") if x)
    if unknown := set(targets) - set(TARGETS):
        parser.error(f"unknown targets {sorted(unknown)}")
    if any(n < 8 or n % 8 for n in counts):
        parser.error("device counts must be multiples of 8")
    fits: dict[str, tuple[int, int]] = {}
    for spec in args.fit:
        name, _, pair = spec.partition("=")
        a, b = (int(x) for x in pair.split(","))
        if name not in layouts or not 0 < a < b:
            parser.error(f"--fit {spec}: a layout being run and two layer counts A < B")
        fits[name] = (a, b)
    if args.child:
        (n,) = counts
        print("RESULT " + json.dumps(run_child(n, layouts, args.layers, args.repeats, targets, args.model)), flush=True)
        return

    def child(n: int, runs: list[str], layers: int) -> list[dict[str, Any]]:
        result = spawn_child(
            n, runs, layers, timeout=args.timeout, repeats=args.repeats, targets=targets, model=args.model
        )
        print(f"{n} devices, {','.join(runs)}, {layers} layers: {result['wall_s']:.1f} s", file=sys.stderr, flush=True)
        for r in result["records"]:
            r.setdefault("child_wall_s", result["wall_s"])
        return list(result["records"])

    runs: list[tuple[int, tuple[str, ...], int]] = []
    for n in counts:
        if full := tuple(x for x in layouts if x not in fits):
            runs.append((n, full, args.layers))
        runs += [(n, (name,), layers) for name, pair in fits.items() for layers in pair]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # each child is a process of its own
        done = dict(zip(runs, pool.map(lambda run: child(run[0], list(run[1]), run[2]), runs)))
    records: list[dict[str, Any]] = []
    for n in counts:
        if full := tuple(x for x in layouts if x not in fits):
            records.extend(done[(n, full, args.layers)])
        for name, (a, b) in fits.items():
            records.extend(extrapolate(done[(n, (name,), a)], done[(n, (name,), b)], args.layers))
    for layout in layouts:
        print(markdown(records, layout) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
