"""Restore's peak memory in a process shaped like a training job, on the local S3 and GCS servers.

    python -m benchmarks.bench_training_restore [--repeats 3] [--layers 8]

Each measurement runs in a fresh child process that builds what a training job holds before it
restores: a Flax NNX decoder (~58 M parameters in bfloat16), an optax AdamW optimizer over it
(its moments in the parameters' dtype, as optax makes them), a grain loader over an in-memory
source that has served a few batches, and one jitted training step taken. The parent saves that
state once per store; the child then restores it onto the abstract target of its own live state
(``jax.ShapeDtypeStruct`` of every leaf, same shape, dtype and sharding) and reports its peak RSS
(``VmHWM`` after ``clear_refs``) above the RSS just before the restore. A second child does the
same restore in a bare process (no flax, optax, grain, no training step: the README's figure).

``--tune-malloc`` restores with ``Options(tune_malloc=True)``. In the training-shaped child,
``OBJCKPT_BENCH_TARGET_KIND=live`` restores onto the live arrays themselves and ``=unsharded``
onto ``ShapeDtypeStruct`` without a sharding; ``OBJCKPT_BENCH_HEAP_CHURN=1`` makes and frees
4–30 MiB numpy buffers just before the restore. Writes
benchmarks/results/training_restore.json (and .md with ``--write``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
MiB = 1 << 20


def rss_mib() -> tuple[float, float]:
    """(current, peak since the last reset) resident set size in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def build_training_state(layers: int, train_step: bool) -> tuple[Any, dict]:
    """A decoder, AdamW over it, a grain loader that has served batches; returns (loader, pure state)."""
    import grain
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    vocab, d, ff, seq = 32000, 512, 2048, 128

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            kw = dict(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=8, in_features=d, decode=False, **kw)
            self.ln1 = nnx.LayerNorm(d, **kw)
            self.ln2 = nnx.LayerNorm(d, **kw)
            self.up = nnx.Linear(d, ff, **kw)
            self.down = nnx.Linear(ff, d, **kw)

        def __call__(self, x: Any) -> Any:
            x = x + self.attn(self.ln1(x))
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    class Decoder(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(vocab, d, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.head = nnx.Linear(d, vocab, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs)

        def __call__(self, tokens: Any) -> Any:
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    model = Decoder(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    source = np.random.default_rng(0).integers(0, vocab, size=(256, seq + 1), dtype=np.int32)
    loader = grain.MapDataset.source(source).shuffle(seed=0).batch(4)
    it = iter(loader.to_iter_dataset())
    batch = next(it)
    for _ in range(3):
        batch = next(it)
    if train_step:

        @nnx.jit
        def step(model: Any, optimizer: Any, batch: Any) -> Any:
            def loss_fn(model: Any) -> Any:
                logits = model(batch[:, :-1]).astype(jnp.float32)
                return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        jax.block_until_ready(step(model, optimizer, jnp.asarray(batch)))
    state = {"model": nnx.to_pure_dict(nnx.state(model, nnx.Param)), "opt": nnx.to_pure_dict(nnx.state(optimizer))}
    return (loader, it, model, optimizer), state


def child(url: str, storage_options: dict, layers: int, shaped: bool, tune_malloc: bool) -> dict:
    """Fresh process: build (or, bare, only shape) the state, then measure one restore."""
    import jax
    import numpy as np

    import objckpt

    if shaped:
        keep, state = build_training_state(layers, train_step=True)
        kind = os.environ.get("OBJCKPT_BENCH_TARGET_KIND", "abstract")
        if kind == "live":  # the live arrays themselves as the target
            target = state
        elif kind == "unsharded":  # what jax.eval_shape / nnx.eval_shape give: no sharding
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        else:
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    else:
        meta = json.loads(os.environ["OBJCKPT_BENCH_TARGET"])
        device = jax.devices()[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        import ml_dtypes

        def unflat(entries: list) -> dict:
            out: dict = {}
            for path, shape, dtype in entries:
                node = out
                keys = [int(k[1:]) if k.startswith("#") else k for k in path]
                for k in keys[:-1]:
                    node = node.setdefault(k, {})
                dt = np.dtype(getattr(ml_dtypes, dtype)) if dtype == "bfloat16" else np.dtype(dtype)
                node[keys[-1]] = jax.ShapeDtypeStruct(tuple(shape), dt, sharding=sharding)
            return out

        target = unflat(meta)
        state = None
    if os.environ.get("OBJCKPT_BENCH_HEAP_CHURN"):
        # What a data pipeline does between steps: large host buffers made and freed. Each
        # free of an mmapped chunk raises glibc's dynamic mmap threshold (up to 32 MiB).
        for mib in (4, 8, 16, 30):
            np.ones(mib * MiB, np.uint8).sum()
    gc.collect()
    before, _ = rss_mib()
    reset_peak()
    t0 = time.perf_counter()
    options = objckpt.Options(tune_malloc=tune_malloc)
    restored = objckpt.restore(url, target, storage_options=storage_options, options=options)
    jax.block_until_ready(restored)
    seconds = time.perf_counter() - t0
    after, peak = rss_mib()
    leaves = jax.tree.leaves(restored)
    restored_bytes = sum(x.nbytes for x in leaves)
    if state is not None:
        same = all(bool((np.asarray(a) == np.asarray(b)).all()) for a, b in zip(leaves, jax.tree.leaves(state)))
        assert same, "restored state differs from the saved one"
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what is left is live memory, not free heap glibc keeps
    trimmed, _ = rss_mib()
    return {
        "shaped": shaped,
        "tune_malloc": tune_malloc,
        "before_mib": before,
        "peak_above_before_mib": peak - before,
        "after_above_before_mib": after - before,
        "trimmed_above_before_mib": trimmed - before,
        "restored_mib": restored_bytes / MiB,
        "excess_mib": peak - before - restored_bytes / MiB,
        "seconds": seconds,
    }


def _key(entry: Any) -> str:
    """A path entry as a string; integer keys (nnx.List indices) marked with '#'."""
    key = getattr(entry, "key", getattr(entry, "idx", entry))
    return f"#{key}" if isinstance(key, int) else str(key)


def run_child(url: str, so: dict, args: argparse.Namespace, shaped: bool, target: list) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_training_restore", "--child", url, "--layers", str(args.layers)]
    cmd += ["--shaped"] if shaped else []
    cmd += ["--tune-malloc"] if args.tune_malloc else []
    env = dict(os.environ, OBJCKPT_BENCH_STORAGE_OPTIONS=json.dumps(so), OBJCKPT_BENCH_TARGET=json.dumps(target))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--stores", default="s3,gcs")
    parser.add_argument("--tune-malloc", action="store_true")
    parser.add_argument("--shaped", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--label", default="")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.child:
        so = json.loads(os.environ["OBJCKPT_BENCH_STORAGE_OPTIONS"])  # not argv: it holds credentials
        print(json.dumps(child(args.child, so, args.layers, args.shaped, args.tune_malloc)))
        return

    import jax

    import objckpt
    from backends.gcs import start_gcs
    from backends.s3 import start_s3

    _, state = build_training_state(args.layers, train_step=True)
    params = sum(x.size for x in jax.tree.leaves(state["model"]))
    target = [
        ([_key(k) for k in path], list(x.shape), str(x.dtype)) for path, x in jax.tree_util.tree_leaves_with_path(state)
    ]
    rows: list[dict] = []
    for store in args.stores.split(","):
        service = start_s3() if store == "s3" else start_gcs()
        try:
            so = service.storage_options()
            url = service.url(f"train/{uuid.uuid4().hex[:8]}")
            objckpt.save(url, state, storage_options=so)
            for _ in range(args.repeats):
                for shaped in (True, False):
                    row = run_child(url, so, args, shaped, target) | {"store": store}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            service.stop()
    summary = {}
    for store in args.stores.split(","):
        for shaped in (True, False):
            sel = [r for r in rows if r["store"] == store and r["shaped"] == shaped]
            key = f"{store} {'training-shaped' if shaped else 'bare'}"
            summary[key] = {
                "peak_above_before_mib_median": statistics.median(r["peak_above_before_mib"] for r in sel),
                "peak_above_before_mib_max": max(r["peak_above_before_mib"] for r in sel),
                "excess_mib_median": statistics.median(r["excess_mib"] for r in sel),
                "excess_mib_max": max(r["excess_mib"] for r in sel),
                "trimmed_excess_mib_max": max(r["trimmed_above_before_mib"] - r["restored_mib"] for r in sel),
                "restored_mib": sel[0]["restored_mib"],
            }
    report = {"params": params, "tune_malloc": args.tune_malloc, "label": args.label, "rows": rows, "summary": summary}
    print(json.dumps(summary, indent=1))
    if args.write:
        path = RESULTS / "training_restore.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        old[args.label or "run"] = report
        path.write_text(json.dumps(old, indent=1) + "\n")


if __name__ == "__main__":
    main()
