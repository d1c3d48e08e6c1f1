"""The report of a rivals run: medians and ratios per cell, the targets checked, the markdown tables.

Kept apart from ``benchmarks/bench_rivals.py``, which runs the measurements: these
functions read only the samples, so a finished run's JSON can be summarized again
(``summarize(json.load(f)["samples"])``) after a change to the report alone.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.rivals import SYSTEMS, workloads
from benchmarks.rivals.common import BLOB_SIZE, CONCURRENCY

GiB = 1 << 30
MiB = 1 << 20
# What one cell is the median of. ``transport`` ("http" | "https") keeps a run's HTTP and HTTPS
# rows apart; samples from before it existed were all plain HTTP.
KEY_FIELDS = ("store", "profile_ms", "transport", "workload", "system", "phase")
TRANSPORTS = ("http", "https")


def field_of(row: dict[str, Any], name: str) -> Any:
    """``row[name]``, with the default for a sample or cell written before the field existed."""
    return row.get("transport", "http") if name == "transport" else row[name]


def _where(store: str, ms: int, transport: str, workload: str) -> str:
    """A cell's place in the targets: "s3 10 ms medium", and "... over https" for HTTPS."""
    return f"{store} {ms} ms {workload}" + (f" over {transport}" if transport != "http" else "")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and min–max per (store, profile, transport, workload, system, phase), ratios, target checks."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    skipped: dict[tuple, str] = {}
    errors: dict[tuple, list[str]] = {}
    for row in rows:
        key = tuple(field_of(row, field) for field in KEY_FIELDS)
        if "skipped" in row:
            skipped[key] = row["skipped"]
        elif "error" in row:
            errors.setdefault(key, []).append(row["error"])
        else:
            groups.setdefault(key, []).append(row)
    cells = []
    for key, samples in sorted(groups.items()):
        store, ms, transport, workload, system, phase = key
        secs = [s["seconds"] for s in samples]
        nbytes = samples[0]["bytes"]
        med = statistics.median(secs)

        def med_of(field: str, samples: list[dict[str, Any]] = samples) -> float | None:
            vals = [s[field] for s in samples if s.get(field) is not None]
            return statistics.median(vals) if vals else None

        cells.append(
            {
                **dict(zip(KEY_FIELDS, key)),
                "n": len(samples),
                "bytes": nbytes,
                "seconds_median": med,
                "seconds_min": min(secs),
                "seconds_max": max(secs),
                "gib_s_median": nbytes / med / GiB,
                "gib_s_min": nbytes / max(secs) / GiB,
                "gib_s_max": nbytes / min(secs) / GiB,
                "cpu_s_per_gib": med_of("cpu_s") / (nbytes / GiB),
                "peak_rss_mib": med_of("peak_rss") / MiB,
                "peak_above_start_mib": statistics.median(s["peak_rss"] - s["rss_before"] for s in samples) / MiB,
                "requests": med_of("requests"),
                "proxy_requests": med_of("proxy_requests"),
                "objects": med_of("objects_listed"),
                "verified": all(s.get("verified", True) for s in samples),
                "errors": errors.get(key, []),
            }
        )
    for key, why in sorted(skipped.items()):
        cells.append({**dict(zip(KEY_FIELDS, key)), "skipped": why})
    for key, errs in sorted(errors.items()):
        if key not in groups:
            cells.append({**dict(zip(KEY_FIELDS, key)), "errors": errs})
    return {"cells": cells, "checks": check_targets(cells), "references": reference_ratios(cells)}


def _cell(cells: list[dict], **key: Any) -> dict | None:
    for c in cells:
        if all(field_of(c, k) == v for k, v in key.items()) and "gib_s_median" in c:
            return c
    return None


