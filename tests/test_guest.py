"""objckpt is a guest in a training process: by default it changes no process-wide state.

The cyclic GC and glibc's malloc are left alone unless ``Options`` asks
(``pause_gc``, ``tune_malloc``); the host-memory techniques of restore
(prefaulted arenas, aligned buffers, reads started early to land aligned) run
only for leaves that stay in host memory; and a store closes what it opened
(the streamed reader's connections) when the operation that opened it ends.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import assert_tree_bit_exact, random_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from restore_seams import paths, restore_with

import objckpt
from objckpt.restoring.arena import AssemblyArena
from objckpt.restoring.landing import HostMemory
from objckpt.storage import from_url
from objckpt.storage.phase import bytes_phase
from objckpt.transfer import buffers as memory


def _tree() -> dict[str, jax.Array]:
    """Small leaves and one large leaf (placed box by box), over 8 CPU devices."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    tree = {f"s{i}": jax.device_put(random_array((64, 32), np.float32, seed=i), sharding) for i in range(4)}
    tree["big"] = jax.device_put(random_array((1024, 2048), np.float32, seed=9), sharding)  # 8 MiB
    return tree


def _resharded(tree: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    other = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other) for k, v in tree.items()}


@contextmanager
def _gc_sampled() -> Iterator[list[bool]]:
    """Sample ``gc.isenabled()`` on a thread every millisecond while the block runs."""
    samples: list[bool] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(gc.isenabled())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def _where(kind: str, s3_store, local_store) -> tuple[str, dict | None]:
    target = s3_store if kind == "s3" else local_store
    return target.url, target.storage_options


class _Inside:
    """Whether the GC was on inside each restore, seen from its progress callback (called on
    objckpt's I/O thread while it reads and once when the reads end)."""

    def __init__(self) -> None:
        self.restores: list[set[bool]] = []

    def watch(self):
        seen: set[bool] = set()
        self.restores.append(seen)
        return lambda _: seen.add(gc.isenabled())


@pytest.fixture
def spies(monkeypatch):
    """``(mallopt_calls, inside)``: every ``mallopt`` objckpt makes (none reach libc; the
    process counts as fresh), and an :class:`_Inside` for the restores to report to."""
    mallopt_calls: list[tuple[int, int]] = []
    monkeypatch.setattr(memory, "_mallopt", lambda param, value: mallopt_calls.append((param, value)) or True)
    monkeypatch.setattr(memory, "_done", False)
    return mallopt_calls, _Inside()


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_by_default_the_collector_and_malloc_are_left_alone(kind, s3_store, local_store, spies):
    """A default save and restore (same sharding and another) never turn the GC off and
    never call ``mallopt``: checked from a sampling thread and from inside the restore."""
    mallopt_calls, inside = spies
    url, storage_options = _where(kind, s3_store, local_store)
    tree = _tree()
    with _gc_sampled() as samples:
        objckpt.save(url, tree, storage_options=storage_options)
        same = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        out = objckpt.restore(url, same, storage_options=storage_options, progress=inside.watch())
        assert_tree_bit_exact(tree, out)
        out = objckpt.restore(url, _resharded(tree), storage_options=storage_options, progress=inside.watch())
        assert_tree_bit_exact(tree, out)
    assert samples and all(samples), f"the GC was off in {samples.count(False)} of {len(samples)} samples"
    assert inside.restores == [{True}, {True}]
    assert mallopt_calls == []


def test_the_options_turn_the_techniques_on(s3_store, spies):
    """``pause_gc`` defers the collector for the restore only; ``tune_malloc`` fixes glibc's
    mmap threshold once per process, from a save or a restore that asks."""
    mallopt_calls, inside = spies
    tree = _tree()
    tuned = objckpt.Options(tune_malloc=True, pause_gc=True)
    objckpt.save(s3_store.url, tree, storage_options=s3_store.storage_options, options=tuned)
    assert mallopt_calls == [(-3, 1 << 20)]  # M_MMAP_THRESHOLD, 1 MiB
    assert gc.isenabled()  # the save leaves the collector alone
    out = objckpt.restore(
        s3_store.url, _resharded(tree), storage_options=s3_store.storage_options, options=tuned, progress=inside.watch()
    )
    assert_tree_bit_exact(tree, out)
    assert inside.restores == [{False}] and gc.isenabled()  # paused inside, given back after
    assert mallopt_calls == [(-3, 1 << 20)]  # once per process


class _AskedForAlignment:
    """A store that counts the times restore asks where its responses land (its phase hint,
    answered as restore would answer for it: the store's own hint, else a ``bytes`` object's)."""

    def __init__(self, inner, used: dict[str, int]) -> None:
        self.inner = inner
        self.used = used

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def response_phase(self):
        self.used["alignment"] += 1
        hint = getattr(self.inner, "response_phase", None)
        return hint() if hint is not None else bytes_phase()


