"""Continuous saving against a fixed interval: the training time lost to checkpointing and the
checkpoint interval each reaches (issue 55).

A simulated training loop runs a jitted, donated step over a state of several float32 arrays
(1 GiB by default) on a (4, 2) mesh of CPU devices: every step rewrites every array and does a
fixed amount of matmul work. The loop runs (a) without checkpointing, 20 steps right before
and 20 right after every other run (that run's baseline: the load the machine's other work
adds drifts within minutes), (b) under ``SavePolicy(continuous=True)``, which starts
the next save as soon as the previous one has committed, and (c) under
``save_interval_steps=K`` for several K (by default K = 0.5, 1 and 2 times the interval
continuous reached in the first round). Saves go to the
local S3 server (SeaweedFS) through ``backends.proxy.FaultProxy`` at 10 ms RTT, each run to a
fresh root with ``keep_last=2``.

Each checkpointing run saves at step 0 and every K steps (continuous: whenever no save is in
flight) for ``--steps`` steps (rounded up to whole intervals), then keeps training without new
saves until the last save has committed, so every save's whole cost lies inside the timed
steps. Reported per mode, medians over rounds (the order of the modes rotates each round):

- step overhead: (wall seconds per step / the run's baseline) - 1, and the training seconds
  lost per save (the extra wall time over the saves);
- checkpoints committed, the mean interval between commits in steps (of the saved step numbers)
  and in seconds;
- blocking per save: the seconds the loop stood in ``save`` (the device-to-host copy, and with
  a fixed K shorter than a save, the wait for the previous one);
- where the overhead went: blocking vs steps slowed by a save running beside them (the store
  and the latency proxy share this machine's cores with the training step), and the store
  server's CPU seconds per save.

The save interval at continuous's overhead is interpolated linearly in 1/K between the measured
intervals (overhead falls roughly as 1/K once K is longer than a save).

    python -m benchmarks.bench_continuous [--mib 1024] [--steps 160] [--repeats 3] [--rtt-ms 10]
    python -m benchmarks.bench_continuous --quick     # 256 MiB, 1 round, fewer steps (a look, not results)
    python -m benchmarks.bench_continuous --report benchmarks/results/continuous.json   # summarise again

Writes ``benchmarks/results/continuous.json`` (``continuous-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import objckpt  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MiB = 1 << 20
NONE, CONTINUOUS = "none", "continuous"


@dataclass
class Config:
    """What one benchmark run measures."""

    mib: int = 1024  # the state's size
    leaves: int = 8  # arrays in the state
    steps: int = 160  # timed steps per run (rounded up to whole intervals)
    warmup: int = 5  # untimed steps before the first round (compilation)
    repeats: int = 3  # rounds, each running every mode once
    factors: tuple[float, ...] = (0.5, 1.0, 2.0)  # K as multiples of continuous's interval
    intervals: tuple[int, ...] = ()  # fixed K values instead of factors
    rtt_ms: float = 10.0
    matmul: int = 1024  # the step's fixed compute: `layers` chained (matmul x matmul) products
    layers: int = 6
    keep_last: int = 2
    min_saves: int = 2  # continuous keeps saving past `steps` until this many saves started
    bracket: int = 20  # steps without checkpointing right before and after each run: its baseline
    extra: dict[str, Any] = field(default_factory=dict)


def make_state(mib: int, leaves: int) -> dict[str, jax.Array]:
    """``leaves`` float32 arrays of (rows, 4096), ``mib`` MiB in all, sharded P('data', 'model')."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rows = max(8, mib * MiB // leaves // 4 // 4096 // 8 * 8)
    sharding = NamedSharding(mesh, P("data", "model"))
    return jax.block_until_ready(
        {f"w{i}": jax.device_put(jnp.full((rows, 4096), 0.01 * i, jnp.float32), sharding) for i in range(leaves)}
    )