def reference_ratios(cells: list[dict]) -> list[dict[str, Any]]:
    """objckpt's restore over the raw GETs that keep every response: not a target, but
    what a gap to the (dropping) raw GETs is made of (``benchmarks/rivals/raw.py`` says)."""
    ratios = []
    for converted in cells:
        if (
            converted.get("system") == "from_orbax"
            and converted.get("phase") == "convert"
            and "gib_s_median" in converted
        ):
            key = {field: field_of(converted, field) for field in ("store", "profile_ms", "transport", "workload")}
            ratios.append(
                {
                    "ratio": "Orbax → objckpt conversion, GiB/s (same store)",
                    "where": _where(key["store"], key["profile_ms"], key["transport"], key["workload"]),
                    "value": round(converted["gib_s_median"], 3),
                }
            )
    for kept in cells:
        if kept.get("system") != "raw" or kept.get("phase") != "restore_kept" or "gib_s_median" not in kept:
            continue
        key = {field: field_of(kept, field) for field in ("store", "profile_ms", "transport", "workload")}
        ours = _cell(cells, system="objckpt", phase="restore", **key)
        if ours:
            ratios.append(
                {
                    "ratio": "restore / raw GETs that keep every response",
                    "where": _where(key["store"], key["profile_ms"], key["transport"], key["workload"]),
                    "value": round(ours["gib_s_median"] / kept["gib_s_median"], 3),
                }
            )
    return ratios


def check_targets(cells: list[dict]) -> list[dict[str, Any]]:
    """The issue's targets, each with the numbers it compares and pass/fail."""
    checks: list[dict[str, Any]] = []

    def add(what: str, where: str, value: float, limit: float, ok: bool) -> None:
        checks.append({"target": what, "where": where, "value": round(value, 3), "limit": round(limit, 3), "pass": ok})

    combos = sorted({(c["store"], c["profile_ms"], field_of(c, "transport"), c["workload"]) for c in cells})
    for store, ms, transport, workload in combos:
        where = _where(store, ms, transport, workload)
        key = {"store": store, "profile_ms": ms, "transport": transport, "workload": workload}
        _check_reading_orbax(cells, key, where, add)
        ours_save = _cell(cells, system="objckpt", phase="save", **key)
        ours_restore = _cell(cells, system="objckpt", phase="restore", **key)
        if ours_save is None or ours_restore is None:
            continue
        raw_save = _cell(cells, system="raw", phase="save", **key)
        raw_restore = _cell(cells, system="raw", phase="restore", **key)
        if workload in ("medium", "large") and raw_save and raw_restore:
            r = ours_save["gib_s_median"] / raw_save["gib_s_median"]
            add("save ≥ 0.9× raw PUT", where, r, 0.9, r >= 0.9)
            r = ours_restore["gib_s_median"] / raw_restore["gib_s_median"]
            add("restore ≥ 0.9× raw GET", where, r, 0.9, r >= 0.9)
        for peer in ("orbax", "dcp", "naive"):
            for phase, ours in (("save", ours_save), ("restore", ours_restore)):
                theirs = _cell(cells, system=peer, phase=phase, **key)
                if theirs is None:
                    continue
                r = ours["gib_s_median"] / theirs["gib_s_median"]
                if workload == "small" and peer != "orbax":
                    continue
                what = f"{phase} no slower than {peer}" if workload == "small" else f"{phase} ahead of {peer}"
                add(what, where, r, 1.0, r >= 1.0 if workload == "small" else r > 1.0)
        resharded = _cell(cells, system="objckpt", phase="restore_resharded", **key)
        if resharded:
            r = resharded["seconds_median"] / ours_restore["seconds_median"]
            add("resharded restore ≤ 1.1× same-sharding", where, r, 1.1, r <= 1.1)
        restored_mib = ours_restore["bytes"] / MiB
        for phase_cell, label in ((ours_restore, "restore"), (resharded, "resharded restore")):
            if phase_cell:
                v = phase_cell["peak_above_start_mib"]
                add(
                    f"{label} peak RSS ≤ restored bytes + 256 MiB (MiB above start)",
                    where,
                    v,
                    restored_mib + 256,
                    v <= restored_mib + 256,
                )
        from objckpt.options import Options

        budget = Options().memory_budget / MiB
        v = ours_save["peak_above_start_mib"]
        add(
            "save peak RSS ≤ memory budget + 256 MiB above live arrays (MiB)", where, v, budget + 256, v <= budget + 256
        )
    return checks


