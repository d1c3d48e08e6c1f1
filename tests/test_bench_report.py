"""The peers benchmark's report: medians per cell and the issue's targets checked from them."""

from __future__ import annotations

from benchmarks.rivals.report import check_targets, markdown, summarize

GiB = 1 << 30
_META = {"started": "today", "machine": "2 cores", "repeats": 3, "raw_client": "obstore"}


def _rows(
    system: str,
    phase: str,
    seconds: list[float],
    *,
    workload: str = "medium",
    peak_above: int = 0,
    transport: str | None = None,
) -> list[dict]:
    return [
        {
            "store": "s3",
            "profile_ms": 0,
            **({"transport": transport} if transport else {}),  # None: a sample from before the field
            "workload": workload,
            "system": system,
            "phase": phase,
            "seconds": s,
            "bytes": GiB,
            "cpu_s": 2 * s,
            "peak_rss": (1 << 30) + peak_above,
            "rss_before": 1 << 30,
        }
        for s in seconds
    ]


def _check(checks: list[dict], target: str) -> dict:
    (check,) = [c for c in checks if c["target"].startswith(target)]
    return check


def test_medians_min_max_and_the_ceiling_and_reshard_targets():
    rows = (
        _rows("raw", "save", [8.0, 10.0, 9.0])
        + _rows("raw", "restore", [2.0, 2.0, 2.0])
        + _rows("objckpt", "save", [10.0, 11.0, 30.0])  # one outlier: the median ignores it
        + _rows("objckpt", "restore", [2.5, 2.0, 2.1])
        + _rows("objckpt", "restore_resharded", [2.4, 2.2, 9.0])
    )
    summary = summarize(rows)
    (save,) = [c for c in summary["cells"] if c["system"] == "objckpt" and c["phase"] == "save"]
    assert (save["seconds_median"], save["seconds_min"], save["seconds_max"], save["n"]) == (11.0, 10.0, 30.0, 3)
    assert abs(save["gib_s_median"] - 1 / 11) < 1e-9 and save["cpu_s_per_gib"] == 22.0
    checks = summary["checks"]
    assert _check(checks, "save ≥ 0.9× raw PUT") == {
        "target": "save ≥ 0.9× raw PUT",
        "where": "s3 0 ms medium",
        "value": round(9 / 11, 3),
        "limit": 0.9,
        "pass": False,
    }
    assert _check(checks, "restore ≥ 0.9× raw GET")["pass"] is True  # 2.0 / 2.1 = 0.95
    reshard = _check(checks, "resharded restore ≤ 1.1×")
    assert reshard["value"] == round(2.4 / 2.1, 3) and reshard["pass"] is False


def test_small_is_held_to_no_slower_than_orbax_and_memory_to_its_limits():
    rows = (
        _rows("objckpt", "save", [1.0] * 3, workload="small", peak_above=300 << 20)
        + _rows("objckpt", "restore", [1.0] * 3, workload="small", peak_above=(1 << 30) + (300 << 20))
        + _rows("orbax", "save", [1.0] * 3, workload="small")
        + _rows("orbax", "restore", [0.9] * 3, workload="small")
        + _rows("dcp", "restore", [0.1] * 3, workload="small")  # small is compared with Orbax only
    )
    checks = check_targets(summarize(rows)["cells"])
    assert _check(checks, "save no slower than orbax")["pass"] is True  # equal is enough
    assert _check(checks, "restore no slower than orbax")["pass"] is False
    assert not [c for c in checks if "dcp" in c["target"]]
    assert not [c for c in checks if "raw" in c["target"]]  # the ceiling is checked on medium and large
    memory = _check(checks, "restore peak RSS")
    assert memory["value"] == 1024 + 300 and memory["limit"] == 1024 + 256 and memory["pass"] is False


def test_the_ceiling_is_the_raw_gets_that_drop_their_bytes():
    """The target compares with raw GETs that drop what they read (the store's limit);
    the same GETs keeping every response are reported beside it, as a reference that
    does not decide the target."""
    rows = (
        _rows("raw", "save", [8.0] * 3)
        + _rows("raw", "restore", [1.5] * 3)
        + _rows("raw", "restore_kept", [2.0] * 3)
        + _rows("objckpt", "save", [8.0] * 3)
        + _rows("objckpt", "restore", [2.1] * 3)
    )
    summary = summarize(rows)
    checks = summary["checks"]
    target = _check(checks, "restore ≥ 0.9× raw GET")
    assert target["value"] == round(1.5 / 2.1, 3) and target["pass"] is False
    assert not [c for c in checks if "keep" in c["target"]]  # the kept GETs decide no target
    assert summary["references"] == [
        {
            "ratio": "restore / raw GETs that keep every response",
            "where": "s3 0 ms medium",
            "value": round(2.0 / 2.1, 3),
        }
    ]
    table = markdown(summary, _META)
    assert "| 0 ms | http | raw (the same GETs, every response kept) | | | 2.00 |" in table
    assert "| restore / raw GETs that keep every response | s3 0 ms medium | 0.952 |" in table


