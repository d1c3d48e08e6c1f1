"""The training step beside an async save's upload, for several ``Options.save_threads``.

    PYTHONPATH=. python benchmarks/bench_save_threads.py [--state-gib 4] [--threads 17 8 3 2 1]
        [--stores tmpfs disk] [--repeats 2] [--out benchmarks/results/save-threads.json]

One process builds bench_accelerator's training state once on ``jax.devices()[0]`` (a TPU chip
where one is lent; the CPU elsewhere, where the step is not a device's) and then, for each store,
repeat and thread count in turn (interleaved), times the jitted ~50 ms step alone, makes a
``CheckpointManager`` save (async) to ``file://`` with ``Options(save_threads=N)``, and times the
step until the save commits. Beside the step it records what the host did meanwhile: the
process's CPU-seconds over the upload, the container's CPU throttling (cgroup ``cpu.stat``,
where the host has one) and how late a thread that sleeps 1 ms wakes (scheduling and GIL delay
together). ``--switch-interval S`` adds a run of the largest thread count with
``sys.setswitchinterval(S)``: if that alone brings the step back, the GIL is what slows it.

The default executor of objckpt's event loop has the host's cores plus four threads, so the
largest thread count here (17 on a 13-core TPU host) is how a save ran before ``save_threads``.
Prints a table and writes one JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accelerator_worker import Step, build_state, steps_alone  # noqa: E402


def cgroup_throttling() -> tuple[int, int] | None:
    """(periods throttled, microseconds throttled) of this process's cgroup, or None."""
    for path in ("/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.stat", "/sys/fs/cgroup/cpu,cpuacct/cpu.stat"):
        try:
            fields = dict(line.split() for line in Path(path).read_text().splitlines() if line.strip())
        except OSError:
            continue
        usec = int(fields.get("throttled_usec", int(fields.get("throttled_time", 0)) // 1000))
        return int(fields.get("nr_throttled", 0)), usec
    return None


class WakeProbe:
    """A thread that sleeps 1 ms at a time and records how late it wakes (the OS scheduler's
    delay plus the wait for the GIL), between ``start()`` and ``stop()``."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.001)
            self.late.append(time.perf_counter() - t0 - 0.001)

    def start(self) -> WakeProbe:
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        late = sorted(self.late) or [0.0]
        return {
            "wake_late_p50_ms": late[len(late) // 2] * 1e3,
            "wake_late_p99_ms": late[int(len(late) * 0.99)] * 1e3,
            "wake_late_max_ms": late[-1] * 1e3,
        }


def one_save(state: Any, step: Step, root: Path, threads: int, switch: float | None) -> dict[str, Any]:
    import objckpt

    shutil.rmtree(root, ignore_errors=True)
    alone = statistics.median(steps_alone(step, 10))
    mgr = objckpt.CheckpointManager(root.as_uri(), options=objckpt.Options(save_threads=threads))
    before_switch = sys.getswitchinterval()
    if switch is not None:
        sys.setswitchinterval(switch)
    try:
        started = time.perf_counter()
        mgr.save(1, state, force=True)
        blocked = time.perf_counter() - started
        cpu0, throttle0, probe = os.times(), cgroup_throttling(), WakeProbe().start()
        committed: list[float] = []
        waiter = threading.Thread(target=lambda: (mgr.wait(), committed.append(time.perf_counter())))
        waiter.start()
        during = [step()]
        while waiter.is_alive():
            during.append(step())
        waiter.join()
        cpu1, throttle1, wake = os.times(), cgroup_throttling(), probe.stop()
    finally:
        sys.setswitchinterval(before_switch)
    mgr.close()
    shutil.rmtree(root, ignore_errors=True)
    upload = committed[0] - started - blocked
    row = {
        "save_threads": threads,
        "switch_interval_s": switch,
        "blocked_s": blocked,
        "upload_s": upload,
        "step_alone_s": alone,
        "step_during_s": statistics.median(during),
        "step_max_s": max(during),
        "steps_during": len(during),
        "step_slowdown": statistics.median(during) / alone,
        "lost_s": blocked + sum(max(0.0, t - alone) for t in during),
        "upload_cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
        **wake,
    }
    if throttle0 is not None and throttle1 is not None:
        row["throttled_periods"] = throttle1[0] - throttle0[0]
        row["throttled_s"] = (throttle1[1] - throttle0[1]) / 1e6
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-gib", type=float, default=4.0)
    ap.add_argument("--threads", type=int, nargs="+", default=[17, 8, 3, 2, 1])
    ap.add_argument("--stores", nargs="+", default=["tmpfs", "disk"], choices=("tmpfs", "disk"))
    ap.add_argument("--disk-dir", default=None, help="the disk store's directory (default: the temp dir)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--switch-interval", type=float, default=None)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--step-dim", type=int, default=4096)
    ap.add_argument("--out", default="benchmarks/results/save-threads.json")
    args = ap.parse_args()

    import tempfile

    import jax

    step = Step(args.step_s, args.step_dim)
    state = build_state(args.state_gib)
    jax.block_until_ready(state)
    disk = Path(args.disk_dir or tempfile.gettempdir())
    roots = {"tmpfs": Path("/dev/shm/objckpt-save-threads"), "disk": disk / "objckpt-save-threads"}
    runs = [(t, None) for t in args.threads]
    if args.switch_interval is not None:
        runs.append((max(args.threads), args.switch_interval))
    rows = []
    for repeat in range(args.repeats):
        for store in args.stores:
            for threads, switch in runs:
                row = {"store": store, "repeat": repeat, **one_save(state, step, roots[store], threads, switch)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    device = jax.devices()[0]
    result = {
        "benchmark": "save_threads",
        "platform": device.platform,
        "device_kind": device.device_kind,
        "cpus": len(os.sched_getaffinity(0)),
        "state_gib": args.state_gib,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        "| store | save_threads | switch s | blocked s | upload s | step × | step max s | lost s | upload CPU-s | wake p99 ms | throttled s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    keys = sorted({(r["store"], r["save_threads"], r["switch_interval_s"] or 0.0) for r in rows})
    for store, threads, switch in keys:
        mine = [
            r
            for r in rows
            if (r["store"], r["save_threads"], r["switch_interval_s"] or 0.0) == (store, threads, switch)
        ]

        def med(k: str, mine: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r.get(k, float("nan")) for r in mine)

        print(
            f"| {store} | {threads} | {switch or '-'} | {med('blocked_s'):.2f} | {med('upload_s'):.2f} | "
            f"{med('step_slowdown'):.2f} | {med('step_max_s'):.3f} | {med('lost_s'):.2f} | {med('upload_cpu_s'):.2f} | "
            f"{med('wake_late_p99_ms'):.1f} | {med('throttled_s'):.2f} |"
        )
    print(f"{len(rows)} saves of {args.state_gib:g} GiB; {result['cpus']} CPUs; {device.device_kind}")


if __name__ == "__main__":
    main()