def _check_reading_orbax(cells: list[dict], key: dict[str, Any], where: str, add: Any) -> None:
    """Orbax's checkpoint restored by objckpt (``from_orbax``): ≥ 1.0× Orbax's own restore,
    peak RSS ≤ the restored bytes + 256 MiB, onto the saved mesh and onto another."""
    theirs = _cell(cells, system="orbax", phase="restore", **key)
    for phase, label in (("restore", "restore"), ("restore_resharded", "resharded restore")):
        ours = _cell(cells, system="from_orbax", phase=phase, **key)
        if ours is None:
            continue
        if theirs is not None:
            r = ours["gib_s_median"] / theirs["gib_s_median"]
            add(f"Orbax checkpoint: objckpt {label} ≥ 1.0× Orbax's own restore", where, r, 1.0, r >= 1.0)
        v = ours["peak_above_start_mib"]
        limit = ours["bytes"] / MiB + 256
        add(f"Orbax checkpoint: objckpt {label} peak RSS ≤ restored bytes + 256 MiB", where, v, limit, v <= limit)


def markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    cells = summary["cells"]
    lines = [
        f"# objckpt vs rivals — {meta['started']}",
        "",
        f"{meta['machine']}. objckpt at {meta.get('git_commit', '?')} (sources {meta.get('objckpt_source', '?')}"
        + (", CHANGED DURING THE RUN" if meta.get("objckpt_source_changes") else "")
        + f"). Repeats: {meta['repeats']} (interleaved; medians, [min–max]). "
        f"Raw ceiling: {meta['raw_client']}, {BLOB_SIZE // MiB} MiB objects, {CONCURRENCY} in flight. "
        + (
            "Latency: the network's own (the 0 ms rows add none). "
            if meta.get("real_buckets")
            else "Latency: a user-space TCP proxy adding the RTT (backends/proxy.py). "
        )
        + (
            "Transport: each cell over HTTP and over HTTPS (test CA; TLS ends in a TLS front before the "
            "server at 0 ms, in the latency proxy at 10/40 ms, so handshakes pay no added RTT). "
            if meta.get("https")
            else ""
        )
        + "CPU = client CPU seconds per GiB (all threads; the s3fs-fuse daemon added for Orbax on S3). "
        "Peak = VmHWM during the phase, and in brackets above the RSS at its start "
        "(save: live arrays already built; restore: after imports and target set-up).",
        "",
    ]
    combos = sorted({(c["workload"], c["store"]) for c in cells}, key=lambda k: (workloads.NAMES.index(k[0]), k[1]))
    for workload, store in combos:
        wl = workloads.get(workload)
        lines += [
            f"## {workload} ({wl.nbytes / MiB:.0f} MiB, {wl.n_leaves} leaves) on {store}",
            "",
            "| RTT | transport | system | save s | save GiB/s [min–max] | restore s | restore GiB/s [min–max] | save CPU/GiB | restore CPU/GiB | save peak MiB | restore peak MiB | requests save/restore | objects |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        here = [c for c in cells if c["workload"] == workload and c["store"] == store]
        places = sorted({(c["profile_ms"], TRANSPORTS.index(field_of(c, "transport"))) for c in here})
        for ms, t in places:
            transport = TRANSPORTS[t]
            key = {"store": store, "profile_ms": ms, "transport": transport, "workload": workload}
            at = f"{ms} ms | {transport}"
            for system in SYSTEMS:
                s = _cell(cells, system=system, phase="save", **key)
                r = _cell(cells, system=system, phase="restore", **key)
                skip = next(
                    (
                        c
                        for c in cells
                        if c.get("system") == system
                        and "skipped" in c
                        and all(field_of(c, k) == v for k, v in key.items())
                    ),
                    None,
                )
                err = next(
                    (
                        c
                        for c in cells
                        if c.get("system") == system
                        and c.get("errors")
                        and "gib_s_median" not in c
                        and all(field_of(c, k) == v for k, v in key.items())
                    ),
                    None,
                )
                label = "orbax (s3fs-fuse)" if system == "orbax" and store == "s3" else system
                if skip:
                    lines.append(f"| {at} | {label} | — | skipped: {skip['skipped']} | | | | | | | | |")
                    continue
                if s is None and err:
                    lines.append(f"| {at} | {label} | — | error: {err['errors'][0][:120]} | | | | | | | | |")
                    continue
                if s is None:
                    continue

                def fmt(c: dict | None, col: str) -> str:
                    if c is None:
                        return "—"
                    if col == "s":
                        return f"{c['seconds_median']:.2f}"
                    if col == "gib":
                        bad = "" if c["verified"] else " ✗"
                        return f"{c['gib_s_median']:.3f} [{c['gib_s_min']:.3f}–{c['gib_s_max']:.3f}]{bad}"
                    if col == "cpu":
                        return f"{c['cpu_s_per_gib']:.2f}"
                    if col == "peak":
                        return f"{c['peak_rss_mib']:.0f} (+{c['peak_above_start_mib']:.0f})"
                    return ""

                req_s = s.get("requests") if s.get("requests") is not None else s.get("proxy_requests")
                req_r = (
                    (r or {}).get("requests")
                    if (r or {}).get("requests") is not None
                    else (r or {}).get("proxy_requests")
                )
                reqs = f"{req_s:.0f}/{req_r:.0f}" if req_s is not None and req_r is not None else "—"
                objs = f"{s['objects']:.0f}" if s.get("objects") is not None else "—"
                lines.append(
                    f"| {at} | {label} | {fmt(s, 's')} | {fmt(s, 'gib')} | {fmt(r, 's')} | {fmt(r, 'gib')} | "
                    f"{fmt(s, 'cpu')} | {fmt(r, 'cpu')} | {fmt(s, 'peak')} | {fmt(r, 'peak')} | {reqs} | {objs} |"
                )
                for phase, what in (
                    ("restore_resharded", "restore onto another sharding"),
                    ("restore_kept", "the same GETs, every response kept"),
                ):
                    rr = _cell(cells, system=system, phase=phase, **key)
                    if rr:
                        req = f"/{rr['requests']:.0f}" if rr.get("requests") is not None else "—"
                        lines.append(
                            f"| {at} | {system} ({what}) | | | {fmt(rr, 's')} | {fmt(rr, 'gib')} | | "
                            f"{fmt(rr, 'cpu')} | | {fmt(rr, 'peak')} | {req} | |"
                        )
        lines.append("")
    lines += ["## Targets", "", "| target | where | value | limit | |", "|---|---|---|---|---|"]
    for c in summary["checks"]:
        lines.append(
            f"| {c['target']} | {c['where']} | {c['value']} | {c['limit']} | {'pass' if c['pass'] else '**FAIL**'} |"
        )
    if summary.get("references"):
        lines += ["", "## Reference (not targets)", "", "| ratio | where | value |", "|---|---|---|"]
        lines += [f"| {r['ratio']} | {r['where']} | {r['value']} |" for r in summary["references"]]
    lines += [
        "",
        "Ratios compare medians within this run. Requests: objckpt's own count; for the others, requests "
        "seen by the latency proxy (so only at 10/40 ms). Objects: listed after the save. "
        "The raw restore drops each response as it lands (the store's limit, the targets' yardstick); "
        '"the same GETs, every response kept" holds them all, as a restore must hold what it read '
        "(benchmarks/rivals/raw.py says why the two differ).",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
