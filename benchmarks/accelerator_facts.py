"""Facts about a chip's copies that objckpt's save path relies on (issue 65), read in one process.

    PYTHONPATH=. python benchmarks/accelerator_facts.py [--state-gib 2]

On a state of ``accelerator_worker`` (bf16 params, f32 master weights and Adam moments), each
section on a freshly built state, one line per fact:

- ``host copies``: ``copy_to_host_async`` on an alias of every leaf, then their reads: seconds,
  whether the host bytes are a copy of their own (``did_copy``), the RSS they take, and whether
  a host copy read before its shard is donated keeps its bytes;
- ``device copies``: every leaf copied on its device three ways (``device_put(...,
  may_alias=False)``, ``x.copy()``, a jitted tree copy), seconds to dispatch and to finish;
- ``pinned host``: ``device_put`` of every leaf to the ``pinned_host`` memory kind;
- ``host floors``: ``jax.device_get``, leaf-by-leaf ``np.asarray``, a memcpy of the state into
  touched and into fresh pages, crc32c of it.

docs/PERFORMANCE.md quotes a TPU v5e's. Runs on CPU devices too (where most copies are free).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.accelerator_worker import GiB, build_state, leaves, rss_bytes


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def host_copies(gib: float) -> None:
    xs = leaves(build_state(gib))
    rss = rss_bytes()
    aliases = [x._rewrap_with_aval_and_sharding(x.aval, x.sharding) for x in xs]
    start_s, _ = timed(lambda: [a.copy_to_host_async() for a in aliases])
    read_s, hosts = timed(lambda: [a._single_device_array_to_np_array_did_copy() for a in aliases])
    print(
        f"host copies: start {start_s:.3f} s, read {read_s:.3f} s, did_copy {sorted({c for _, c in hosts})},"
        f" RSS +{(rss_bytes() - rss) / GiB:.2f} GiB"
    )
    kept = np.array(hosts[5][0])
    jax.jit(lambda x: x * 2, donate_argnums=0)(xs[5]).block_until_ready()
    print(
        f"host copies: after donating leaf 5, deleted {xs[5].is_deleted()},"
        f" its host copy unchanged {np.array_equal(hosts[5][0], kept)}"
    )


def device_copies(gib: float) -> None:
    xs = leaves(build_state(gib))
    device = xs[0].devices().pop()
    used = (device.memory_stats() or {}).get("bytes_in_use", 0)
    ways: dict[str, Callable[[], Any]] = {
        "device_put(may_alias=False)": lambda: [jax.device_put(x, x.sharding, may_alias=False) for x in xs],
        "x.copy()": lambda: [x.copy() for x in xs],
    }
    tree_copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
    ways["jitted tree copy (first call)"] = lambda: tree_copy(xs)
    ways["jitted tree copy (second call)"] = lambda: tree_copy(xs)
    for name, way in ways.items():
        t0 = time.perf_counter()
        copies = way()
        dispatched = time.perf_counter() - t0
        jax.block_until_ready(copies)
        done = time.perf_counter() - t0
        more = ((device.memory_stats() or {}).get("bytes_in_use", 0) - used) / GiB
        print(f"device copies: {name}: dispatched {dispatched:.4f} s, done {done:.4f} s, device memory +{more:.2f} GiB")
        del copies
        gc.collect()


def pinned_host(gib: float) -> None:
    xs = leaves(build_state(gib))
    shardings = [x.sharding.with_memory_kind("pinned_host") for x in xs]
    put_s, ys = timed(lambda: jax.block_until_ready([jax.device_put(x, s) for x, s in zip(xs, shardings)]))
    print(f"pinned host: device_put {put_s:.3f} s")


def host_floors(gib: float) -> None:
    xs = leaves(build_state(gib))
    get_s, _ = timed(lambda: jax.device_get(xs))
    xs = leaves(build_state(gib))
    per_leaf_s, hosts = timed(lambda: [np.asarray(x) for x in xs])
    flat = [h.reshape(-1).view(np.uint8) for h in hosts]
    n = sum(f.size for f in flat)

    def copy_into(buf: np.ndarray) -> None:
        at = 0
        for f in flat:
            buf[at : at + f.size] = f
            at += f.size

    touched = np.ones(n, np.uint8)
    touched_s, _ = timed(lambda: copy_into(touched))
    fresh_s, _ = timed(lambda: copy_into(np.empty(n, np.uint8)))
    import crc32c

    crc_s, _ = timed(lambda: [crc32c.crc32c(f) for f in flat])
    print(
        f"host floors ({n / GiB:.2f} GiB): device_get {get_s:.3f} s, per leaf {per_leaf_s:.3f} s,"
        f" memcpy into touched pages {touched_s:.3f} s, into fresh pages {fresh_s:.3f} s, crc32c {crc_s:.3f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-gib", type=float, default=2.0)
    gib = ap.parse_args().state_gib
    device = jax.devices()[0]
    print(f"jax {jax.__version__}, {device.device_kind}, memories {device.addressable_memories()}")
    for section in (host_copies, device_copies, pinned_host, host_floors):
        try:
            section(gib)
        except Exception as exc:  # noqa: BLE001 - a fact this backend lacks is a line, not the end
            print(f"{section.__name__}: failed: {type(exc).__name__}: {exc}")
        gc.collect()


if __name__ == "__main__":
    main()
