"""Run the local storage servers from a shell: ``python -m backends.launcher``.

Prints one line of JSON with each server's endpoint, credentials, bucket,
process id and the environment variables a client needs, then keeps the
servers running until SIGINT/SIGTERM, when it stops them and exits 0. The
credentials printed are random and belong to a loopback-only test server.

``--tls`` puts an HTTPS front (:class:`backends.tls.TlsFront`) before each
server and adds its ``tls_endpoint_url``, plus the test CA's ``ca_file`` and
``ca_env`` (what makes clients trust it).

Example::

    python -m backends.launcher --data-dir /tmp/stores > endpoints.json &
    eval "$(jq -r '.s3.env | to_entries[] | "export \\(.key)=\\(.value)"' endpoints.json)"
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import backends  # noqa: F401  (sets the gcsfs environment default)
from backends.gcs import GCSService, start_gcs
from backends.s3 import S3Service, start_s3
from backends.tls import TestCA, TlsFront


def describe_s3(service: S3Service) -> dict[str, Any]:
    return {
        "endpoint_url": service.endpoint_url,
        "access_key": service.access_key,
        "secret_key": service.secret_key,
        "region": service.region,
        "bucket": service.bucket,
        "url": service.url(),
        "pid": service.pid,
        "storage_options": service.storage_options(),
        "env": service.env(),
    }


def describe_gcs(service: GCSService) -> dict[str, Any]:
    return {
        "endpoint_url": service.endpoint_url,
        "bucket": service.bucket,
        "url": service.url(),
        "pid": service.pid,
        "storage_options": service.storage_options(),
        "env": service.env(),
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m backends.launcher", description=__doc__.split("\n")[0])
    parser.add_argument("--no-s3", dest="s3", action="store_false", help="do not start SeaweedFS")
    parser.add_argument("--no-gcs", dest="gcs", action="store_false", help="do not start fake-gcs-server")
    parser.add_argument("--data-dir", type=Path, help="keep server data here (default: temp dirs, removed on exit)")
    parser.add_argument("--bucket", default="objckpt-test", help="bucket to create on each server")
    parser.add_argument("--tls", action="store_true", help="serve each server over HTTPS too, with a test CA")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    services: list[S3Service | GCSService] = []
    fronts: list[TlsFront] = []
    try:
        out: dict[str, Any] = {}
        if args.s3:
            s3_dir = args.data_dir / "s3" if args.data_dir else None
            s3 = start_s3(s3_dir, bucket=args.bucket)
            services.append(s3)
            out["s3"] = describe_s3(s3)
        if args.gcs:
            gcs_dir = args.data_dir / "gcs" if args.data_dir else None
            gcs = start_gcs(gcs_dir, bucket=args.bucket)
            services.append(gcs)
            out["gcs"] = describe_gcs(gcs)
        if args.tls:
            ca = TestCA.create(args.data_dir / "tls" if args.data_dir else None)
            out["ca_file"], out["ca_env"] = str(ca.ca_file), ca.env()
            for service in services:
                host, port = service.endpoint_url.rsplit("/", 1)[1].rsplit(":", 1)
                fronts.append(TlsFront(host, int(port), ca).start())
                out["s3" if isinstance(service, S3Service) else "gcs"]["tls_endpoint_url"] = fronts[-1].endpoint_url
        out["launcher_pid"] = os.getpid()
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
        while not stop.wait(0.5):
            for service in services:
                process = service._process
                if process is not None and not process.alive():
                    sys.stderr.write(f"server {service!r} exited; log tail:\n{process.log_tail()}\n")
                    return 1
        return 0
    finally:
        for front in fronts:
            front.stop()
        for service in reversed(services):
            service.stop()


if __name__ == "__main__":
    sys.exit(main())
