"""Peer copy (issue 56): each process's local-tier bytes reach its keeper through JAX's transfer server.

2 and 4 real JAX processes on CPU, with JAX's CPU collectives off (the transfer server needs
none, so a user's job needs no setting for it): payloads of different sizes per process, empty and a few MiB included, reach the
right keeper bit-exact (SHA-256 of what was sent and what arrived), with the default keeper
(half the job away) and a custom map, collected whole or through a sink. A sink that fails,
processes that disagree on the keeper map, and a process that never calls each end in an error
on every process that names the cause, never a hang. The keeper-map and chunk rules are checked
in this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from objckpt.errors import PeerCopyUnavailableError
from objckpt.peers.transfer import _chunks, _Segments, default_keeper, exchange_with_peers, keeper_map
from tests import multiprocess

WORKER = Path(__file__).with_name("peer_copy_worker.py")
MIB = 1 << 20


def _run(monkeypatch: pytest.MonkeyPatch, n: int, job: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    monkeypatch.setattr(multiprocess, "WORKER", WORKER)
    results = multiprocess.run_processes(n, job, devices_per_process=2, **kw)
    assert all(r is not None for r in results), f"a process failed: {results}"
    return results  # type: ignore[return-value]


def _check_round(results: list[dict[str, Any]], i: int, sizes: list[int], keepers: list[int]) -> None:
    """Every process received exactly what the process it keeps sent."""
    rounds = [r["rounds"][i] for r in results]
    sent = [r["sent"] for r, size in zip(rounds, sizes) if size]
    assert len(set(sent)) == len(sent)  # every payload differs: a mix-up cannot pass
    for k, got in enumerate(rounds):
        assert "error" not in got, f"round {i}, process {k}: {got}"
        owner = keepers.index(k)
        assert got["owner"] == owner, f"round {i}, process {k}: {got}"
        assert got["nbytes"] == got["size"] == sizes[owner], f"round {i}, process {k}: {got}"
        assert got["received"] == rounds[owner]["sent"], f"round {i}: process {k} did not get process {owner}'s bytes"


def test_default_keeper_is_half_the_job_away_and_every_process_keeps_one_copy() -> None:
    assert keeper_map(2) == [1, 0]
    assert keeper_map(4) == [2, 3, 0, 1]
    assert keeper_map(3) == [1, 2, 0]
    assert keeper_map(5) == [2, 3, 4, 0, 1]
    assert [default_keeper(p, 8) for p in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert keeper_map(4, lambda p, n: (p + 1) % n) == [1, 2, 3, 0]


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (lambda p, n: p, r"keeper_of\(0, 4\) = 0: a process cannot keep its own copy"),
        (lambda p, n: p + 1, r"keeper_of\(3, 4\) = 4 is not a process of this job \(0..3\)"),
        (lambda p, n: 1 - p % 2, r"process 0 would keep the copies of processes \[1, 3\]"),
    ],
)
def test_keeper_maps_other_than_one_copy_per_process_are_refused(rule: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        keeper_map(4, rule)


def test_chunks_are_full_then_the_rest() -> None:
    assert _chunks(0, MIB, []) == []
    assert _chunks(10, MIB, []) == [[(0, 10)]]
    assert _chunks(MIB, MIB, []) == [[(0, MIB)]]
    assert _chunks(3 * MIB + 5000, MIB, []) == [[(0, MIB)], [(MIB, MIB)], [(2 * MIB, MIB)], [(3 * MIB, 5000)]]


def test_chunks_are_cut_where_segments_meet_so_no_part_is_joined() -> None:
    assert _chunks(0, MIB, []) == []
    assert _chunks(3 * MIB + 5, MIB, []) == [[(0, MIB)], [(MIB, MIB)], [(2 * MIB, MIB)], [(3 * MIB, 5)]]
    assert _chunks(3 * MIB, MIB, [10, MIB, MIB + 20, 3 * MIB]) == [
        [(0, 10), (10, MIB - 10)],
        [(MIB, 20), (MIB + 20, MIB - 20)],
        [(2 * MIB, MIB)],
    ]
    whole = np.arange(3000, dtype=np.uint8)
    segments = _Segments([whole[:10], b"", whole[10:2100], whole[2100:]])
    assert segments.cuts == [10, 2100]
    for parts in _chunks(segments.size, 1024, segments.cuts):
        for offset, size in parts:  # every part a view of the sender's own memory, never a copy
            assert np.shares_memory(segments.read(offset, size), whole), (offset, size)


def test_a_payload_in_segments_reads_as_one() -> None:
    whole = np.arange(1000, dtype=np.uint8)
    segments = _Segments([whole[:10], whole[10:10].tobytes(), whole[10:700], whole[700:]])
    assert segments.size == 1000
    for offset, size in [(0, 10), (5, 10), (0, 1000), (695, 10), (700, 300), (999, 1)]:
        assert segments.read(offset, size).tobytes() == whole[offset : offset + size].tobytes()
    assert _Segments([]).size == 0


def test_one_process_has_no_peer() -> None:
    with pytest.raises(PeerCopyUnavailableError, match="a single process has no peer"):
        exchange_with_peers(b"abc", timeout=1)


@pytest.mark.slow
def test_two_processes_exchange_payloads_of_any_size_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    rounds = [
        {"sizes": [0, 3 * MIB + 7]},  # empty one way, a few MiB (one chunk) the other
        {
            "sizes": [5 * MIB + 3, 1],
            "chunk_bytes": MIB,
            "as": "bytes",
        },  # six chunks (more than the window), a bytes payload
        {"sizes": [2 * MIB + 1, 4 * MIB], "chunk_bytes": MIB, "sink": True},
        {"sizes": [0, 0]},
    ]
    results = _run(monkeypatch, 2, {"kind": "exchange", "cpu_collectives": None, "rounds": rounds})
    for i, spec in enumerate(rounds):
        _check_round(results, i, spec["sizes"], [1, 0])  # type: ignore[arg-type]
    # The sink saw the owner's bytes in offset order, chunk by chunk, and nothing past their end.
    assert results[0]["rounds"][2]["sink_offsets"] == [0, MIB, 2 * MIB, 3 * MIB]
    assert results[1]["rounds"][2]["sink_offsets"] == [0, MIB, 2 * MIB]


@pytest.mark.slow
def test_four_processes_default_and_custom_keepers_and_failures_named(monkeypatch: pytest.MonkeyPatch) -> None:
    ring = [1, 2, 3, 0]
    rounds: list[dict[str, Any]] = [
        {"sizes": [0, 2 * MIB + 1, 4096, 3 * MIB]},
        {"sizes": [MIB, 0, 3 * MIB + 11, 17], "keepers": ring, "chunk_bytes": MIB, "as": "segments"},
        {"sizes": [700_000, 2 * MIB, 5, 0], "keepers": ring, "chunk_bytes": 1 << 19, "sink": True},
        # Process 2's sink fails at its second chunk: it keeps taking part, and every process hears of it.
        {"sizes": [MIB] * 4, "chunk_bytes": 1 << 18, "sink": True, "fail_sink": 2},
        # Process 1 uses the ring, the others the default: every process refuses before any transfer.
        {"sizes": [10] * 4, "keepers_of": {"1": ring}},
        # Process 3 never calls: the others stop at the first barrier's timeout, naming it.
        {"sizes": [10] * 4, "skip": [3], "timeout": 3},
    ]
    results = _run(monkeypatch, 4, {"kind": "exchange", "cpu_collectives": None, "rounds": rounds})
    _check_round(results, 0, rounds[0]["sizes"], [2, 3, 0, 1])
    _check_round(results, 1, rounds[1]["sizes"], ring)
    _check_round(results, 2, rounds[2]["sizes"], ring)
    for p, r in enumerate(results):
        error = r["rounds"][3]["error"]
        assert error.startswith("CoordinationError: peer copy 'round3' failed: "), (p, error)
        assert error.endswith("process 2: OSError: injected disk full"), (p, error)
    for p, r in enumerate(results):
        error = r["rounds"][4]["error"]
        assert error.startswith("CoordinationError: peer copy 'round4': processes "), (p, error)
        assert error.endswith(f"use another keeper map than process {p}"), (p, error)
        assert ("[1]" if p != 1 else "[0, 2, 3]") in error, (p, error)
    for p in (0, 1, 2):
        error = results[p]["rounds"][5]["error"]
        assert error.startswith("CoordinationError: barrier "), (p, error)
        assert "timed out after 3 s; processes that did not arrive: 3 " in error, (p, error)
