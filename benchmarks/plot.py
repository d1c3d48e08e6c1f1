"""Grouped bars of save and restore GiB/s per system, per latency profile, per store.

    python -m benchmarks.plot benchmarks/results/peers.json [out.png]

One row of panels per (workload, store), one column each for save and restore;
within a panel, one group of bars per RTT profile, one bar per system, whiskers
from the slowest to the fastest repeat.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SYSTEM_ORDER = ("raw", "objckpt", "orbax", "dcp", "naive")
COLORS = {"raw": "#9e9e9e", "objckpt": "#1f77b4", "orbax": "#ff7f0e", "dcp": "#d62728", "naive": "#8c564b"}
WORKLOAD_ORDER = ("small", "medium", "large")


def plot(summary: dict[str, Any], out: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in summary["cells"] if "gib_s_median" in c]
    combos = sorted({(c["workload"], c["store"]) for c in cells}, key=lambda k: (WORKLOAD_ORDER.index(k[0]), k[1]))
    if not combos:
        raise ValueError("nothing to plot")
    fig, axes = plt.subplots(len(combos), 2, figsize=(13, 3.6 * len(combos)), squeeze=False)
    for row, (workload, store) in enumerate(combos):
        for col, phase in enumerate(("save", "restore")):
            ax = axes[row][col]
            here = [c for c in cells if c["workload"] == workload and c["store"] == store and c["phase"] == phase]
            profiles = sorted({c["profile_ms"] for c in here})
            systems = [s for s in SYSTEM_ORDER if any(c["system"] == s for c in here)]
            width = 0.8 / max(1, len(systems))
            for i, system in enumerate(systems):
                xs, ys, lo, hi = [], [], [], []
                for j, ms in enumerate(profiles):
                    c = next((c for c in here if c["system"] == system and c["profile_ms"] == ms), None)
                    if c is None:
                        continue
                    xs.append(j - 0.4 + width * (i + 0.5))
                    ys.append(c["gib_s_median"])
                    lo.append(c["gib_s_median"] - c["gib_s_min"])
                    hi.append(c["gib_s_max"] - c["gib_s_median"])
                label = {"raw": "raw ceiling"}.get(system, system)
                if system == "orbax" and store == "s3":
                    label = "orbax (via s3fs-fuse)"
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=COLORS.get(system), label=label)
            ax.set_xticks(range(len(profiles)), [f"{ms} ms RTT" for ms in profiles])
            ax.set_ylabel("GiB/s")
            ax.set_title(f"{workload} on {store}: {phase}")
            ax.grid(axis="y", alpha=0.3)
            if col == 0:
                ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    src = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    data = json.loads(src.read_text())
    print(plot(data, out, title=src.stem))


if __name__ == "__main__":
    main()
