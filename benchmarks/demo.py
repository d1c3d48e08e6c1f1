"""Demo: save a sharded ~256 MiB model to an object store and restore it on another mesh.

    python -m benchmarks.demo                      # local S3 server (SeaweedFS), started here
    python -m benchmarks.demo s3://bucket/prefix   # a real bucket; credentials from the environment

Saves over a (4, 2) mesh of 8 CPU devices, restores onto a (2, 4) mesh with
other axis names, checks every byte, and prints what it did.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import objckpt  # noqa: E402


def make_model(mesh: jax.sharding.Mesh, total_mib: int = 256) -> dict:
    """A transformer-like state: 2-D weights sharded on both axes, Adam moments, a step."""
    layers = 4
    d = 1024
    per_layer = total_mib * (1 << 20) // layers // 3 // 4  # three float32 copies (param, mu, nu)
    ff = per_layer // d // 64 * 64  # divisible by every mesh axis
    key = jax.random.key(0)
    params, mu, nu = {}, {}, {}
    for i in range(layers):
        key, k1 = jax.random.split(key)
        w = jax.random.normal(k1, (d, ff), jnp.float32)
        sharding = NamedSharding(mesh, P("data", "model"))
        params[f"layer{i}"] = {
            "w": jax.device_put(w, sharding),
            "scale": jax.device_put(jnp.ones((d,), jnp.bfloat16), NamedSharding(mesh, P())),
        }
        mu[f"layer{i}"] = jax.device_put(w * 0.1, sharding)
        nu[f"layer{i}"] = jax.device_put(w * w, sharding)
    return {
        "params": params,
        "opt_state": {"mu": mu, "nu": nu},
        "step": 1000,
        "data_iterator": {"epoch": 3, "position": 123456},
    }


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", nargs="?", help="where to save (default: a local S3 server started here)")
    parser.add_argument("--mib", type=int, default=256, help="model size in MiB (default 256)")
    args = parser.parse_args()

    with contextlib.ExitStack() as stack:
        if args.url:
            url, storage_options = args.url.rstrip("/") + f"/demo-{uuid.uuid4().hex[:8]}", None
            print(f"using {url} (credentials from the environment)")
        else:
            from backends.launcher import start_s3

            print("starting a local S3 server (SeaweedFS) ...", flush=True)
            service = stack.enter_context(start_s3())
            url, storage_options = service.url(f"demo/{uuid.uuid4().hex[:8]}"), service.storage_options()
            print(f"  S3 endpoint {service.endpoint_url}, bucket {service.bucket}")

        devices = jax.devices()
        print(f"{len(devices)} {devices[0].platform.upper()} devices, JAX {jax.__version__}")
        save_mesh = jax.make_mesh((4, 2), ("data", "model"))
        state = jax.block_until_ready(make_model(save_mesh, args.mib))
        total = nbytes(state)
        print(
            f"model: {len(jax.tree_util.tree_leaves(state))} leaves, {total / 2**20:.1f} MiB, sharded over mesh {dict(save_mesh.shape)}"
        )

        t0 = time.perf_counter()
        handle = objckpt.save_async(url, state, storage_options=storage_options)
        handle.result()
        t_save = time.perf_counter() - t0
        print(
            f"saved    {handle.bytes_written / 2**20:8.1f} MiB in {handle.stats.objects_written} objects"
            f" ({handle.stats.requests} requests) in {t_save:.2f} s = {handle.bytes_written / t_save / 2**30:.3f} GiB/s"
            f"  [blocked {handle.seconds_blocked:.2f} s]  -> {url}"
        )

        info = objckpt.inspect(url, storage_options=storage_options)
        print(
            f"manifest: {len(info.leaves)} leaves, {info.total_bytes / 2**20:.1f} MiB, {info.num_blobs} blobs, format v{info.format_version}"
        )

        restore_mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))

        def retarget(x):
            if isinstance(x, jax.Array):
                spec = P("tensor", "fsdp") if x.ndim == 2 else P()
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(restore_mesh, spec))
            return x

        target = jax.tree_util.tree_map(retarget, state)
        stats = objckpt.TransferStats()
        t0 = time.perf_counter()
        restored = objckpt.restore(url, target, storage_options=storage_options, stats=stats)
        t_restore = time.perf_counter() - t0
        print(
            f"restored {stats.bytes_read / 2**20:8.1f} MiB in {stats.requests} ranged reads in {t_restore:.2f} s"
            f" = {stats.bytes_read / t_restore / 2**30:.3f} GiB/s  onto mesh {dict(restore_mesh.shape)}"
        )

        mismatched = []
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree_util.tree_leaves(restored)):
            if isinstance(a, jax.Array):
                same = np.asarray(a).tobytes() == np.asarray(b).tobytes() and b.sharding == retarget(a).sharding
            else:
                same = a == b
            if not same:
                mismatched.append(jax.tree_util.keystr(path))
        if mismatched:
            raise SystemExit(f"MISMATCH in {len(mismatched)} leaves: {mismatched[:5]}")
        print(f"bit-exact: all {len(jax.tree_util.tree_leaves(state))} leaves match, on the new shardings")


if __name__ == "__main__":
    main()
