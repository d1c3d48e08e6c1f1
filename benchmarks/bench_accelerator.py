"""Issue 65's accelerator path: what a save costs training on a TPU or GPU, against the floors and Orbax.

    PYTHONPATH=. python benchmarks/bench_accelerator.py [--state-gib 4 8] [--stores disk tmpfs]
        [--repeats 3] [--systems floors objckpt objckpt_snapshot objckpt_local orbax] [--saves 1] [--out FILE]
        [--local-dir /dev/shm] [--profile DIR] [--quick]

Runs on the machine that holds the accelerator, with no network: every store is a local path
(``file://`` on disk, ``--disk-dir``, default the temp dir; and on tmpfs, ``/dev/shm``). The
state (``benchmarks/accelerator_worker.py``) is bf16 params plus f32 master weights and Adam
moments, 456 leaves, on ``jax.devices()[0]``. For each repeat, state and store, five
measurements run in turn, each in a fresh process (one process holds the chip at a time), the
order rotating each repeat:

- ``floors``: ``jax.device_get`` of the whole state, ``np.asarray`` leaf by leaf,
  ``copy_to_host_async`` on every leaf then ``np.asarray`` (each on a freshly built state),
  ``jax.device_put`` back, and a raw write and read of the same bytes (one file per leaf) at the
  store path; the save floor is ``device_get`` + write, the restore floor read + ``device_put``.
- ``objckpt``, ``objckpt_snapshot`` (``Options(device_snapshot="on")``), ``objckpt_local``
  (``CheckpointManager(root, local=LocalCopies(<a directory under --local-dir>))``: each step is
  due for both the local tier and the store, and one device→host copy serves both; its restore
  reads the local tier) and ``orbax``: ``CheckpointManager.save`` with its defaults (async) — seconds blocked, seconds until
  committed, device memory's peak before and after — while a jitted training step (chained
  matmuls, ~50 ms on a chip) runs until the commit; host RSS sampled every 5 ms (peak above the start during the
  save, what is still held after the commit); whether a host copy is left cached on the saved
  arrays; then a restore onto the device (seconds, peak RSS above its start), checked by
  per-leaf fingerprints. Orbax is skipped, with a note, where it is not importable.

With ``--saves N`` each system's process saves N times in a row, as a job does: before each
later save the previous checkpoint is deleted (untimed) and the state moves on by a donated
update. A process's first save is what the targets judge (a job's first checkpoint, on host
memory the process has not used yet); the later saves' medians are reported beside them as
``later_blocked_s``, ``later_save_total_s``, ``later_lost_s`` and ``later_step_during_s`` (with
``orbax_``, ``snapshot_`` and ``local_`` twins), and the restore reads the last save back.

Each cell (one state and store) carries the medians of the repeats, the raw samples, and the
issue's targets checked (``targets``: per target ``ok``, the measured ``value`` and its
``limit``). Writes ``benchmarks/results/accelerator.json`` (``--out``), rewritten after every
measurement, and prints a table. A device lease too short for every cell runs them in turns,
each with ``--merge`` of the previous file (each cell records its ``commit``); a call too short
for one cell's repeats (8 GiB: about 245 s a repeat) takes ``--resume`` of the file the last
call wrote, which keeps that cell's runs when its commit is the same and goes on from the first
repeat not measured in every system; the floors' runs it keeps at any commit (they time JAX and
the store, not objckpt's code), so ``--systems objckpt orbax --resume FILE`` re-measures a cell
at new code against the floors already in FILE (the cell's ``floors_commits`` say which). A file
holds one device's cells: a ``--merge`` or ``--resume`` of cells measured on another device is
refused. ``--quick`` (a 64 MiB state on disk, one repeat, a ~20 ms step) checks the machinery on
a CPU in about a minute and writes to a temp file unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SYSTEMS = ("floors", "objckpt", "objckpt_snapshot", "objckpt_local", "orbax")
# Issue 65's targets: name -> (limit, what the value is).
TARGETS = {
    "blocked_vs_device_get": (1.2, "blocked_s / device_get_s"),
    "blocked_vs_orbax": (1.0, "blocked_s / orbax_blocked_s"),
    "peak_host_ram": (1.1, "(peak_host_ram_gib - 0.25) / state (GiB): peak <= 1.1 x state + 0.25 GiB"),
    "ram_after_commit_gib": (0.25, "after_commit_host_ram_gib"),
    "no_host_copy_attached": (0.0, "1 if a host copy is cached on a saved array"),
    "step_slowdown": (1.25, "step_during_s / step_alone_s"),
    "step_stall_s": (0.5, "step_max_s"),
    "lost_vs_orbax": (1.0, "lost_s / orbax_lost_s"),
    "save_total_vs_orbax": (1.0, "save_total_s / orbax_save_total_s"),
    "restore_vs_orbax": (1.0, "restore_s / orbax_restore_s (must be below)"),
    "restore_vs_floor": (1.1, "restore_s / restore_floor_s"),
    "restore_host_ram_gib": (1.0, "restore_peak_host_ram_gib"),
    "device_peak_unchanged_gib": (0.01, "device_peak_delta_gib (device_snapshot off)"),
    "snapshot_blocked_s": (0.25, "snapshot_blocked_s (device_snapshot on)"),
    # The same save targets for a manager step due for both the local tier and the store.
    "local_blocked_vs_device_get": (1.2, "local_blocked_s / device_get_s"),
    "local_blocked_vs_orbax": (1.0, "local_blocked_s / orbax_blocked_s"),
    "local_peak_host_ram": (1.1, "(local_peak_host_ram_gib - 0.25) / state (GiB)"),
    "local_no_host_copy_attached": (0.0, "1 if a host copy is cached on an array saved to both"),
    "local_step_slowdown": (1.25, "local_step_during_s / local_step_alone_s"),
}
ORBAX_TARGETS = {
    "blocked_vs_orbax",
    "lost_vs_orbax",
    "save_total_vs_orbax",
    "restore_vs_orbax",
    "local_blocked_vs_orbax",
}


def store_path(store: str, disk_dir: str) -> str:
    if store == "tmpfs":
        return "/dev/shm"
    if store == "disk":
        return disk_dir
    raise SystemExit(f"unknown store {store!r}: disk or tmpfs")


def fs_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (``/proc/mounts``), or ``?``."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, typ = line.split()[:3]
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, typ
    return kind


def run_one(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one measurement in a fresh process; its result, or SystemExit with its stderr tail."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-accel-", dir=job["base"]))
    local = Path(tempfile.mkdtemp(prefix="bench-accel-local-", dir=job["local_base"]))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.accelerator_worker"],
            input=json.dumps({**job, "path": str(scratch), "local_path": str(local)}),
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{job['system']} ({job['state_gib']} GiB, {job['store']}) failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


def median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def summarise(cell: dict[str, Any]) -> None:
    """Fill a cell's medians, ratios and targets from its raw ``runs`` (in place)."""
    runs = cell["runs"]
    floors, ours, orbax = runs.get("floors", []), runs.get("objckpt", []), runs.get("orbax", [])
    snap, local = runs.get("objckpt_snapshot", []), runs.get("objckpt_local", [])
    if not floors or not ours:
        return
    for key in ("device_get_s", "per_leaf_s", "async_batched_s", "device_put_s", "raw_write_s", "raw_read_s"):
        cell[key] = median(floors, key)
    cell["floors_commits"] = sorted({r.get("commit", cell.get("commit")) for r in floors} - {None})
    cell["save_floor_s"] = median(floors, "save_floor_s")
    cell["restore_floor_s"] = median(floors, "restore_floor_s")
    for key in (
        "blocked_s",
        "save_total_s",
        "peak_host_ram_gib",
        "after_commit_host_ram_gib",
        "step_alone_s",
        "step_during_s",
        "step_max_s",
        "lost_s",
        "restore_s",
        "restore_peak_host_ram_gib",
    ):
        cell[key] = median(ours, key)
        cell[f"orbax_{key}"] = median(orbax, key) if orbax else None
        cell[f"snapshot_{key}"] = median(snap, key) if snap else None
        cell[f"local_{key}"] = median(local, key) if local else None
    for key in ("later_blocked_s", "later_save_total_s", "later_lost_s", "later_step_during_s"):
        # Saves after the first in the same process (``--saves``): reported, not targets.
        if all(key in r for r in ours):
            cell[key] = median(ours, key)
            cell[f"orbax_{key}"] = median(orbax, key) if orbax and all(key in r for r in orbax) else None
            cell[f"snapshot_{key}"] = median(snap, key) if snap and all(key in r for r in snap) else None
            cell[f"local_{key}"] = median(local, key) if local and all(key in r for r in local) else None
    cell["device_peak_delta_gib"] = median(ours, "device_peak_delta_gib")
    cell["leaves"] = ours[0]["leaves"]
    cell["state_bytes"] = ours[0]["state_bytes"]
    cell["host_copy_attached"] = any(r["host_copy_attached"] for r in ours)
    cell["local_host_copy_attached"] = any(r["host_copy_attached"] for r in local) if local else None
    cell["orbax_host_copy_attached"] = any(r["host_copy_attached"] for r in orbax) if orbax else None
    cell["exact"] = all(r["exact"] for r in ours + orbax)
    cell["step_slowdown"] = cell["step_during_s"] / cell["step_alone_s"]
    cell["orbax_step_slowdown"] = cell["orbax_step_during_s"] / cell["orbax_step_alone_s"] if orbax else None
    cell["blocked_vs_device_get"] = cell["blocked_s"] / cell["device_get_s"]
    state_gib = cell["state_bytes"] / (1 << 30)
    values = {
        "blocked_vs_device_get": cell["blocked_vs_device_get"],
        "peak_host_ram": (cell["peak_host_ram_gib"] - 0.25) / state_gib,
        "ram_after_commit_gib": cell["after_commit_host_ram_gib"],
        "no_host_copy_attached": float(cell["host_copy_attached"]),
        "step_slowdown": cell["step_slowdown"],
        "step_stall_s": cell["step_max_s"],
        "restore_vs_floor": cell["restore_s"] / cell["restore_floor_s"],
        "restore_host_ram_gib": cell["restore_peak_host_ram_gib"],
        "device_peak_unchanged_gib": cell["device_peak_delta_gib"],
    }
    if snap:
        values["snapshot_blocked_s"] = cell["snapshot_blocked_s"]
    cell["exact"] = cell["exact"] and all(r["exact"] for r in snap + local)
    if local:
        values.update(
            local_blocked_vs_device_get=cell["local_blocked_s"] / cell["device_get_s"],
            local_peak_host_ram=(cell["local_peak_host_ram_gib"] - 0.25) / state_gib,
            local_no_host_copy_attached=float(cell["local_host_copy_attached"]),
            local_step_slowdown=cell["local_step_during_s"] / cell["local_step_alone_s"],
        )
    if local and orbax:
        values["local_blocked_vs_orbax"] = cell["local_blocked_s"] / cell["orbax_blocked_s"]
    if orbax:
        values.update(
            blocked_vs_orbax=cell["blocked_s"] / cell["orbax_blocked_s"],
            lost_vs_orbax=cell["lost_s"] / cell["orbax_lost_s"],
            save_total_vs_orbax=cell["save_total_s"] / cell["orbax_save_total_s"],
            restore_vs_orbax=cell["restore_s"] / cell["orbax_restore_s"],
        )
    ok = {name: value <= TARGETS[name][0] for name, value in values.items()}
    ok["restore_vs_orbax"] = values.get("restore_vs_orbax", 1.0) < 1.0
    cell["targets"] = {
        name: {"ok": bool(ok[name]), "value": value, "limit": TARGETS[name][0], "what": TARGETS[name][1]}
        for name, value in values.items()
    }


