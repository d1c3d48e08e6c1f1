"""The markdown tables of ``bench_scale``: the save side per device count, and each target's
worst and median host against issue #54's limits (✗ where the worst host misses one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.scale.state import TARGETS

KiB, MiB = 1 << 10, 1 << 20
SAVE_PUTS_LIMIT = 60_000  # issue 80: PUTs of the whole 1T save (issue 54's 405B: 50,000)


def _mib(x: float) -> str:
    return f"{x / MiB:.2f} MiB"


def _size(x: float) -> str:
    return f"{x / MiB:.2f} MiB" if x < 1 << 30 else f"{x / (1 << 30):.2f} GiB"


Row = tuple[str, str, Callable[[Any], str], str | None, Callable[[Any], bool] | None]

# (label, field, format, target text, passes); target None: information only.
SAVE_ROWS: list[Row] = [
    ("state", "state_bytes", lambda v: f"{v / 1e12:.2f} TB", None, None),
    ("leaves / processes", "leaves", str, None, None),
    ("save plan CPU-s (host 1)", "save_plan_cpu_s", lambda v: f"{v:.3f}", "≤ 1", lambda v: v <= 1),
    ("save plan CPU-s (host 0, primary)", "save_plan_cpu_s_primary", lambda v: f"{v:.3f}", "≤ 1", lambda v: v <= 1),
    ("pieces / blobs (host 1)", "save_pieces", str, None, None),
    ("bytes per PUT (host 1)", "bytes_per_put", _mib, "≥ 16 MiB", lambda v: v >= 16 * MiB),
    ("PUTs, whole save", "save_puts", lambda v: f"{v:,}", f"≤ {SAVE_PUTS_LIMIT:,}", lambda v: v <= SAVE_PUTS_LIMIT),
    ("index object (host 1)", "index_bytes", lambda v: f"{v / KiB:.0f} KiB", None, None),
    ("index encode CPU-s (host 1)", "index_encode_cpu_s", lambda v: f"{v:.3f}", None, None),
    ("coordination bytes / process", "coordination_bytes", lambda v: f"{v} B", "≤ 4 KiB", lambda v: v <= 4 * KiB),
    ("primary commit CPU-s", "commit_cpu_s", lambda v: f"{v:.3f}", "≤ 5", lambda v: v <= 5),
    ("root manifest", "root_bytes", _mib, "≤ 16 MiB", lambda v: v <= 16 * MiB),
]


def restore_rows(target: str, cpu_limit: float = 2.0) -> list[Row]:
    """Issue #54's limits for one target (``cpu_limit``: its parse + plan CPU-s per host)."""
    same = target == "same"
    return [
        ("index objects read", "index_objects_read", str, None, None),
        ("metadata read", "metadata_bytes", _mib, "≤ 64 MiB", lambda v: v <= 64 * MiB),
        ("parse+plan CPU-s", "parse_plan_cpu_s", lambda v: f"{v:.2f}", f"≤ {cpu_limit:g}", lambda v: v <= cpu_limit),
        ("extra peak", "extra_peak_mib", lambda v: f"{v:.0f} MiB", "≤ 256 MiB", lambda v: v <= 256),
        (
            "GETs / 16 MiB",
            "gets_per_16mib",
            lambda v: f"{v:.2f}",
            "≤ 1" if same else "≤ 4",
            (lambda v: v <= 1) if same else (lambda v: v <= 4),
        ),
        (
            "bytes fetched ÷ needed",
            "amplification",
            lambda v: f"{v:.2f}",
            "1.0" if same else "≤ 1.5",
            (lambda v: round(v, 4) == 1.0) if same else (lambda v: v <= 1.5),
        ),
        # Reported beside the reads, no limit: the reshard's bytes into the host's devices.
        ("moved between devices", "moved_bytes", _size, None, None),
    ]


def passes(record: dict[str, Any]) -> dict[str, bool]:
    """Per bounded figure of a target record: whether its worst host meets the limit."""
    rows = restore_rows(record["target_mesh"], record.get("cpu_limit_s", 2.0))
    return {key: ok(record["worst"][key]) for _, key, _, _, ok in rows if ok is not None}


