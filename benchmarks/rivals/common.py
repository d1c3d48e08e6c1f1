"""What a measurement knows about its store, and the per-process meters."""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass, field
from typing import Any

BLOB_SIZE = 32 << 20  # objckpt's default blob size: the raw ceiling uses the same objects
CONCURRENCY = 32  # objckpt's default request limit: the raw ceiling uses the same
SCHEMES = {"s3": "s3", "gcs": "gs"}  # store → URL scheme


@dataclass
class Context:
    """One measurement: which store, where, which phase. Passed to the worker on stdin
    (it holds the S3 secret, so never on the command line)."""

    system: str
    store: str  # "s3" | "gcs"
    endpoint: str  # direct, or the latency proxy in front of the server; "" for a real bucket
    bucket: str
    prefix: str  # key prefix of this measurement's checkpoint, no leading/trailing "/"
    workload: str
    phase: str  # "save" | "restore" | "restore_resharded" | "restore_kept" (raw only)
    access_key: str = ""
    secret_key: str = field(default="", repr=False)
    region: str = "us-east-1"
    profile_dir: str = ""  # when set, cProfile the timed call into this folder
    transport: str = "http"  # "http" | "https": how the local endpoint is reached (real buckets: their own)
    ca_file: str = ""  # HTTPS to a local endpoint: the test CA every client of this phase must trust

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def url(self) -> str:
        return f"{SCHEMES[self.store]}://{self.bucket}/{self.prefix}"

    @property
    def real(self) -> bool:
        """A real bucket: every client configures itself from the environment."""
        return not self.endpoint

    def fsspec_options(self) -> dict[str, Any]:
        """s3fs / gcsfs options for this endpoint (what objckpt, DCP and naive take).

        Over HTTPS, s3fs is told the CA as botocore's ``verify`` (objckpt reads the same
        option); gcsfs has no option for it and trusts ``SSL_CERT_FILE`` (:meth:`base_env`).
        """
        if self.real:
            return {}
        if self.store == "s3":
            client: dict[str, Any] = {"endpoint_url": self.endpoint, "region_name": self.region}
            if self.ca_file:
                client["verify"] = self.ca_file
            return {
                "key": self.access_key,
                "secret": self.secret_key,
                "client_kwargs": client,
                "config_kwargs": {"s3": {"addressing_style": "path"}},
            }
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "test"}

    def ca_env(self) -> dict[str, str]:
        """The variables that make every client here trust the test CA: botocore
        (``AWS_CA_BUNDLE``), requests/google-auth (``REQUESTS_CA_BUNDLE``), OpenSSL's
        defaults as aiohttp and obstore's native roots read them (``SSL_CERT_FILE``),
        TensorStore's libcurl (``TENSORSTORE_CA_BUNDLE``) and s3fs-fuse (``CURL_CA_BUNDLE``)."""
        if not self.ca_file:
            return {}
        names = ("AWS_CA_BUNDLE", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "TENSORSTORE_CA_BUNDLE", "CURL_CA_BUNDLE")
        return dict.fromkeys(names, self.ca_file)

    def base_env(self) -> dict[str, str]:
        if self.real:  # the driver's environment, inherited as is
            return {}
        if self.store == "s3":
            return {
                "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_DEFAULT_REGION": self.region,
                "AWS_REGION": self.region,
                **self.ca_env(),
            }
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            **self.ca_env(),
        }


def _status(field_name: str) -> int:
    """A ``/proc/self/status`` size in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def recycle_fresh_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of new memory and free it again, just before a timed call.

    Why: this VM reports free memory to its host (``page_reporting`` on the kernel
    command line), and the host takes back what was reported. The first write to
    such a page then costs a fault in the host as well as the guest's, 1-6 µs a
    page, charged to whichever process draws it (``clear_page_erms`` in perf).
    The kernel hands out pages freed recently before reported ones, so which a
    phase gets depended on how long its worker took to start: measured on one
    medium restore at 40 ms, 0.05-1.6 CPU-s of page clearing for the same 268,000
    faults, and objckpt, whose worker imports JAX, drew the reported pages more
    often than the raw GETs, whose worker starts at once. Every phase of every
    system calls this after its set-up, so each timed call finds the same
    host-backed free memory, as on a machine whose memory is all its own. The
    bytes are freed before the RSS and peak baselines are taken.
    """
    import mmap

    import numpy as np

    if nbytes <= 0 or os.environ.get("BENCH_RECYCLE_MEMORY", "1") == "0":
        return
    region = mmap.mmap(-1, nbytes)
    pages = np.frombuffer(region, dtype=np.uint8)
    pages[:: mmap.PAGESIZE] = 1
    del pages
    region.close()


def rss() -> int:
    return _status("VmRSS")


def peak_rss() -> int:
    return _status("VmHWM")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_seconds() -> float:
    """User + system CPU of this process, all its threads (Rust and C++ pools included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def proc_cpu_seconds(pid: int) -> float:
    """CPU seconds of another process (e.g. a FUSE daemon serving this one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0
