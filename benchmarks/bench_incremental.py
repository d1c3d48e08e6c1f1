"""Incremental checkpoints (issue 63, part 1): bytes uploaded and time of ``save(..., base=...)``.

On the local S3 server (SeaweedFS) through ``backends.proxy.FaultProxy`` at 10 ms RTT, with a
1 GiB float32 state of 128 leaves of 8 MiB, each sharded over 8 CPU devices (1,024 pieces of
1 MiB). Each repeat, interleaved, into fresh prefixes:

- ``full``: a plain save (no digest): the baseline;
- ``full_sha256``: the same with ``Options(digest="sha256")`` (what a base needs);
- ``all_changed``: every piece changed, saved with ``base=`` the previous step: the digest's
  whole cost when nothing can be referenced (target ≤ 1.10× ``full``);
- ``changed_0.1%``: one piece of 1,024 changed (target: ≤ 5 % of the bytes uploaded,
  ≤ 0.3× ``full``'s time).

Then, once: 8 equal leaves of 16 MiB, one changed (target: ≤ 1.3× that leaf's bytes plus
metadata), and ``CheckpointManager(incremental=True, retention=Retention(keep_last=1))``: after retention deleted the
base and gc ran, the step restores bit-exact and verifies.

Bytes are the transfer engine's ``bytes_written``. The machine's 2 cores are shared: times are
medians of ``--repeats``.

    python -m benchmarks.bench_incremental [--repeats 3] [--rtt-ms 10]

Writes ``benchmarks/results/incremental.json`` and ``incremental.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import objckpt  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LEAVES, ROWS, COLS = 128, 2048, 1024  # 128 leaves of 8 MiB: 1 GiB, 1,024 pieces of 1 MiB on 8 devices
SHA = objckpt.Options(digest="sha256")


def _state(leaves: int, rows: int, seed: int = 0) -> dict[str, jax.Array]:
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
    key = jax.random.key(seed)
    return {
        f"l{i:03d}": jax.device_put(jax.random.normal(jax.random.fold_in(key, i), (rows, COLS), jnp.float32), sharding)
        for i in range(leaves)
    }


def _timed_save(url: str, tree: Any, so: dict[str, Any], **kw: Any) -> dict[str, float]:
    started = time.perf_counter()
    stats = objckpt.save(url, tree, storage_options=so, **kw)
    return {"s": time.perf_counter() - started, "bytes": stats.bytes_written}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in b)


def one_repeat(root: str, so: dict[str, Any], state: dict[str, jax.Array], order: list[str]) -> dict[str, Any]:
    """The four saves of one repeat, under ``root``; ``order``: which of the baselines goes first."""
    everything = jax.tree.map(lambda x: x + 1.0, state)  # every piece differs from ``state``
    first = next(iter(state))
    host = np.array(state[first])
    host[0] += 1.0  # a row of device 0's piece of one leaf
    one_piece = {**state, first: jax.device_put(host, state[first].sharding)}
    jax.block_until_ready((everything, one_piece))
    out: dict[str, Any] = {}
    for name in order:
        if name == "full":
            out["full"] = _timed_save(f"{root}/plain", state, so)
        else:
            out["full_sha256"] = _timed_save(f"{root}/step_1", state, so, options=SHA)
    out["all_changed"] = _timed_save(f"{root}/step_2", everything, so, base=f"{root}/step_1")
    out["changed_0.1%"] = _timed_save(f"{root}/step_3", one_piece, so, base=f"{root}/step_1")
    restored = objckpt.restore(f"{root}/step_3", storage_options=so)
    out["restored_bit_exact"] = _equal(restored, one_piece)
    return out


def one_of_eight(root: str, so: dict[str, Any]) -> dict[str, Any]:
    state = _state(8, 4096, seed=1)  # 8 leaves of 16 MiB
    leaf = next(iter(state.values())).nbytes
    objckpt.save(f"{root}/step_1", state, storage_options=so, options=SHA)
    changed = {**state, "l003": state["l003"] * 2.0}
    stats = objckpt.save(f"{root}/step_2", changed, storage_options=so, base=f"{root}/step_1")
    return {"leaf_bytes": leaf, "bytes": stats.bytes_written, "ratio": stats.bytes_written / leaf}


def retention_then_gc(root: str, so: dict[str, Any]) -> dict[str, Any]:
    state = _state(8, 1024, seed=2)
    with objckpt.CheckpointManager(
        root, storage_options=so, retention=objckpt.Retention(keep_last=1), incremental=True
    ) as mgr:
        mgr.save(1, state, force=True, wait=True)
        state = {**state, "l005": state["l005"] - 1.0}
        mgr.save(2, state, force=True, wait=True)
        deleted = mgr.gc(grace_seconds=0)
        restored = mgr.restore(2)
        report = objckpt.verify(mgr.step_url(2), storage_options=so)
        steps = mgr.steps()
    return {
        "steps_left": steps,
        "gc_deleted": len(deleted),
        "restored_bit_exact": _equal(restored, state),
        "verify_ok": report.ok,
        "verify_bytes_read": report.bytes_read,
    }


def _median(runs: list[dict[str, Any]], name: str, key: str) -> float:
    return statistics.median(r[name][key] for r in runs)


def summarise(runs: list[dict[str, Any]], total: int) -> dict[str, Any]:
    full = _median(runs, "full", "s")
    out: dict[str, Any] = {"state_bytes": total}
    for name in ("full", "full_sha256", "all_changed", "changed_0.1%"):
        out[name] = {
            "s_median": _median(runs, name, "s"),
            "s_all": [r[name]["s"] for r in runs],
            "bytes_median": _median(runs, name, "bytes"),
            "time_vs_full": _median(runs, name, "s") / full,
            "bytes_vs_state": _median(runs, name, "bytes") / total,
        }
    return out


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [
        f"1 GiB ({report['pieces']} pieces of 1 MiB on 8 CPU devices), S3 (SeaweedFS) at {report['rtt_ms']:g} ms RTT;"
        f" medians of {report['repeats']} repeats. Load before: {report['load_before']}.",
        "",
        "| save | seconds | × full | bytes uploaded | of the state |",
        "|---|---|---|---|---|",
    ]
    for name in ("full", "full_sha256", "all_changed", "changed_0.1%"):
        c = s[name]
        lines.append(
            f"| {name} | {c['s_median']:.2f} | {c['time_vs_full']:.2f} | {c['bytes_median']:,.0f} |"
            f" {100 * c['bytes_vs_state']:.2f} % |"
        )
    o = report["one_of_eight"]
    r = report["retention_then_gc"]
    t = report["targets"]
    lines += [
        "",
        f"1 of 8 leaves of 16 MiB changed: {o['bytes']:,} bytes uploaded, {o['ratio']:.3f}× the leaf.",
        f"Retention (keep_last=1) deleted the base, gc deleted {r['gc_deleted']} objects: steps {r['steps_left']},"
        f" restored bit-exact {r['restored_bit_exact']}, verify ok {r['verify_ok']}.",
        "",
        "Targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in t.items()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rtt-ms", type=float, default=10.0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "incremental"))
    args = parser.parse_args(argv)
    from backends.launcher import start_s3
    from backends.proxy import FaultProxy

    load = os.getloadavg()
    state = _state(LEAVES, ROWS)
    total = sum(v.nbytes for v in state.values())
    runs: list[dict[str, Any]] = []
    with start_s3() as s3:
        so = s3.storage_options()
        proxy = None
        if args.rtt_ms:
            port = int(s3.endpoint_url.rsplit(":", 1)[1])
            proxy = FaultProxy("127.0.0.1", port, latency_ms=args.rtt_ms).start()
            so = {**so, "client_kwargs": {**so["client_kwargs"], "endpoint_url": proxy.endpoint_url}}
        run = uuid.uuid4().hex[:8]
        try:
            for i in range(args.repeats):
                order = ["full", "full_sha256"] if i % 2 == 0 else ["full_sha256", "full"]
                runs.append(one_repeat(s3.url(f"incremental/{run}/r{i}"), so, state, order))
                print(json.dumps(runs[-1]), flush=True)
            eight = one_of_eight(s3.url(f"incremental/{run}/eight"), so)
            kept = retention_then_gc(s3.url(f"incremental/{run}/manager"), so)
        finally:
            if proxy is not None:
                proxy.stop()
    summary = summarise(runs, total)
    targets = {
        "1-of-8 ≤ 1.3× leaf + metadata": eight["bytes"] <= 1.3 * eight["leaf_bytes"] + (64 << 10),
        "0.1 % changed uploads ≤ 5 %": summary["changed_0.1%"]["bytes_vs_state"] <= 0.05,
        "0.1 % changed takes ≤ 0.3× full": summary["changed_0.1%"]["time_vs_full"] <= 0.3,
        "digest (all changed) ≤ 1.10× full": summary["all_changed"]["time_vs_full"] <= 1.10,
        "after retention + gc: bit-exact and verifies": kept["restored_bit_exact"] and kept["verify_ok"],
        "every restore bit-exact": all(r["restored_bit_exact"] for r in runs),
    }
    report = {
        "repeats": args.repeats,
        "rtt_ms": args.rtt_ms,
        "pieces": LEAVES * 8,
        "load_before": [round(x, 2) for x in load],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "runs": runs,
        "summary": summary,
        "one_of_eight": eight,
        "retention_then_gc": kept,
        "targets": targets,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