@pytest.mark.parametrize("where", ["s3", "memory"])
def test_leaves_bound_for_an_accelerator_get_plain_buffers(where, s3_store):
    """Off the CPU backend (simulated: plans that say no leaf stays in host memory) a
    restore onto another sharding makes no prefaulted arena, faults nothing in, allocates
    no aligned buffers and starts no read early; onto the CPU backend it does all of these."""
    used: dict[str, int] = {"mapped": 0, "fault_in": 0, "aligned": 0, "alignment": 0}

    def counting(name, real):
        def wrapped(*args, **kwargs):
            used[name] += 1
            return real(*args, **kwargs)

        return wrapped

    host = HostMemory(
        arrays=counting("aligned", memory.aligned_arrays),
        fault_in=counting("fault_in", memory.fault_in),
        arena=lambda leaves: AssemblyArena(leaves, mapped=counting("mapped", memory.mapped_buffer)),
    )
    url = s3_store.url if where == "s3" else "memory://guest/plain"
    options = s3_store.storage_options if where == "s3" else None
    tree = _tree()
    objckpt.save(url, tree, storage_options=options)
    store = _AskedForAlignment(from_url(url, **(options or {})), used)

    def restored(**kwargs):  # "big" is placed box by box
        out = restore_with(store, paths(_resharded(tree)), memory=host, whole_leaf_bytes=1 << 20, **kwargs)
        return {k: out[f"['{k}']"] for k in tree}

    assert_tree_bit_exact(tree, restored())
    on_cpu = dict(used)
    assert all(on_cpu.values()), on_cpu

    used.update(dict.fromkeys(used, 0))
    prefaulting = {t for t in threading.enumerate() if t.name == "objckpt-prefault"}
    out = restored(replan=lambda plan: dataclasses.replace(plan, on_host=False))
    assert_tree_bit_exact(tree, out)
    assert used == {"mapped": 0, "fault_in": 0, "aligned": 0, "alignment": 0}
    assert {t for t in threading.enumerate() if t.name == "objckpt-prefault"} <= prefaulting


def _server_port(storage_options: dict) -> int:
    endpoint = storage_options["client_kwargs"]["endpoint_url"]
    match = re.search(r":(\d+)", endpoint.split("//", 1)[1])
    assert match, endpoint
    return int(match.group(1))


def _sockets_to(port: int) -> int:
    """This process's established TCP connections to ``port`` (from /proc: no psutil)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if fields[3] == "01" and remote_port == port and fields[9] in inodes:
                count += 1
    return count


def test_a_restore_closes_the_streamed_readers_connections(s3_store, monkeypatch):
    """Restores onto another sharding stream their reads over connections of their store's
    reader; each restore closes its store at the end, which closes them. The stores are
    kept alive here, so nothing but that close can free their sockets."""
    if not Path("/proc/self/net/tcp").exists():
        pytest.skip("needs /proc (Linux)")
    from objckpt.transfer import retries as transfer

    real_from_url = transfer.from_url
    opened = []

    def keeping(url, **options):
        opened.append(real_from_url(url, **options))
        return opened[-1]

    tree = _tree()
    objckpt.save(s3_store.url, tree, storage_options=s3_store.storage_options)
    port = _server_port(s3_store.storage_options)
    target = _resharded(tree)
    monkeypatch.setattr(transfer, "from_url", keeping)
    before = _sockets_to(port)
    streamed = []
    for _ in range(3):
        out = objckpt.restore(s3_store.url, target, storage_options=s3_store.storage_options)
        assert_tree_bit_exact(tree, out)
        streamed.append(opened[-1].streams_reads)
    assert len(opened) == 3 and all(streamed)
    left = _sockets_to(port) - before  # obstore's pooled connection for the manifest may stay: one per store
    assert left <= len(opened), f"{left} connections to the server left open by {len(opened)} restores"


def test_closing_a_store_closes_its_streamed_reads_connections(s3_store):
    """A store that streamed reads on several threads holds a connection per thread until
    it is closed; closed, it holds none, and it still reads (on new connections)."""
    if not Path("/proc/self/net/tcp").exists():
        pytest.skip("needs /proc (Linux)")
    from objckpt.transfer import runtime

    store = s3_store.open()
    assert store.streams_reads
    data = os.urandom(4 << 20)
    runtime.run_sync(store.put("blob", data))
    port = _server_port(s3_store.storage_options)
    before = _sockets_to(port)

    class Sink:
        def __init__(self) -> None:
            self.got = 0

        def begin(self) -> None:
            self.got = 0

        def next_size(self, offset: int, limit: int) -> int:
            return limit

        def receive(self, offset: int, data: memoryview) -> None:
            self.got += len(data)

    async def read_in_parallel(n: int) -> list[int]:
        import asyncio

        sinks = [Sink() for _ in range(n)]
        reads = (
            store.get_range_streamed("blob", start=k << 20, end=(k + 1) << 20, sink=s) for k, s in enumerate(sinks)
        )
        await asyncio.gather(*reads)
        return [sink.got for sink in sinks]

    assert runtime.run_sync(read_in_parallel(4)) == [1 << 20] * 4
    assert _sockets_to(port) > before
    runtime.run_sync(store.close())
    assert _sockets_to(port) <= before + 1  # obstore's pooled connection from the PUT may stay
    assert runtime.run_sync(read_in_parallel(2)) == [1 << 20] * 2
    runtime.run_sync(store.close())
