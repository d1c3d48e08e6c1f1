"""The raw ceiling: plain concurrent PUTs and GETs of the same bytes in objects of
objckpt's blob size, with the fastest client that reaches the store and no
checkpoint logic at all (no planning, no checksums, no manifest, no arrays).

- S3: obstore (Rust, object_store), single-request PUTs, ranged GETs: measured the
  fastest client against SeaweedFS (``benchmarks/bench_stores.py``).
- GCS: gcsfs (aiohttp, JSON API). obstore's ``GCSStore`` cannot reach
  fake-gcs-server: with ``skip_signature`` it still asks the metadata server for
  a token (measured: ``Error performing token request``), and it speaks the XML
  API for writes, which the emulator does not take.
- Real buckets (``--url``): obstore for both, configured from the environment.
- HTTPS (``--https``): obstore trusts the test CA as its ``root_certificate`` and, as
  botocore and objckpt do over HTTPS, sends unsigned payloads (no SHA-256 of the body);
  gcsfs trusts it through ``SSL_CERT_FILE``.

Its restore drops each response as it lands: the store's limit, which the targets are
measured against. The ``restore_kept`` phase makes the same requests and keeps every
response until the phase ends, as a restore must keep what it read; it is reported
beside the other, for reference. The two differ by what fresh memory costs: a dropping
client recycles the same ~1 GiB of pages (32 responses in flight) while a keeping one
takes new pages for every byte, and on this VM the first touch of memory costs up to
1.1 CPU-s/GiB, depending on the day (4 GiB from S3 at 0 ms, the same requests: 3.84 s
dropped against 5.50 s kept one morning, 4.30 against 4.40 s that afternoon).
"""

from __future__ import annotations

import asyncio
from typing import Any

from benchmarks.rivals import workloads
from benchmarks.rivals.common import BLOB_SIZE, CONCURRENCY, Context

NAME = "raw"

#: The responses a ``restore_kept`` phase keeps: alive until the process exits, after
#: its peak RSS and time are taken.
_KEPT: list[Any] = []


def env(ctx: Context) -> dict[str, str]:
    return {}


def supports(ctx: Context) -> str | None:
    # The client library is imported untimed, as every system's is.
    if _uses_obstore(ctx):
        import obstore  # noqa: F401
    else:
        import gcsfs  # noqa: F401
    return None


def _sizes(total: int) -> list[int]:
    return [BLOB_SIZE] * (total // BLOB_SIZE) + ([total % BLOB_SIZE] if total % BLOB_SIZE else [])


def _keys(ctx: Context, n: int) -> list[str]:
    return [f"{ctx.prefix}/{i:03x}/blob-{i:05d}" for i in range(n)]


def prepare_save(ctx: Context, workload: workloads.Workload) -> memoryview:
    import numpy as np

    buf = np.empty(workload.nbytes, np.uint8)
    offset = 0
    for leaf in workload.leaves:
        data = workloads.leaf_values(leaf).view(np.uint8).reshape(-1)
        buf[offset : offset + data.size] = data
        offset += data.size
    return memoryview(buf)


def prepare_restore(ctx: Context, workload: workloads.Workload, resharded: bool) -> list[int]:
    return _sizes(workload.nbytes)


def _uses_obstore(ctx: Context) -> bool:
    return ctx.store == "s3" or ctx.real


def _client(ctx: Context) -> Any:
    if ctx.real:
        from benchmarks.rivals.endpoints import bucket_client

        return bucket_client(ctx.store, ctx.bucket)
    if ctx.store == "s3":
        from obstore.store import S3Store

        https = ctx.endpoint.startswith("https://")
        options: Any = {"allow_http": not https, "timeout": "600s"}
        if ctx.ca_file:
            with open(ctx.ca_file, "rb") as f:
                options["root_certificate"] = f.read()
        return S3Store(
            ctx.bucket,
            endpoint=ctx.endpoint,
            access_key_id=ctx.access_key,
            secret_access_key=ctx.secret_key,
            region=ctx.region,
            virtual_hosted_style_request=False,
            # botocore's rule, which objckpt follows: no payload hash over HTTPS (TLS guards the body)
            unsigned_payload=https,
            client_options=options,
        )
    import gcsfs

    return gcsfs.GCSFileSystem(asynchronous=True, skip_instance_cache=True, **ctx.fsspec_options())


async def _put_all(ctx: Context, data: memoryview) -> None:
    sizes = _sizes(len(data))
    keys = _keys(ctx, len(sizes))
    client = _client(ctx)
    sem = asyncio.Semaphore(CONCURRENCY)

    async def put(i: int) -> None:
        chunk = data[i * BLOB_SIZE : i * BLOB_SIZE + sizes[i]]
        async with sem:
            if _uses_obstore(ctx):
                import obstore as obs

                await obs.put_async(client, keys[i], chunk, use_multipart=False)
            else:
                await client._pipe_file(f"{ctx.bucket}/{keys[i]}", bytes(chunk))

    await asyncio.gather(*(put(i) for i in range(len(sizes))))


async def _get_all(ctx: Context, sizes: list[int], keep: bool) -> int:
    keys = _keys(ctx, len(sizes))
    client = _client(ctx)
    sem = asyncio.Semaphore(CONCURRENCY)
    total = 0

    async def get(i: int) -> None:
        nonlocal total
        async with sem:
            if _uses_obstore(ctx):
                import obstore as obs

                got = await obs.get_range_async(client, keys[i], start=0, end=sizes[i])
            else:
                got = await client._cat_file(f"{ctx.bucket}/{keys[i]}", start=0, end=sizes[i])
            total += len(memoryview(got))
            if keep:
                _KEPT.append(got)

    await asyncio.gather(*(get(i) for i in range(len(sizes))))
    return total


def save(ctx: Context, workload: workloads.Workload, state: memoryview) -> dict:
    asyncio.run(_put_all(ctx, state))
    return {"objects": len(_sizes(len(state))), "requests": len(_sizes(len(state)))}


def restore(ctx: Context, workload: workloads.Workload, target: list[int]) -> tuple[None, dict]:
    got = asyncio.run(_get_all(ctx, target, keep=ctx.phase == "restore_kept"))
    if got != sum(target):
        raise RuntimeError(f"raw GET returned {got} bytes, expected {sum(target)}")
    return None, {"requests": len(target), "bytes_read": got}
