"""The pod-scale planning benchmark at a small scale: issue #40's counted bounds and issue #54's
yardstick (every target mesh, the worst and the median host of a sample).

Each device count runs in a child Python with that many forced CPU devices (2 layers of the
405B-shaped state, both layouts). Only counts are checked, never times: what a host reads and
sends must not grow with the number of hosts, and the report must name the worst host of a
sample that reaches past the first processes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from benchmarks import bench_scale
from benchmarks.scale.hosts import extrapolate, sample_hosts, summarize
from benchmarks.scale.report import markdown, passes
from benchmarks.scale.state import D_MODEL, FFN, HEAD_DIM, N_HEADS, N_KV_HEADS, VOCAB
from objckpt.core.writer_rule import SMALL_OWNERS

COUNTS = (16, 128)
MiB = 1 << 20
ALIGNED = ("same", "tensor16", "half")  # targets whose boxes line up with the saved pieces


@pytest.fixture(scope="module")
def records() -> dict[tuple[int, str, str | None], dict[str, Any]]:
    """Every record, by (devices, layout, target mesh); each child killed if it runs past 280 s (a loaded machine)."""
    out = {}
    for n in COUNTS:
        result = bench_scale.spawn_child(n, list(bench_scale.LAYOUTS), 2, timeout=280, repeats=1)
        for r in result["records"]:
            out[(r["devices"], r["layout"], r["target_mesh"])] = r
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", bench_scale.LAYOUTS)
def test_a_host_reads_a_bounded_number_of_index_objects(records: dict, layout: str) -> None:
    """Those of the processes that wrote its boxes (itself on the same mesh; two on tensor=16 or
    half the devices, whose boxes span two saved fsdp rows) and of the few processes that write
    small replicated leaves (here, the norms: whole, by one of the first ``SMALL_OWNERS``
    processes), whatever the number of devices."""
    for target in ALIGNED:
        writers = 1 if target == "same" else 2
        counts = [records[(n, layout, target)]["worst"]["index_objects_read"] for n in COUNTS]
        assert all(c <= SMALL_OWNERS + writers for c in counts), (target, counts)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", bench_scale.LAYOUTS)
def test_metadata_a_host_reads_does_not_grow_with_devices(records: dict, layout: str) -> None:
    for target in ALIGNED:
        sizes = [records[(n, layout, target)]["worst"]["metadata_bytes"] for n in COUNTS]
        assert sizes[1] <= 1.5 * sizes[0], (target, sizes)
        assert max(sizes) <= 64 * MiB


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", bench_scale.LAYOUTS)
def test_every_target_is_measured_on_a_sample_reaching_the_last_host(records: dict, layout: str) -> None:
    r = records[(128, layout, "same")]
    assert r["restore_hosts"] == 32
    assert {0, 1, 31} <= set(r["sample"]) and any(h >= 8 for h in r["sample"][:-1]), r["sample"]
    for target in bench_scale.TARGETS:
        r = records[(128, layout, target)]
        assert "skipped" not in r, target
        assert [h["host"] for h in r["hosts"]] == r["sample"]
        assert r["sample"][-1] == r["restore_hosts"] - 1  # the last host, always
        for key, worst in r["worst"].items():
            values = [h[key] for h in r["hosts"]]
            assert worst == max(values) >= r["median"][key] >= min(values), (target, key)
            assert r["hosts"][r["sample"].index(r["worst_host"][key])][key] == worst
    assert records[(128, layout, "params_8x8")]["sample"] == list(range(8))
    assert records[(128, layout, "data3")]["restore_hosts"] == 3 * 4 * 8 // 4
    assert "skipped" in records[(16, layout, "data3")] and "skipped" in records[(16, layout, "params_8x8")]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", bench_scale.LAYOUTS)
def test_aligned_targets_read_whole_pieces_and_cut_ones_reshard(records: dict, layout: str) -> None:
    """Same mesh, tensor=16 with tensor minor and half the devices line up with the saved pieces
    (read directly, nothing moved); at 128 devices (fsdp=16 × tensor=8) swapping the layer
    matrices' axes, or fsdp as the minor device axis, cuts them: restore reads those leaves on the
    saved grid (bytes fetched ÷ bytes the target boxes need within issue #54's 1.5) and moves
    the bytes between devices."""
    for n in COUNTS:
        for target in ALIGNED:
            r = records[(n, layout, target)]
            assert r["uncovered"] is None  # the child raises on any uncovered box
            assert round(r["worst"]["amplification"], 3) == 1.0, (n, target)
            assert r["worst"]["piece_amplification"] == 1.0
        assert records[(n, layout, "same")]["worst"]["gets_per_16mib"] <= 1
        assert records[(n, layout, "same")]["worst"]["moved_bytes"] == 0
    for target in ("swapped", "tensor16_fsdp_minor"):
        r = records[(128, layout, target)]
        assert r["worst"]["amplification"] <= 1.5, (target, r["worst"])
        assert all(passes(r).values()), (target, passes(r))
        assert r["resharded_leaves"] > 0 and min(h["moved_bytes"] for h in r["hosts"]) > 0, target
    same, swapped = records[(128, layout, "same")], records[(128, layout, "swapped")]
    assert swapped["needed_bytes"] == same["needed_bytes"]  # a host needs as much, whatever the spec


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", bench_scale.LAYOUTS)
def test_params_only_targets_restore_the_params(records: dict, layout: str) -> None:
    """One 8-device host restores every param (2 bytes each) and nothing of the optimizer state;
    8 such hosts an eighth each."""
    q, kv = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    layer = D_MODEL * q * 2 + D_MODEL * kv * 2 + 3 * D_MODEL * FFN + 2 * D_MODEL
    norms = 2 * 2 * D_MODEL + D_MODEL  # replicated: every host needs them whole
    params = 2 * (2 * layer + 2 * VOCAB * D_MODEL + D_MODEL)
    for n in COUNTS:
        one = records[(n, layout, "params_1x8")]
        assert one["sample"] == [0] and one["devices_per_host"] == 8
        assert one["needed_bytes"] == params
        save = records[(n, layout, None)]
        assert one["leaves_restored"] * 4 == save["leaves"]
    eight = records[(128, layout, "params_8x8")]
    for h in eight["hosts"]:  # an eighth of every sharded param, and the norms whole
        assert h["needed_bytes"] == (params - 2 * norms) // 8 + 2 * norms, h["host"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", bench_scale.LAYOUTS)
def test_the_save_side_meets_its_counted_targets(records: dict, layout: str) -> None:
    for n in COUNTS:
        save = records[(n, layout, None)]
        assert save["coordination_bytes"] <= 4096
        assert save["root_bytes"] <= 16 * MiB
        assert save["bytes_per_put"] >= 16 * MiB


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_report_marks_the_worst_host_and_each_failure(records: dict) -> None:
    table = markdown(list(records.values()), "stacked")
    row = next(line for line in table.splitlines() if line.startswith("| swapped: bytes fetched"))
    assert "✗" not in row and "(h" in row
    row = next(line for line in table.splitlines() if line.startswith("| swapped: moved between devices"))
    assert "(h" in row and "✗" not in row
    spoiled = dict(records[(128, "stacked", "swapped")])
    spoiled["worst"] = dict(spoiled["worst"], amplification=2.0)
    others = [r for k, r in records.items() if k != (128, "stacked", "swapped")]
    row = next(
        line for line in markdown([*others, spoiled], "stacked").splitlines() if "swapped: bytes fetched" in line
    )
    assert "2.00 ✗" in row
    row = next(line for line in table.splitlines() if line.startswith("| same: bytes fetched"))
    assert "✗" not in row
    cpu = [line for line in table.splitlines() if ": parse+plan CPU-s |" in line]
    assert len(cpu) == len(bench_scale.TARGETS)
    assert all(line.endswith("| ≤ 2 |") for line in cpu)  # issue 80: params onto one host included


def test_the_sample_holds_the_first_and_last_hosts_and_hosts_past_the_first_eight() -> None:
    assert sample_hosts(1) == [0]
    assert sample_hosts(8) == list(range(8))
    pod = sample_hosts(1024)
    assert {0, 1, 1022, 1023} <= set(pod) and len([h for h in pod if 8 <= h < 1022]) >= 3


def _host(host: int, layers: int, cpu: float) -> dict[str, Any]:
    return {
        "host": host,
        "index_objects_read": 3 + host,
        "metadata_bytes": 1000 + 100 * layers,
        "parse_plan_cpu_s": cpu * layers,
        "extra_peak_mib": 1.0 * layers,
        "requests": 2 * layers,
        "needed_bytes": 16 * MiB * layers,
        "read_bytes": 32 * MiB * layers,
        "piece_bytes_read": 32 * MiB * layers,
        "moved_bytes": 8 * MiB * layers,
        "resharded_leaves": 3 * layers,
        "gets_per_16mib": 0.0,
        "amplification": 0.0,
        "piece_amplification": 0.0,
    }


def test_fewer_layers_extrapolate_on_a_straight_line_and_say_so() -> None:
    def run(layers: int) -> list[dict[str, Any]]:
        target = {"devices": 64, "layout": "unstacked", "target_mesh": "same", "layers_measured": layers}
        target["hosts"] = [_host(0, layers, 0.01), _host(15, layers, 0.03)]
        for h in target["hosts"]:
            h.update(gets_per_16mib=2.0, amplification=2.0, piece_amplification=2.0)
        skipped = {"devices": 64, "layout": "unstacked", "target_mesh": "data3", "skipped": "does not fit"}
        return [summarize(target), skipped]

    fitted, skipped = extrapolate(run(2), run(8), 126)
    assert skipped["skipped"] and skipped["extrapolated"] is True
    assert fitted["extrapolated"] is True and fitted["layers"] == 126 and fitted["layers_measured"] == [2, 8]
    assert fitted["worst"]["metadata_bytes"] == 1000 + 100 * 126
    assert fitted["worst_host"]["parse_plan_cpu_s"] == 15
    assert math.isclose(fitted["worst"]["parse_plan_cpu_s"], 0.03 * 126)
    assert math.isclose(fitted["median"]["parse_plan_cpu_s"], 0.02 * 126)
    assert fitted["worst"]["index_objects_read"] == 18  # not a per-layer figure
    assert math.isclose(fitted["worst"]["amplification"], 2.0)
    assert math.isclose(fitted["worst"]["gets_per_16mib"], 2.0)
    assert fitted["worst"]["moved_bytes"] == 8 * MiB * 126  # additive: on the straight line
    assert fitted["resharded_leaves"] == 3 * 126


@pytest.mark.timeout(300)
def test_cut_targets_reshard_within_the_read_limit_through_restore_plan() -> None:
    """Fast: at 128 devices (fsdp=16 × tensor=8; at 64 the swapped boxes are whole saved cells),
    2 stacked layers, the bench's ``restore_plan`` (restore's own steps: read shardings chosen,
    leaves planned on them): the swapped target's worst host fetches at most 1.5 × the bytes its
    target boxes need and its devices receive bytes from others; the same mesh reshards nothing."""
    targets = ("same", "swapped", "tensor16_fsdp_minor")
    result = bench_scale.spawn_child(128, ["stacked"], 2, timeout=280, repeats=1, targets=targets)
    found = {r["target_mesh"]: r for r in result["records"]}
    swapped, same, minor = found["swapped"], found["same"], found["tensor16_fsdp_minor"]
    assert swapped["worst"]["amplification"] <= 1.5 and minor["worst"]["amplification"] <= 1.5
    assert swapped["needed_bytes"] == same["needed_bytes"]  # the target boxes, not the read boxes
    assert swapped["resharded_leaves"] > 0 and all(h["moved_bytes"] > 0 for h in swapped["hosts"])
    assert minor["resharded_leaves"] > 0 and all(h["moved_bytes"] > 0 for h in minor["hosts"])
    assert same["resharded_leaves"] == 0 and same["worst"]["moved_bytes"] == 0
    assert round(same["worst"]["amplification"], 4) == 1.0 and same["worst"]["gets_per_16mib"] <= 1