def make_step(matmul: int, layers: int) -> tuple[Callable[..., Any], jax.Array]:
    """A jitted step that donates and rewrites every array of the state after fixed matmul work."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    m = jax.device_put(jnp.ones((matmul, matmul), jnp.float32) / matmul, NamedSharding(mesh, P(None, "model")))

    def step(state: dict[str, jax.Array], m: jax.Array) -> tuple[dict[str, jax.Array], jax.Array]:
        h = m
        for _ in range(layers):
            h = jnp.tanh(h @ m)
        g = jnp.mean(h)
        return {k: v * 0.999 + g * 1e-3 for k, v in state.items()}, g

    return jax.jit(step, donate_argnums=0), m


def _server_cpu(pid: int | None) -> float:
    """CPU seconds the store's server process has used so far (0 when unknown)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vacuum(service: Any) -> None:
    """Ask SeaweedFS to reclaim deleted objects' space (untimed, after each run: a round writes ~20 GiB)."""
    args = [str(a) for a in service._process.popen.args if str(a).startswith("-master.port=")]
    if args:
        port = args[0].split("=", 1)[1]
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/vol/vacuum?garbageThreshold=0.01", timeout=300).read()


def plain_steps(
    state: dict[str, jax.Array], step: Callable[..., Any], m: jax.Array, n: int
) -> tuple[dict[str, jax.Array], list[float]]:
    """``n`` steps without checkpointing; the seconds of each."""
    times = []
    for _ in range(n):
        started = time.perf_counter()
        state, g = step(state, m)
        g.block_until_ready()
        times.append(time.perf_counter() - started)
    return state, times


