"""One process of tests/test_peer_copy.py: tests/mp_worker.py with these jobs.

Jobs (``kind``):
- ``exchange``: runs each of ``rounds`` in turn; a round gives every process's payload size
  (``sizes``), optionally a keeper list (``keepers``: process p's copy is kept by
  ``keepers[p]``; ``keepers_of``: this process's own list, by process), ``chunk_bytes``, ``sink`` (take the bytes chunk by chunk), ``skip`` (these
  processes do not call), ``fail_sink`` (this process's sink raises at its second chunk) and
  ``timeout``; ``as`` sends the payload as bytes or as three segments. Each round reports this process's payload digest and what it received (owner,
  size, digest), or the error it raised.
- ``throughput``: ``mib`` MiB per process exchanged ``repeat`` times after one warm-up; the
  seconds of each.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import mp_worker
import numpy as np

from objckpt.peers.transfer import exchange_with_peers

PROCESS, COUNT, JOB = mp_worker.PROCESS, mp_worker.COUNT, mp_worker.JOB


def payload(process: int, size: int, round_: int) -> np.ndarray:
    """Bytes that differ by process and round, every byte value present."""
    return np.random.default_rng([process, round_]).integers(0, 256, size, dtype=np.uint8)


def _shaped(mine: np.ndarray, how: str | None) -> Any:
    """The payload as the round sends it: an array, bytes, or three segments (cut at odd places)."""
    if how == "bytes":
        return mine.tobytes()
    if how == "segments":
        a, b = mine.size // 3, mine.size // 3 + 12345
        return [mine[:a], mine[a:b].tobytes(), mine[b:]]
    return mine


def one_round(i: int, spec: dict[str, Any]) -> dict[str, Any]:
    mine = payload(PROCESS, spec["sizes"][PROCESS], i)
    out: dict[str, Any] = {"sent": hashlib.sha256(mine).hexdigest()}
    if PROCESS in spec.get("skip", []):
        return out
    keepers = spec.get("keepers_of", {}).get(str(PROCESS), spec.get("keepers"))
    kept = bytearray()
    calls = []

    def sink(offset: int, chunk: memoryview) -> None:
        calls.append(offset)
        if spec.get("fail_sink") == PROCESS and len(calls) == 2:
            raise OSError("injected disk full")
        assert offset == len(kept)
        kept.extend(chunk)

    try:
        got = exchange_with_peers(
            _shaped(mine, spec.get("as")),
            timeout=spec.get("timeout", 60),
            keeper_of=None if keepers is None else (lambda p, n: keepers[p]),
            chunk_bytes=spec.get("chunk_bytes", 64 << 20),
            sink=sink if spec.get("sink") else None,
            name=f"round{i}",
        )
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    data = kept if got.data is None else got.data
    out.update(owner=got.owner, nbytes=got.nbytes, size=len(data), received=hashlib.sha256(data).hexdigest())
    if spec.get("sink"):
        out["sink_offsets"] = calls
    return out


def throughput() -> dict[str, Any]:
    size = JOB["mib"] << 20
    mine = payload(PROCESS, size, 0)
    exchange_with_peers(mine, timeout=120, name="warmup", chunk_bytes=JOB.get("chunk_bytes", 64 << 20))
    seconds = []
    for r in range(JOB.get("repeat", 3)):
        started = time.perf_counter()
        got = exchange_with_peers(mine, timeout=120, name=f"r{r}", chunk_bytes=JOB.get("chunk_bytes", 64 << 20))
        seconds.append(time.perf_counter() - started)
        assert got.nbytes == size
    return {"seconds": seconds}


def run() -> dict[str, Any]:
    kind = JOB["kind"]
    if kind == "exchange":
        return {"rounds": [one_round(i, spec) for i, spec in enumerate(JOB["rounds"])]}
    if kind == "throughput":
        return throughput()
    raise ValueError(f"unknown job kind {kind!r}")


if __name__ == "__main__":
    mp_worker.run = run  # main() calls run() by its module-level name
    mp_worker.main()
