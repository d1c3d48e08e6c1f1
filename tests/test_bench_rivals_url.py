"""The peers benchmark against a bucket named by URL (``--url``), as a cloud VM runs it.

The local S3 server stands in for the real bucket: its endpoint and keys reach the
benchmark only through ``AWS_*`` variables, the way a VM's credentials would, never on
the command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends import S3Service
from benchmarks import bench_rivals
from benchmarks.rivals.endpoints import Buckets

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_url_runs_raw_and_objckpt_against_the_bucket_and_cleans_up(s3_service: S3Service, tmp_path: Path) -> None:
    import obstore as obs

    root = "bench-url-test"
    env = {**os.environ, **s3_service.env(), "PYTHONPATH": str(REPO)}
    env.pop("STORAGE_EMULATOR_HOST", None)
    argv = [sys.executable, "-m", "benchmarks.bench_rivals", "--url", s3_service.url(root)]
    argv += [
        "--workloads",
        "small",
        "--systems",
        "raw,objckpt",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
        "--name",
        "b",
    ]
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = json.loads((tmp_path / "b.json").read_text())
    assert result["meta"]["real_buckets"] is True
    assert f"s3://{s3_service.bucket}/{root}" in result["meta"]["machine"]
    measured = [r for r in result["samples"] if r["rep"] == 0]
    assert {(r["system"], r["phase"]) for r in measured if "seconds" in r} == {
        ("raw", "save"),
        ("raw", "restore"),
        ("raw", "restore_kept"),
        ("objckpt", "save"),
        ("objckpt", "restore"),
        ("objckpt", "restore_resharded"),
    }
    assert all(r["verified"] for r in measured if r["system"] == "objckpt" and r["phase"] != "save")
    saves = {r["system"]: r for r in measured if r["phase"] == "save"}
    assert saves["raw"]["objects_listed"] == 2  # 64 MiB in 32 MiB objects, listed under the URL's prefix
    assert saves["objckpt"]["objects_listed"] >= 3  # blobs + manifest
    assert saves["objckpt"]["bytes_stored"] >= saves["objckpt"]["bytes"]
    left = [m["path"] for batch in obs.list(s3_service.obstore_client(), root + "/") for m in batch]
    assert left == [], f"the run left objects behind: {left[:5]}"
    logs = "".join(p.read_text() for p in (tmp_path / "b-logs").glob("*.log"))
    assert "==== " in logs and all(
        line.split()[-1].startswith(f"{root}/bench-peers/") for line in logs.splitlines() if line.startswith("==== ")
    ), "every measurement writes below the URL's prefix"
    written = (tmp_path / "b.json").read_text() + (tmp_path / "b.md").read_text() + done.stdout + done.stderr + logs
    assert s3_service.secret_key not in written


def test_url_is_checked_and_excludes_local_options() -> None:
    with pytest.raises(SystemExit):
        bench_rivals.parse(["--url", "http://example.com/x"])
    with pytest.raises(SystemExit):
        bench_rivals.parse(["--url", "s3://a/x", "--url", "s3://b/y"])  # one bucket per store
    with pytest.raises(SystemExit):
        bench_rivals.parse(["--url", "gs://a/x", "--profiles", "0,40"])  # a real bucket's RTT is its own
    args = bench_rivals.parse(["--url", "s3://a/runs/", "--url", "gs://b"])
    assert args.plan == {"medium": {"s3": (0,), "gcs": (0,)}} and args.stores == ["s3", "gcs"]


def test_buckets_keep_every_key_under_the_url_prefix() -> None:
    buckets = Buckets(["s3://a/runs/x/", "gs://b"])
    s3 = buckets.context("s3", 0, system="objckpt", prefix="bench-peers/1/r0", workload="small", phase="save")
    assert (s3.url, s3.real, s3.fsspec_options(), s3.base_env()) == ("s3://a/runs/x/bench-peers/1/r0", True, {}, {})
    gcs = buckets.context("gcs", 0, system="raw", prefix="bench-peers/1/r0", workload="small", phase="save")
    assert gcs.url == "gs://b/bench-peers/1/r0"
    shown = Buckets(["s3://key:hunter2@a/runs?x=1"]).describe()
    assert "s3://a/runs" in shown and "hunter2" not in shown and "key" not in shown
    with pytest.raises(ValueError, match="no added latency"):
        buckets.context("s3", 10, system="raw", prefix="p", workload="small", phase="save")
