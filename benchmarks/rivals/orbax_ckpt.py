"""Orbax (orbax-checkpoint) with default options: ``StandardCheckpointer`` save and
restore of the sharded tree onto the same abstract tree (ShapeDtypeStruct + sharding).

- GCS emulator: natively. TensorStore's ``gcs`` driver reads
  ``TENSORSTORE_GCS_HTTP_URL`` (the emulator or the latency proxy) and
  ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` (a fixed bearer token, which the emulator
  ignores, instead of asking a metadata server); Orbax's directory operations go
  through ``etils.epath`` → gcsfs, configured by ``FSSPEC_GCS_*`` variables.
- S3: Orbax has no S3 path of its own: for an ``s3://`` directory it builds a
  TensorStore ``file`` spec (``_build_ocdbt_kvstore_tspec`` then fails with
  "Checkpoint path should be absolute. Got s3:/..."), although TensorStore has an
  ``s3`` driver. So the S3 bucket is mounted with **s3fs-fuse** (Debian package
  ``s3fs``; talks the S3 API to the same endpoint, through the same latency proxy)
  and Orbax saves to the mounted local path, as users without GCS do. The FUSE
  daemon's CPU time is added to Orbax's. Skipped, with the reason, where
  ``s3fs`` or ``/dev/fuse`` is missing.
- HTTPS (``--https``): TensorStore's libcurl trusts the test CA through
  ``TENSORSTORE_CA_BUNDLE``, gcsfs through ``SSL_CERT_FILE``, and s3fs-fuse through
  ``CURL_CA_BUNDLE`` (all set by ``Context.base_env``); s3fs-fuse gets the ``https://``
  endpoint as its ``url``.
- Real buckets (``--url``): GCS natively, with the environment's credentials; S3 is
  skipped (the s3fs-fuse route is set up for the local server's static keys only).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

from benchmarks.rivals import workloads
from benchmarks.rivals.common import Context, proc_cpu_seconds

NAME = "orbax"
_mount: dict[str, Any] = {}


def env(ctx: Context) -> dict[str, str]:
    if ctx.store == "gcs" and not ctx.real:
        return {
            "TENSORSTORE_GCS_HTTP_URL": ctx.endpoint,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
            "FSSPEC_GCS_ENDPOINT_URL": ctx.endpoint,
            "FSSPEC_GCS_TOKEN": "anon",
        }
    return {}


def supports(ctx: Context) -> str | None:
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError:
        return "orbax-checkpoint not installed (pip install -e '.[bench]')"
    if ctx.store == "s3":
        if ctx.real:
            return "Orbax has no S3 support; the s3fs-fuse route is set up for the local server only"
        if not shutil.which("s3fs"):
            return "Orbax has no S3 support; the s3fs-fuse route needs the 's3fs' binary (apt-get install s3fs)"
        if not os.path.exists("/dev/fuse"):
            return "Orbax has no S3 support; the s3fs-fuse route needs /dev/fuse"
    return None


def _directory(ctx: Context) -> str:
    if ctx.store == "gcs":
        return ctx.url
    if not _mount:
        _mount_bucket(ctx)
    return os.path.join(_mount["dir"], ctx.prefix)


def _mount_bucket(ctx: Context) -> None:
    mnt = tempfile.mkdtemp(prefix="orbax-s3fs-")
    fd, pw = tempfile.mkstemp(prefix="orbax-s3fs-pw-")
    with os.fdopen(fd, "w") as f:
        f.write(f"{ctx.access_key}:{ctx.secret_key}\n")
    argv = ["s3fs", ctx.bucket, mnt, "-f", "-o", f"passwd_file={pw}", "-o", f"url={ctx.endpoint}"]
    argv += ["-o", "use_path_request_style", "-o", f"endpoint={ctx.region}"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not os.path.ismount(mnt):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"s3fs-fuse did not mount: {proc.stderr.read().decode()[-500:] if proc.stderr else ''}")
        time.sleep(0.05)
    _mount.update(dir=mnt, proc=proc, passwd=pw)


def finish(ctx: Context) -> None:
    """Unmount the bucket (after the measurement)."""
    if not _mount:
        return
    subprocess.run(["fusermount", "-u", _mount["dir"]], check=False, capture_output=True)
    proc = _mount["proc"]
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    os.unlink(_mount["passwd"])
    os.rmdir(_mount["dir"])
    _mount.clear()


def _helper_cpu() -> float:
    return proc_cpu_seconds(_mount["proc"].pid) if _mount else 0.0


def prepare_save(ctx: Context, workload: workloads.Workload) -> Any:
    _directory(ctx)
    return workloads.jax_tree(workload)


def prepare_restore(ctx: Context, workload: workloads.Workload, resharded: bool) -> Any:
    _directory(ctx)
    return workloads.abstract_tree(workload, "reshard" if resharded else "save")


def save(ctx: Context, workload: workloads.Workload, state: Any) -> dict:
    import orbax.checkpoint as ocp

    cpu0 = _helper_cpu()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(_directory(ctx), state)
    checkpointer.wait_until_finished()
    checkpointer.close()
    return {"helper_cpu_s": _helper_cpu() - cpu0}


def restore(ctx: Context, workload: workloads.Workload, target: Any) -> tuple[list, dict]:
    import jax
    import orbax.checkpoint as ocp

    cpu0 = _helper_cpu()
    checkpointer = ocp.StandardCheckpointer()
    tree = checkpointer.restore(_directory(ctx), target)
    jax.block_until_ready(tree)
    checkpointer.close()
    if int(tree["step"]) != workload.step:
        raise RuntimeError(f"step restored as {tree['step']!r}")
    return workloads.flat(workload, tree), {"helper_cpu_s": _helper_cpu() - cpu0}
