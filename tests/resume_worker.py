"""One process of tests/test_resume_sigkill.py: a small training job that resumes where it left off.

The job is what a user runs: an MLP's params and its optax AdamW state sharded over
every device of the job, an RNG key (raw key data, replicated) split inside the jitted
step for dropout, a grain ``DataLoader`` sharded over the processes, and a JSON
config. ``CheckpointManager(save_rules=SavePolicy(save_interval_steps=...))`` saves the whole state as one
tree: the arrays, ``objckpt.PerProcess(iterator.get_state())`` and ``objckpt.Json(config)``.
On start it restores ``mgr.latest_step()`` (if any) and runs to the last step.

The test SIGKILLs every process at some point and starts the job again, so this
process writes what it did to its log file (``job["log"]``, ``{process}`` filled
in; one line per event, flushed at once so a SIGKILL loses none), which the test
compares with an uninterrupted run's:

- ``start S``: the step restored (-1: none), ``restored S D``: the state's digest after the restore;
- ``batch s D``: the digest of the batch this process drew at step ``s``;
- ``state s D``: the digest of this process's part of the state after step ``s``
  (its shards of params and optimizer state, the RNG key, the iterator's position);
- ``save s``: ``mgr.save`` started step ``s`` (it returned True; the upload is in flight);
- ``committed s``: this process knows step ``s`` committed; ``done``: the run ended.

Run as a script by the test, one per process, with the job in OBJCKPT_RESUME_JOB. It
turns on JAX's CPU collectives (gloo) itself: a test's choice, never objckpt's.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt

STARTED = time.monotonic()  # after the imports: phase() also gives the CPU time, imports included
PROCESS = int(os.environ.get("OBJCKPT_MP_PROCESS", "0"))
COUNT = int(os.environ.get("OBJCKPT_MP_COUNT", "1"))
D_IN, HIDDEN, D_OUT = 8, 64, 4
RECORDS = 96  # records per epoch: a 32-step run crosses several epochs on every process


class Source:
    """Records made from their index alone, with a stable ``repr`` (grain keeps it in its state)."""

    def __len__(self) -> int:
        return RECORDS

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        g = np.random.default_rng(1000 + i)
        return {
            "x": g.standard_normal(D_IN).astype(np.float32),
            "y": g.standard_normal(D_OUT).astype(np.float32),
            "i": np.int32(i),
        }

    def __repr__(self) -> str:
        return f"Source({RECORDS})"


def loader(job: dict[str, Any]) -> Any:
    import grain.python as gp

    sampler = gp.IndexSampler(
        RECORDS, shard_options=gp.ShardOptions(PROCESS, COUNT), shuffle=True, num_epochs=None, seed=job["seed"]
    )
    batch = gp.Batch(job["batch_per_process"], drop_remainder=True)
    return gp.DataLoader(data_source=Source(), sampler=sampler, operations=[batch], worker_count=0)


def digest(*parts: Any) -> str:
    """sha256 of this process's part of the given values: every addressable shard's index and
    bytes (by device id), numpy arrays' bytes, bytes and str as they are."""
    h = hashlib.sha256()
    for part in parts:
        for leaf in jax.tree.leaves(part):
            if isinstance(leaf, jax.Array):
                for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
                    h.update(repr(shard.index).encode())
                    h.update(np.asarray(shard.data).tobytes())
            elif isinstance(leaf, bytes):
                h.update(leaf)
            elif isinstance(leaf, str):
                h.update(leaf.encode())
            else:
                h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:32]


class Log:
    """This process's event log: one line per event, written through at once."""

    def __init__(self, path: str) -> None:
        self._file: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 (open for the whole run)

    def __call__(self, *words: Any) -> None:
        self._file.write(" ".join(map(str, words)) + "\n")
        self._file.flush()


def phase(name: str) -> None:
    """Say on stderr (the test's output file) when this process got here: wall time since its
    imports, CPU time since it started (the test's cost is mostly these processes' CPU)."""
    wall, cpu = time.monotonic() - STARTED, time.process_time()
    print(f"process {PROCESS}: {name} at {wall:.2f} s ({cpu:.2f} CPU-s)", file=sys.stderr, flush=True)