def table(report: dict[str, Any]) -> str:
    rows = [
        "| cell | leaves | blocked s | snapshot blocked s | local+store blocked s | device_get s | Orbax blocked s | "
        "peak RAM GiB | step × | save total s | Orbax total s | restore s | floor s | Orbax restore s | targets met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = lambda v: "—" if v is None else f"{v:.3g}"  # noqa: E731
    for cell in report["cells"]:
        if "targets" not in cell:
            continue
        met = sum(t["ok"] for t in cell["targets"].values())
        rows.append(
            f"| {cell['name']} | {cell['leaves']} | {f(cell['blocked_s'])} | {f(cell['snapshot_blocked_s'])} | "
            f"{f(cell.get('local_blocked_s'))} | "
            f"{f(cell['device_get_s'])} | "
            f"{f(cell['orbax_blocked_s'])} | {f(cell['peak_host_ram_gib'])} | {f(cell['step_slowdown'])} | "
            f"{f(cell['save_total_s'])} | {f(cell['orbax_save_total_s'])} | {f(cell['restore_s'])} | "
            f"{f(cell['restore_floor_s'])} | {f(cell['orbax_restore_s'])} | {met} of {len(cell['targets'])} |"
        )
    return "\n".join(rows)


def resumed_runs(earlier: dict[str, Any], systems: list[str], commit: str) -> dict[str, list[dict[str, Any]]]:
    """The runs of an earlier call's cell that go on in this one (``--resume``): every system's
    at the same commit; the floors' at any commit, since they time JAX and the store, not
    objckpt's code (each run keeps the commit it was measured at)."""
    kept: dict[str, list[dict[str, Any]]] = {}
    for system, runs in earlier.get("runs", {}).items():
        if system in systems or system == "floors":
            if system == "floors" or earlier.get("commit") == commit:
                kept[system] = [{**r, "commit": r.get("commit", earlier.get("commit"))} for r in runs]
    return kept


def check_one_device_kind(cells: list[dict[str, Any]], kind: str, source: str | None) -> None:
    """Refuse to write a file whose cells come from different devices: a cell kept by ``--merge``
    or ``--resume`` from another chip (say a GPU run merged into the TPU's file) would pass for
    this one's."""
    seen = {c.get("device_kind") for c in cells}
    seen |= {r.get("device_kind") for c in cells for runs in c.get("runs", {}).values() for r in runs}
    others = sorted(k for k in seen if k not in (None, kind))
    if others:
        raise SystemExit(
            f"{source}: its cells were measured on {', '.join(others)}, this run on {kind}; "
            "write this device's results to a file of its own (--out, without --merge or --resume of that one)"
        )


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-gib", type=float, nargs="+", default=None, help="states in GiB (default 4 8)")
    ap.add_argument("--stores", nargs="+", default=None, choices=("disk", "tmpfs"), help="default disk tmpfs")
    ap.add_argument("--disk-dir", default=tempfile.gettempdir(), help="the disk store's directory")
    ap.add_argument(
        "--local-dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
        help="where objckpt_local's local tier goes (default /dev/shm)",
    )
    ap.add_argument("--repeats", type=int, default=None, help="default 3")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--step-s", type=float, default=None, help="training step alone, s (0.05; quick 0.02)")
    ap.add_argument("--step-dim", type=int, default=None, help="its matmul size (4096; quick 256)")
    ap.add_argument(
        "--saves",
        type=int,
        default=1,
        help="saves one after another in each system's process (default 1); the later ones' medians go to later_*",
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds per measurement process")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--profile", default=None, help="a directory for cProfile files of objckpt's and Orbax's save and restore calls"
    )
    ap.add_argument("--quick", action="store_true", help="64 MiB on disk, 1 repeat: the machinery, not figures")
    ap.add_argument(
        "--merge", default=None, help="an earlier results file whose other cells are kept (runs split across leases)"
    )
    ap.add_argument(
        "--resume", default=None, help="a file from an earlier call at the same commit whose cells' repeats go on"
    )
    ap.add_argument("--commit", default=None, help="the code's commit, where `git` cannot tell (a copied tree)")
    args = ap.parse_args(argv)
    quick = args.quick
    states = args.state_gib or ([1 / 16] if quick else [4.0, 8.0])
    stores = args.stores or (["disk"] if quick else ["disk", "tmpfs"])
    repeats = args.repeats or (1 if quick else 3)
    if args.out:
        out = Path(args.out)
    elif quick:
        out = Path(tempfile.mkdtemp(prefix="bench-accel-out-")) / "accelerator-quick.json"
    else:
        out = RESULTS / "accelerator.json"
    systems = [s for s in SYSTEMS if s in args.systems]
    notes = []
    if "orbax" in systems and importlib.util.find_spec("orbax.checkpoint") is None:
        systems.remove("orbax")
        notes.append("orbax skipped: orbax.checkpoint is not importable here")
    report: dict[str, Any] = {
        "benchmark": "bench_accelerator",
        "quick": quick,
        "commit": args.commit or git_commit(),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
        "repeats": repeats,
        "saves": args.saves,
        "systems": systems,
        "notes": notes,
        "cells": [],
    }
    cells = {}
    names = {f"{gib:g}GiB-{store}" for gib in states for store in stores}
    earlier = {}  # the same cells from an earlier call, whose runs go on
    if args.resume and Path(args.resume).exists():
        earlier = {c["name"]: c for c in json.loads(Path(args.resume).read_text())["cells"] if c["name"] in names}
    if args.merge and Path(args.merge).exists():  # the cells measured in an earlier lease, as they were
        kept = [c for c in json.loads(Path(args.merge).read_text())["cells"] if c["name"] not in names]
        report["cells"].extend(kept)
    for gib in states:
        for store in stores:
            base = store_path(store, args.disk_dir)
            cell = {"name": f"{gib:g}GiB-{store}", "state_gib": gib, "store": store, "path": base}
            cell.update(fs_type=fs_type(base), commit=report["commit"], runs={s: [] for s in systems})
            if cell["name"] in earlier:
                cell["runs"].update(resumed_runs(earlier[cell["name"]], systems, report["commit"]))
                summarise(cell)
            if not (cell["runs"].get("floors") or "floors" in systems) or "objckpt" not in systems:
                notes.append(f"{cell['name']}: no targets without both floors and objckpt")
            cells[gib, store] = cell
            report["cells"].append(cell)
    job_base = {
        "step_s": args.step_s or (0.02 if quick else 0.05),
        "step_dim": args.step_dim or (256 if quick else 4096),
        "steps_alone": 5 if quick else 20,
        "profile_dir": args.profile,
        "saves": args.saves,
        "local_base": args.local_dir,
    }
    started = time.perf_counter()
    for rep in range(repeats):
        order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
        for gib in states:
            for store in stores:
                cell = cells[gib, store]
                for system in order:
                    if len(cell["runs"][system]) > rep:  # measured by the call resumed
                        continue
                    job = {**job_base, "system": system, "state_gib": gib, "store": store, "base": cell["path"]}
                    t0 = time.perf_counter()
                    result = run_one(job, args.timeout)
                    result["repeat"], result["commit"] = rep, report["commit"]
                    cell["runs"][system].append(result)
                    cell["platform"], cell["device_kind"] = result["platform"], result["device_kind"]
                    report.setdefault("platform", result["platform"])
                    report.setdefault("device_kind", result["device_kind"])
                    check_one_device_kind(report["cells"], result["device_kind"], args.merge or args.resume)
                    summarise(cell)
                    report["seconds"] = time.perf_counter() - started
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(report, indent=1) + "\n")
                    print(f"{cell['name']} {system} repeat {rep}: {time.perf_counter() - t0:.1f} s", flush=True)
    print(table(report))
    for cell in report["cells"]:
        failed = [name for name, t in cell.get("targets", {}).items() if not t["ok"]]
        print(f"{cell['name']}: targets not met: {', '.join(failed) or 'none'}")
        if cell.get("later_save_total_s") is not None:
            print(
                f"{cell['name']}: later saves: blocked {cell['later_blocked_s']:.3g} s, committed "
                f"{cell['later_save_total_s']:.3g} s (Orbax {cell['orbax_later_save_total_s'] or float('nan'):.3g} s), "
                f"training lost {cell['later_lost_s']:.3g} s"
            )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
