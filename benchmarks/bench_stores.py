"""Store adapters head to head: concurrent PUT and GET of blob-sized objects.

Starts a local SeaweedFS (S3) and, for each adapter, writes ``--count``
objects of ``--size-mib`` MiB with ``--concurrency`` requests in flight,
then every adapter reads the same settled objects back whole, through
``get_range`` (``bytes``, as restore does today) and ``get_range_buffer``
(a view, no copy), all through the :class:`~objckpt.storage.Store` API.
``raw-obstore`` calls obstore directly (no Store layer) as the ceiling.
Rounds alternate the adapters and pause between them; medians are reported,
with client CPU seconds per GiB (``time.process_time``: excludes the server,
includes obstore's Rust threads).

    python -m benchmarks.bench_stores [--count 32] [--size-mib 32] [--reps 5] [--targets s3,local]

Writes ``benchmarks/results/stores.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import backends  # noqa: E402
from objckpt.storage import Store, from_url  # noqa: E402

RESULTS = Path(__file__).parent / "results"
GiB = 1 << 30


class RawObstore:
    """Just enough of the Store API over bare obstore calls: the ceiling."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store, self.prefix = store, prefix

    async def put(self, key: str, data: memoryview) -> None:
        import obstore as obs

        await obs.put_async(self.store, self.prefix + key, data, use_multipart=False)

    async def get_range(self, key: str, *, start: int, end: int) -> Any:
        import obstore as obs

        return await obs.get_range_async(self.store, self.prefix + key, start=start, end=end)

    get_range_buffer = get_range

    async def delete(self, key: str) -> None:
        import obstore as obs

        await obs.delete_async(self.store, self.prefix + key)


async def _timed(n_items: int, concurrency: int, fn: Callable[[int], Awaitable[None]]) -> tuple[float, float]:
    """(wall seconds, client CPU seconds) to run ``fn(0..n_items-1)`` with ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await fn(i)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n_items)))
    return time.perf_counter() - wall, time.process_time() - cpu


def _rate(total_gib: float, timing: tuple[float, float]) -> dict[str, float]:
    wall, cpu = timing
    return {"gib_s": total_gib / wall, "cpu_s_per_gib": cpu / total_gib}


async def put_round(store: Any, data: np.ndarray, keys: list[str], size: int, concurrency: int) -> dict[str, float]:
    view = memoryview(data)

    async def put(i: int) -> None:
        await store.put(keys[i], view[i * size : (i + 1) * size])

    return _rate(len(keys) * size / GiB, await _timed(len(keys), concurrency, put))


async def get_round(
    store: Any, data: np.ndarray, keys: list[str], size: int, concurrency: int, *, buffer: bool
) -> dict[str, float]:
    view = memoryview(data)
    got: dict[int, Any] = {}
    read = store.get_range_buffer if buffer else store.get_range

    async def get(i: int) -> None:
        got[i] = await read(keys[i], start=0, end=size)

    result = _rate(len(keys) * size / GiB, await _timed(len(keys), concurrency, get))
    for i in (0, len(keys) - 1):  # spot-check what came back
        assert len(got[i]) == size and bytes(got[i][:64]) == view[i * size : i * size + 64].tobytes()
    return result


async def bench(
    variants: dict[str, Callable[[str], Any]], base: str, args: argparse.Namespace
) -> dict[str, dict[str, list[dict[str, float]]]]:
    """PUT rounds, then GET rounds of the same (settled) objects, adapters interleaved.

    Every adapter reads the objects the last PUT round wrote, so GETs compare
    clients, not the server's state; a pause before each round lets the
    server finish background work left by the one before.
    """
    size = args.size_mib << 20
    data = np.random.default_rng(0).integers(0, 256, args.count * size, dtype=np.uint8)
    stores = {name: make(base) for name, make in variants.items()}
    names = list(variants)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {n: {"put": [], "get": [], "getbuf": []} for n in names}
    written: list[list[str]] = []

    def fresh_keys() -> list[str]:
        keys = [f"{uuid.uuid4().hex[:8]}/{i:04d}" for i in range(args.count)]
        written.append(keys)
        return keys

    for name in names:  # warm-up, not counted: the server grows its volumes on first writes
        await put_round(stores[name], data, fresh_keys(), size, args.concurrency)
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:  # alternate who goes first
            await asyncio.sleep(args.settle)
            result = await put_round(stores[name], data, fresh_keys(), size, args.concurrency)
            runs[name]["put"].append(result)
            print(f"  PUT    rep {rep} {name:16s} {result['gib_s']:.3f} GiB/s", flush=True)
    keys = written[-1]
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            for kind in ("get", "getbuf"):
                await asyncio.sleep(args.settle / 3)
                result = await get_round(stores[name], data, keys, size, args.concurrency, buffer=kind == "getbuf")
                runs[name][kind].append(result)
                print(f"  {kind:6s} rep {rep} {name:16s} {result['gib_s']:.3f} GiB/s", flush=True)
    cleanup = stores[names[0]]
    for keys in written:
        await asyncio.gather(*(cleanup.delete(k) for k in keys))
    return runs


def summarise(runs: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, dict[str, float]]:
    return {
        name: {f"{phase}_{k}": statistics.median(r[k] for r in rs) for phase, rs in phases.items() for k in rs[0]}
        for name, phases in runs.items()
    }


def s3_variants(service: backends.S3Service) -> dict[str, Callable[[str], Any]]:
    options = service.storage_options()

    def raw(base: str) -> RawObstore:
        return RawObstore(service.obstore_client(), base.split("/", 3)[3] + "/")

    return {
        "s3 fsspec": lambda base: from_url(base, **options, objckpt_backend="fsspec"),
        "s3 obstore": lambda base: from_url(base, **options, objckpt_backend="obstore"),
        "s3 raw-obstore": raw,
    }


def local_variants() -> dict[str, Callable[[str], Store]]:
    return {
        "file fsspec": lambda base: from_url(base, objckpt_backend="fsspec"),
        "file obstore": lambda base: from_url(base, objckpt_backend="obstore"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--size-mib", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of pause before each PUT round")
    parser.add_argument("--targets", default="s3,local")
    args = parser.parse_args()
    targets = set(args.targets.split(","))
    summary: dict[str, dict[str, float]] = {}
    if "s3" in targets:
        with backends.start_s3() as service:
            base = service.url(f"bench-{uuid.uuid4().hex[:8]}")
            summary.update(summarise(asyncio.run(bench(s3_variants(service), base, args))))
    if "local" in targets:
        with tempfile.TemporaryDirectory(prefix="objckpt-bench-") as tmp:
            summary.update(summarise(asyncio.run(bench(local_variants(), tmp, args))))
    total_gib = args.count * (args.size_mib << 20) / GiB
    print(
        f"\n{args.count} x {args.size_mib} MiB ({total_gib:.2f} GiB), {args.concurrency} in flight, "
        f"median of {args.reps}; GiB/s (client CPU-s per GiB)"
    )
    print("GET = get_range -> bytes; GETbuf = get_range_buffer -> memoryview (raw: obstore's Bytes both times)")
    print(f"{'store':16s} {'PUT':>14s} {'GET':>14s} {'GETbuf':>14s}")
    for name, m in summary.items():
        cells = [f"{m[k + '_gib_s']:.3f} ({m[k + '_cpu_s_per_gib']:.2f})" for k in ("put", "get", "getbuf")]
        print(f"{name:16s} " + " ".join(f"{c:>14s}" for c in cells))
    RESULTS.mkdir(exist_ok=True)
    out = {"params": vars(args), "median": summary}
    (RESULTS / "stores.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