def run_mode(
    mode: str,
    interval: int | None,
    state: dict[str, jax.Array],
    step: Callable[..., Any],
    m: jax.Array,
    cfg: Config,
    url: str,
    storage_options: dict[str, Any],
    server_pid: int | None = None,
) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """Train ``cfg.steps`` steps (rounded up to whole intervals) under one mode, between two
    brackets of ``cfg.bracket`` steps without checkpointing (the run's baseline, so that the load
    the machine's other work adds drifts into the baseline too); returns the new state and the record."""
    state, base_before = plain_steps(state, step, m, cfg.bracket)
    steps = cfg.steps if interval is None else -(-cfg.steps // interval) * interval
    mgr = None
    if mode == CONTINUOUS:
        mgr = objckpt.CheckpointManager(
            url,
            storage_options=storage_options,
            retention=objckpt.Retention(keep_last=cfg.keep_last),
            save_rules=objckpt.SavePolicy(continuous=True),
        )
    elif mode != NONE:
        mgr = objckpt.CheckpointManager(
            url,
            storage_options=storage_options,
            retention=objckpt.Retention(keep_last=cfg.keep_last),
            save_rules=objckpt.SavePolicy(save_interval_steps=interval),
        )
    saves: list[dict[str, float]] = []
    commits: list[dict[str, float]] = []
    step_s: list[float] = []
    in_flight: int | None = None

    def committed(now: float, at: int) -> None:
        """Note the save in flight as committed if it has (seen at step ``at``)."""
        nonlocal in_flight
        if in_flight is not None and mgr is not None and not mgr.is_saving_in_progress():
            commits.append({"step": in_flight, "t": now - t0, "seen_at": at})
            in_flight = None

    cpu0, server0 = time.process_time(), _server_cpu(server_pid)
    t0 = time.perf_counter()
    i = 0
    while i < steps or in_flight is not None or (mode == CONTINUOUS and len(saves) < cfg.min_saves):
        started = time.perf_counter()
        state, g = step(state, m)
        g.block_until_ready()
        committed(time.perf_counter(), i)
        more = i < steps or (mode == CONTINUOUS and len(saves) < cfg.min_saves)
        if mgr is not None and more and mgr.should_save(i):
            before = time.perf_counter()
            if mgr.is_saving_in_progress():  # save() would wait here too; timed apart
                mgr.wait()
            waited = time.perf_counter()
            committed(waited, i)
            mgr.save(i, state)
            in_flight = i
            saves.append(
                {"step": i, "t": before - t0, "wait_s": waited - before, "copy_s": time.perf_counter() - waited}
            )
        step_s.append(time.perf_counter() - started)
        i += 1
    loop_s = time.perf_counter() - t0
    cpu_s, server_cpu_s = time.process_time() - cpu0, _server_cpu(server_pid) - server0
    state, base_after = plain_steps(state, step, m, cfg.bracket)
    record = {
        "mode": mode,
        "interval": interval,
        "steps": steps,
        "steps_run": i,
        "loop_s": loop_s,
        "cpu_s": cpu_s,
        "server_cpu_s": server_cpu_s,
        "step_s": step_s,
        "base_step_s": base_before + base_after,
        "saves": saves,
        "commits": commits,
    }
    if mgr is not None:  # untimed: nothing is in flight by now; the kept steps are deleted
        mgr.wait()
        record["steps_kept"] = mgr.steps()
        for s in record["steps_kept"]:
            mgr.delete(s)
        mgr.close()
    jax.block_until_ready(state)
    return state, record


def _gaps(values: list[float]) -> list[float]:
    return [b - a for a, b in zip(values, values[1:])]


def summarise_run(record: dict[str, Any]) -> dict[str, Any]:
    """One run's figures against its own baseline: the mean of its bracketing steps."""
    base_step_s = statistics.mean(record["base_step_s"])
    per_step = record["loop_s"] / record["steps_run"]
    blocked = [s["wait_s"] + s["copy_s"] for s in record["saves"]]
    commit_steps = [c["step"] for c in record["commits"]]
    commit_t = [c["t"] for c in record["commits"]]
    extra = record["loop_s"] - base_step_s * record["steps_run"]
    return {
        "step_s": per_step,
        "base_step_s": base_step_s,
        "overhead_pct": 100 * (per_step / base_step_s - 1),
        "commits": len(record["commits"]),
        "interval_steps": statistics.mean(_gaps(commit_steps)) if len(commit_steps) > 1 else None,
        "interval_s": statistics.mean(_gaps(commit_t)) if len(commit_t) > 1 else None,
        "blocked_per_save_s": statistics.mean(blocked) if blocked else 0.0,
        "copy_per_save_s": statistics.mean(s["copy_s"] for s in record["saves"]) if blocked else 0.0,
        "save_to_commit_s": (
            statistics.mean(c["t"] - s["t"] for c, s in zip(record["commits"], record["saves"])) if blocked else None
        ),
        "blocked_share": sum(blocked) / extra if blocked and extra > 0 else None,
        "lost_per_save_s": extra / len(blocked) if blocked else None,
        "server_cpu_per_save_s": record["server_cpu_s"] / len(blocked) if blocked else None,
        "cpu_s_per_step": record["cpu_s"] / record["steps_run"],
        "server_cpu_s_per_step": record["server_cpu_s"] / record["steps_run"],
    }


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: the medians over rounds of each run's figures (each against its own baseline);
    ``none`` is the baselines themselves."""
    per_mode: dict[str, list[dict[str, Any]]] = {}
    for records in rounds:
        for r in records:
            key = _key(r["mode"], r["interval"])
            per_mode.setdefault(key, []).append(summarise_run(r))
    if NONE not in per_mode:
        per_mode[NONE] = [
            {**{name: None for name in run}, "step_s": run["base_step_s"], "base_step_s": run["base_step_s"]}
            | {"overhead_pct": 0.0, "commits": 0, "blocked_per_save_s": 0.0, "copy_per_save_s": 0.0}
            for runs in list(per_mode.values())
            for run in runs
        ]
    modes = {}
    for key, runs in per_mode.items():
        cells = {name: _median([run[name] for run in runs]) for name in runs[0]}
        cells["overhead_pct_range"] = [min(r["overhead_pct"] for r in runs), max(r["overhead_pct"] for r in runs)]
        cells["runs"] = len(runs)
        modes[key] = cells
    return {"modes": modes, "match": match(modes)}


def _key(mode: str, interval: int | None) -> str:
    return mode if interval is None else f"every {interval}"


def match(modes: dict[str, Any]) -> dict[str, Any]:
    """The fixed interval whose overhead equals continuous's, interpolated linearly in 1/K."""
    cont = modes.get(CONTINUOUS)
    fixed = sorted((int(k.split()[1]), v["overhead_pct"]) for k, v in modes.items() if k.startswith("every "))
    if cont is None or not fixed:
        return {}
    target = cont["overhead_pct"]
    out: dict[str, Any] = {"continuous_overhead_pct": target, "continuous_interval_steps": cont["interval_steps"]}
    for (k1, o1), (k2, o2) in zip(fixed, fixed[1:]):
        if min(o1, o2) <= target <= max(o1, o2) and o1 != o2:
            x = 1 / k1 + (target - o1) * (1 / k2 - 1 / k1) / (o2 - o1)
            out["interval_steps_at_same_overhead"] = 1 / x
            out["between"] = [k1, k2]
            return out
    nearest = min(fixed, key=lambda kv: abs(kv[1] - target))
    out["interval_steps_at_same_overhead"] = None
    out["nearest_measured"] = {"interval": nearest[0], "overhead_pct": nearest[1]}
    return out


def measure(
    cfg: Config,
    new_url: Callable[[], str],
    storage_options: dict[str, Any],
    server_pid: int | None = None,
    log: Callable[[str], None] = print,
    after_run: Callable[[], None] = lambda: None,
    after_round: Callable[[dict[str, Any]], None] = lambda report: None,
) -> dict[str, Any]:
    """Every round runs every mode once, the order rotated; K comes from the first continuous run
    unless ``cfg.intervals`` fixes it."""
    state = make_state(cfg.mib, cfg.leaves)
    step, m = make_step(cfg.matmul, cfg.layers)
    for _ in range(cfg.warmup):
        state, g = step(state, m)
    jax.block_until_ready(state)
    intervals = list(cfg.intervals)
    rounds: list[list[dict[str, Any]]] = []
    for rnd in range(cfg.repeats):
        plan: list[tuple[str, int | None]] = [(CONTINUOUS, None)]
        if intervals:
            plan += [("interval", k) for k in intervals]
        if rnd > 0:  # round 0 runs continuous first: its interval sets K
            shift = rnd % len(plan)
            plan = plan[shift:] + plan[:shift]
        records = []
        pending = [p for p in plan]
        while pending:
            mode, interval = pending.pop(0)
            state, rec = run_mode(mode, interval, state, step, m, cfg, new_url(), storage_options, server_pid)
            records.append(rec)
            after_run()
            log(
                f"round {rnd} {_key(mode, interval)}: {rec['loop_s']:.1f} s for {rec['steps_run']} steps, "
                f"{len(rec['saves'])} saves, {len(rec['commits'])} commits"
            )
            if mode == CONTINUOUS and not intervals:
                steps = [c["step"] for c in rec["commits"]]
                reached = statistics.mean(_gaps(steps)) if len(steps) > 1 else cfg.steps / 2
                intervals = sorted({max(1, round(reached * f)) for f in cfg.factors})
                pending += [("interval", k) for k in intervals]
        rounds.append(records)
        report = summarise(rounds)
        report.update(
            config=asdict(cfg),
            state_bytes=sum(x.nbytes for x in state.values()),
            devices=jax.device_count(),
            intervals=intervals,
            rounds=rounds,
        )
        after_round(report)
    return report


def table(report: dict[str, Any]) -> str:
    """docs/PERFORMANCE.md's table from a report."""
    lines = [
        "| mode | step (s) | step overhead | commits | interval (steps) | interval (s) | blocked per save (s) "
        "| training lost per save (s) | save to commit (s) | blocked share of loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def num(v: Any, fmt: str) -> str:
        return "—" if v is None else format(v, fmt)

    for key, c in sorted(report["modes"].items(), key=lambda kv: _order(kv[0])):
        lo, hi = c["overhead_pct_range"]
        lines.append(
            f"| {key} | {c['step_s']:.3f} | {c['overhead_pct']:.1f}% ({lo:.1f}–{hi:.1f}) | {num(c['commits'], '.0f')} | "
            f"{num(c['interval_steps'], '.1f')} | {num(c['interval_s'], '.1f')} | {c['blocked_per_save_s']:.2f} | "
            f"{num(c['lost_per_save_s'], '.1f')} | "
            f"{num(c['save_to_commit_s'], '.1f')} | {num(c['blocked_share'], '.0%')} |"
        )
    mt = report.get("match", {})
    if mt.get("interval_steps_at_same_overhead") is not None:
        lines.append("")
        lines.append(
            f"At continuous's overhead ({mt['continuous_overhead_pct']:.1f}%), `save_interval_steps` would be "
            f"{mt['interval_steps_at_same_overhead']:.1f} steps (between {mt['between'][0]} and {mt['between'][1]}); "
            f"continuous reached {num(mt['continuous_interval_steps'], '.1f')}."
        )
    return "\n".join(lines)


def _order(key: str) -> tuple[int, int]:
    return (0, 0) if key == NONE else (1, 0) if key == CONTINUOUS else (2, int(key.split()[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=None, help="state size (default 1024; 256 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 160; 60 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 3; 1 with --quick)")
    parser.add_argument("--factors", default="0.5,1,2", help="K as multiples of continuous's interval")
    parser.add_argument("--intervals", default="", help="fixed K values (instead of --factors)")
    parser.add_argument("--rtt-ms", type=float, default=10.0)
    parser.add_argument("--matmul", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--report", metavar="JSON", help="summarise a finished run's rounds again and print the table")
    args = parser.parse_args(argv)
    if args.report:
        kept = json.loads(Path(args.report).read_text())
        kept.update(summarise(kept["rounds"]))
        Path(args.report).write_text(json.dumps(kept, indent=1) + "\n")
        print(table(kept))
        return 0
    cfg = Config(
        mib=args.mib or (256 if args.quick else 1024),
        steps=args.steps or (60 if args.quick else 160),
        repeats=args.repeats or (1 if args.quick else 3),
        factors=tuple(float(f) for f in args.factors.split(",") if f),
        intervals=tuple(int(k) for k in args.intervals.split(",") if k),
        rtt_ms=args.rtt_ms,
        matmul=args.matmul,
        layers=args.layers,
    )
    from backends.launcher import start_s3
    from backends.proxy import FaultProxy

    started = time.perf_counter()
    load = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / (args.out or ("continuous-quick.json" if args.quick else "continuous.json"))

    def write(report: dict[str, Any]) -> None:  # after every round, so a cut-short run keeps its rounds
        report.update(
            store=f"S3 (SeaweedFS on loopback) through backends.proxy.FaultProxy at {cfg.rtt_ms:g} ms RTT",
            load_before=load,
            load_now=os.getloadavg(),
            run_s=time.perf_counter() - started,
        )
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(table(report), flush=True)

    with start_s3() as s3:
        so = s3.storage_options()
        proxy = None
        if cfg.rtt_ms:
            port = int(s3.endpoint_url.rsplit(":", 1)[1])
            proxy = FaultProxy("127.0.0.1", port, latency_ms=cfg.rtt_ms).start()
            so = {**so, "client_kwargs": {**so["client_kwargs"], "endpoint_url": proxy.endpoint_url}}
        run_id = uuid.uuid4().hex[:8]
        try:
            report = measure(
                cfg,
                lambda: s3.url(f"continuous/{run_id}/{uuid.uuid4().hex[:8]}"),
                so,
                server_pid=s3.pid,
                after_run=lambda: vacuum(s3),
                after_round=write,
            )
        finally:
            if proxy is not None:
                proxy.stop()
    print(f"\n{out} ({report['run_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