def run(job: dict[str, Any], log: Log) -> None:
    import optax

    # Auto axes: XLA places the intermediates (data-sharded batch times model-sharded w1)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def sharding(*spec: Any) -> NamedSharding:
        return NamedSharding(mesh, P(*spec))

    shapes = {"w1": (D_IN, HIDDEN), "b1": (HIDDEN,), "w2": (HIDDEN, D_OUT), "b2": (D_OUT,)}
    param_shardings = {
        "w1": sharding(None, "data"),
        "b1": sharding("data"),
        "w2": sharding("data", None),
        "b2": sharding(),
    }
    init = np.random.default_rng(job["seed"])
    params = {}
    for name, shape in shapes.items():
        host = (init.standard_normal(shape) * 0.3).astype(np.float32)
        params[name] = jax.make_array_from_callback(shape, param_shardings[name], lambda idx, host=host: host[idx])
    replicated = sharding()
    key_data = np.asarray(jax.random.key_data(jax.random.key(job["seed"])))
    key = jax.make_array_from_callback(key_data.shape, replicated, lambda idx: key_data[idx])

    tx = optax.adamw(learning_rate=job["lr"], weight_decay=1e-2)

    def opt_sharding(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        name = getattr(path[-1], "key", None) if path else None  # mu/nu mirror the params' dict
        return param_shardings[name] if name in param_shardings else replicated

    opt_shardings = jax.tree_util.tree_map_with_path(opt_sharding, jax.eval_shape(tx.init, params))
    opt = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    batch_shardings = {"x": sharding("data"), "y": sharding("data")}

    def loss_fn(params: Any, batch: Any, key: jax.Array) -> jax.Array:
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        h = jnp.where(keep, h / 0.9, 0.0)
        out = h @ params["w2"] + params["b2"]
        return jnp.mean((out - batch["y"]) ** 2)

    def step_fn(params: Any, opt: Any, key: jax.Array, batch: Any) -> Any:
        key, sub = jax.random.split(key)
        grads = jax.grad(loss_fn)(params, batch, sub)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, key

    train_step = jax.jit(
        step_fn,
        in_shardings=(param_shardings, opt_shardings, replicated, batch_shardings),
        out_shardings=(param_shardings, opt_shardings, replicated),
        donate_argnums=(0, 1, 2),  # as training loops do: the saved snapshot must own its bytes
    )

    steps = int(job["steps"])
    mgr = objckpt.CheckpointManager(
        job["url"],
        storage_options=job.get("storage_options") or {},
        save_rules=objckpt.SavePolicy(save_interval_steps=job["save_interval_steps"], final_step=steps - 1),
    )
    iterator = iter(loader(job))
    start = mgr.latest_step()
    log("start", -1 if start is None else start)
    if start is not None:
        target = {
            "params": params,
            "opt": opt,
            "rng": key,
            "step": 0,
            "data": objckpt.PerProcess(),
            "config": objckpt.Json(),
        }
        out = mgr.restore(start, target)
        if out["step"] != start or out["config"] != job["config"]:
            raise AssertionError(f"step {start} restored step {out['step']} and config {out['config']!r}")
        params, opt, key = out["params"], out["opt"], out["rng"]
        iterator.set_state(out["data"])
        log("restored", start, digest(params, opt, key, iterator.get_state()))
        phase(f"restored step {start}")
    pending: int | None = None  # the step whose save this process has not yet seen commit
    start_step = 0 if start is None else start + 1
    for step in range(start_step, steps):
        local = next(iterator)
        log("batch", step, digest(local["x"], local["y"], local["i"]))
        batch = {
            name: jax.make_array_from_process_local_data(batch_shardings[name], local[name]) for name in ("x", "y")
        }
        params, opt, key = train_step(params, opt, key, batch)
        log("state", step, digest(params, opt, key, iterator.get_state()))
        if step == start_step:
            phase(f"first step {step}")
        state = {
            "params": params,
            "opt": opt,
            "rng": key,
            "step": step,
            "data": objckpt.PerProcess(iterator.get_state()),
            "config": objckpt.Json(job["config"]),
        }
        if mgr.save(step, state):  # waits for the previous save's commit first
            if pending is not None:
                log("committed", pending)
            pending = step
            log("save", step)
        if pending is not None and not mgr.is_saving_in_progress():
            mgr.wait()  # re-raises the save's error, if it failed
            log("committed", pending)
            pending = None
    mgr.close()
    if pending is not None:
        log("committed", pending)
    log("done")
    phase("done")


def main() -> None:
    job = json.loads(os.environ["OBJCKPT_RESUME_JOB"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    phase("imported")
    if COUNT > 1:  # before any other JAX call
        jax.distributed.initialize(
            f"127.0.0.1:{os.environ['OBJCKPT_MP_PORT']}",
            num_processes=COUNT,
            process_id=PROCESS,
            initialization_timeout=60,
            heartbeat_timeout_seconds=30,
            shutdown_timeout_seconds=30,
        )
    try:
        run(job, Log(job["log"].format(process=PROCESS)))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # a peer left in JAX's shutdown barrier would hang
    if COUNT > 1:
        jax.distributed.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
