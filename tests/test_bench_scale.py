"""The pod-scale planning benchmark at a small scale: the counted bounds of issue #40.

Each device count runs in a child Python with that many forced CPU devices (2
layers of the 405B-shaped state, both layouts). Only counts are checked, never
times: what a host reads and sends must not grow with the number of hosts.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import bench_scale
from objckpt.core.layout import SMALL_OWNERS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

COUNTS = (16, 64, 128)
MiB = 1 << 20


@pytest.fixture(scope="module")
def records() -> dict[tuple[int, str, str | None], dict[str, Any]]:
    """Every record, by (devices, layout, target mesh); each child killed if it runs past 60 s."""
    out = {}
    for n in COUNTS:
        result = bench_scale.spawn_child(n, list(bench_scale.LAYOUTS), 2, timeout=60, repeats=1)
        for r in result["records"]:
            out[(r["devices"], r["layout"], r["target_mesh"])] = r
    return out


@pytest.mark.parametrize("layout", bench_scale.LAYOUTS)
def test_a_host_reads_a_bounded_number_of_index_objects(records: dict, layout: str) -> None:
    """Its own and those of the few processes that write small replicated leaves (here, the norms:
    whole, by one of the first ``SMALL_OWNERS`` processes), whatever the number of devices."""
    for target in bench_scale.TARGETS:
        counts = [records[(n, layout, target)]["index_objects_read"] for n in COUNTS]
        assert all(c <= SMALL_OWNERS + 1 for c in counts), (target, counts)
    same = [records[(n, layout, "same")]["index_objects_read"] for n in COUNTS]
    assert same[-1] <= same[-2], same  # 64 → 128 devices: no more


@pytest.mark.parametrize("layout", bench_scale.LAYOUTS)
def test_metadata_a_host_reads_does_not_grow_with_devices(records: dict, layout: str) -> None:
    for target in bench_scale.TARGETS:
        sizes = [records[(n, layout, target)]["metadata_bytes"] for n in COUNTS]
        assert all(b <= 1.5 * a for a, b in zip(sizes, sizes[1:])), (target, sizes)
        assert max(sizes) <= 64 * MiB


@pytest.mark.parametrize("layout", bench_scale.LAYOUTS)
def test_same_mesh_reads_whole_pieces_in_few_gets(records: dict, layout: str) -> None:
    for n in COUNTS:
        r = records[(n, layout, "same")]
        assert r["uncovered"] is None  # the child asserts every job is covered exactly
        assert r["piece_amplification"] == 1.0  # every piece read is wholly needed
        assert round(r["amplification"], 3) == 1.0  # plus the spacing a read spans between pieces
        assert r["gets_per_16mib"] <= 1, r["gets_per_16mib"]


@pytest.mark.parametrize("layout", bench_scale.LAYOUTS)
def test_other_meshes_and_the_save_side_meet_their_counted_targets(records: dict, layout: str) -> None:
    for n in COUNTS:
        for target in ("tensor16", "half"):
            r = records[(n, layout, target)]
            assert r["uncovered"] is None
            assert r["amplification"] <= 1.5 and r["gets_per_16mib"] <= 4, r
        save = records[(n, layout, None)]
        assert save["coordination_bytes"] <= 4096
        assert save["root_bytes"] <= 16 * MiB
        assert save["bytes_per_put"] >= 16 * MiB