def test_http_and_https_rows_are_kept_apart():
    """--https measures each cell over both transports: the medians, the targets, the
    reference ratios and the tables compare HTTPS with HTTPS and HTTP with HTTP, never
    across, and samples without a transport (older results) count as HTTP."""
    rows = (
        _rows("raw", "save", [8.0] * 3)  # no transport field: HTTP
        + _rows("raw", "restore", [2.0] * 3, transport="http")
        + _rows("raw", "restore_kept", [2.0] * 3)
        + _rows("objckpt", "save", [8.0] * 3, transport="http")
        + _rows("objckpt", "restore", [2.0] * 3)
        + _rows("raw", "save", [10.0] * 3, transport="https")
        + _rows("raw", "restore", [4.0] * 3, transport="https")
        + _rows("raw", "restore_kept", [5.0] * 3, transport="https")
        + _rows("objckpt", "save", [20.0] * 3, transport="https")
        + _rows("objckpt", "restore", [4.0] * 3, transport="https")
        + [{**_rows("orbax", "save", [1.0], transport="https")[0], "skipped": "no HTTPS here"}]
    )
    summary = summarize(rows)
    cells = {(c["transport"], c["system"], c["phase"]): c for c in summary["cells"] if "gib_s_median" in c}
    assert {t for t, _, _ in cells} == {"http", "https"}
    assert cells[("http", "objckpt", "save")]["n"] == 3 and cells[("https", "objckpt", "save")]["n"] == 3
    assert cells[("http", "objckpt", "save")]["seconds_median"] == 8.0
    assert cells[("https", "objckpt", "save")]["seconds_median"] == 20.0
    assert cells[("http", "raw", "save")]["seconds_median"] == 8.0  # the field-less rows are HTTP

    checks = {(c["target"], c["where"]): c for c in summary["checks"]}
    assert checks[("save ≥ 0.9× raw PUT", "s3 0 ms medium")]["value"] == 1.0  # 8 s vs 8 s
    assert checks[("save ≥ 0.9× raw PUT", "s3 0 ms medium over https")]["value"] == 0.5  # 10 s vs 20 s
    assert checks[("restore ≥ 0.9× raw GET", "s3 0 ms medium over https")]["value"] == 1.0  # 4 s vs 4 s
    assert summary["references"] == [
        {"ratio": "restore / raw GETs that keep every response", "where": "s3 0 ms medium", "value": 1.0},
        {
            "ratio": "restore / raw GETs that keep every response",
            "where": "s3 0 ms medium over https",
            "value": 1.25,
        },
    ]
    (skipped,) = [c for c in summary["cells"] if "skipped" in c]
    assert (skipped["transport"], skipped["system"]) == ("https", "orbax")

    table = markdown(summary, {**_META, "https": True})
    assert "| RTT | transport | system |" in table
    assert "| 0 ms | http | objckpt | 8.00 |" in table
    assert "| 0 ms | https | objckpt | 20.00 |" in table
    assert table.index("| 0 ms | http | objckpt |") < table.index("| 0 ms | https | objckpt |")
    assert "| 0 ms | https | orbax (s3fs-fuse) | — | skipped: no HTTPS here |" in table
    assert "| 0 ms | http | orbax" not in table  # the HTTPS skip does not leak into the HTTP rows
    assert "HTTPS" in table  # the header says how HTTPS was served


def test_https_flag_is_parsed_and_excluded_with_url():
    import pytest

    from benchmarks import bench_rivals

    args = bench_rivals.parse(["--quick", "--https", "--systems", "raw,objckpt"])
    assert args.https is True and args.name == "peers-quick-https"
    assert bench_rivals.parse(["--quick"]).https is False
    with pytest.raises(SystemExit):
        bench_rivals.parse(["--url", "s3://bucket/x", "--https"])