def markdown(records: list[dict[str, Any]], layout: str) -> str:
    """One layout's tables: the save side by device count, then per target and figure the worst
    host (its id) / the median host at each device count."""
    mine = [r for r in records if r["layout"] == layout]
    counts = sorted({r["devices"] for r in mine})
    find = {(r["devices"], r["target_mesh"]): r for r in mine}
    head = " | ".join(f"{n} devices" for n in counts)
    lines = [f"### {layout}", "", f"| save side | {head} | target |", "|---|" + "---:|" * len(counts) + "---|"]
    for label, key, fmt, goal, ok in SAVE_ROWS:
        cells = []
        for n in counts:
            r = find.get((n, None))
            if r is None or key not in r:
                cells.append("n/a")
                continue
            text = fmt(r[key])
            if key == "leaves":
                text = f"{r[key]} / {r['processes']}"
            elif key == "save_pieces":
                text = f"{r[key]} / {r['save_blobs']}"
            cells.append(text + (" ✗" if ok is not None and not ok(r[key]) else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {goal or ''} |")
    lines += ["", f"| target: worst host (id) / median | {head} | target |", "|---|" + "---:|" * len(counts) + "---|"]
    for target in TARGETS:
        some = next((r for r in mine if r["target_mesh"] == target and "worst" in r), None)
        limit = some.get("cpu_limit_s", 2.0) if some else 2.0
        for label, key, fmt, goal, ok in restore_rows(target, limit):
            cells = []
            for n in counts:
                r = find.get((n, target))
                if r is None or key not in r.get("worst", {}):
                    cells.append("n/a")
                    continue
                worst, median = r["worst"][key], r["median"][key]
                mark = " ✗" if ok is not None and not ok(worst) else ""
                cells.append(f"{fmt(worst)}{mark} (h{r['worst_host'][key]}) / {fmt(median)}")
            lines.append(f"| {target}: {label} | " + " | ".join(cells) + f" | {goal or ''} |")
    measured = sorted({str(r.get("layers_measured")) for r in mine if r["target_mesh"] is None})
    fitted = any(r.get("extrapolated") for r in mine)
    layers = max((r["layers"] for r in mine if "layers" in r), default=0)
    note = f" (of {layers}; extrapolated to {layers} on a straight line)" if fitted else f" (of {layers})"
    lines += ["", f"Layers measured: {', '.join(measured)}{note}."]
    return "\n".join(lines)


def docs_table(records: list[dict[str, Any]], devices: int) -> str:
    """docs/PERFORMANCE.md's "Pod scale" table: at ``devices``, per target and layout the worst
    host's figure / the median host's (the worst host's id), each marked pass or FAIL."""
    from benchmarks.scale.state import TARGET_TEXT

    find = {(r["layout"], r["target_mesh"]): r for r in records if r["devices"] == devices}
    keys: tuple[str, ...] = (
        "index_objects_read",
        "metadata_bytes",
        "parse_plan_cpu_s",
        "gets_per_16mib",
        "amplification",
    )
    keys += ("moved_bytes", "extra_peak_mib")
    head = "index objects read | metadata read | parse + plan CPU-s | GETs per 16 MiB | fetched ÷ needed"
    head += " | moved between devices (worst host) | extra peak"
    lines = [
        f"| target (hosts: sampled / all) | layout | {head} |",
        "|---|---|" + "---|" * len(keys),
        "| limit | | | ≤ 64 MiB | ≤ 2 | ≤ 4 (same mesh ≤ 1) | ≤ 1.5 (same mesh 1.0) | reported | ≤ 256 MiB |",
    ]
    for target in TARGETS:
        for layout in ("unstacked", "stacked"):
            r = find.get((layout, target))
            if r is None or "worst" not in r:
                continue
            rows = {key: (fmt, ok) for _, key, fmt, _, ok in restore_rows(target, r.get("cpu_limit_s", 2.0))}
            cells = []
            for key in keys:
                fmt, ok = rows[key]
                if key not in r["worst"]:  # a record from before the figure was measured
                    cells.append("n/a")
                    continue
                text = f"{fmt(r['worst'][key])} / {fmt(r['median'][key])} (h{r['worst_host'][key]})"
                if ok is not None:
                    text += " pass" if ok(r["worst"][key]) else " **FAIL**"
                cells.append(text)
            fitted = f", {r['layers']} extrapolated from {r['layers_measured']}" if r.get("extrapolated") else ""
            label = f"{TARGET_TEXT[target]} ({len(r['sample'])} / {r['restore_hosts']})"
            lines.append(f"| {label} | {layout}{fitted} | " + " | ".join(cells) + " |")
    lines.append("")
    for layout in ("unstacked", "stacked"):
        save = find.get((layout, None))
        if save is None or "save_puts" not in save:
            continue
        ok = save["save_puts"] <= SAVE_PUTS_LIMIT
        lines.append(
            f"Save side ({layout}): {save['save_puts']:,} PUTs for the whole save (blobs of every process,"
            f" index objects, live-save markers, root; limit ≤ {SAVE_PUTS_LIMIT:,}) {'pass' if ok else '**FAIL**'}."
        )
    return "\n".join(lines).rstrip("\n")
