#!/usr/bin/env bash
# objckpt next to the raw ceiling, Orbax, PyTorch DCP and a naive saver, on local S3 and GCS
# servers at 0, 10 and 40 ms RTT. One command; results in benchmarks/results/peers.{md,json,png}.
#   ./benchmarks/run_rivals.sh            # the default plan (45–94 min on 2 cores)
#   ./benchmarks/run_rivals.sh --quick    # medium on S3 at 0 and 10 ms, 3 repeats (10–17 min)
#   ./benchmarks/run_rivals.sh --quick --https   # the same, every cell over HTTP and over HTTPS side by side
#                                              # (test CA, TLS front / TLS latency proxy; about twice as long)
#   ./benchmarks/run_rivals.sh --url gs://bucket/prefix   # against a real bucket (credentials from the environment)
# Any other flag goes to `python -m benchmarks.bench_rivals` (see --help).
set -euo pipefail
. "$(dirname "$0")/../.ci/setup-env"
if ! python -c "import orbax.checkpoint, torch.distributed.checkpoint, matplotlib" 2>/dev/null; then
  echo "installing the bench extra (orbax-checkpoint, torch 2.13.0 CPU, matplotlib) ..."
  python -m pip install -q --disable-pip-version-check -e ".[bench]"
fi
# Orbax has no S3 support of its own; on S3 it saves through an s3fs-fuse mount (Debian's s3fs).
if ! command -v s3fs >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing s3fs-fuse (apt) for Orbax on S3 ..."
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq s3fs) >/dev/null 2>&1 \
    || echo "  could not install s3fs: Orbax on S3 will be reported as skipped"
fi
# Bytecode for objckpt's own modules, as an installed package has: it is an editable
# install here, and where PYTHONDONTWRITEBYTECODE is set every fresh measured process
# would compile the modules it imports lazily inside the timed call (measured: 13 ms
# of a restore). The peers are installed packages, already compiled.
python -m compileall -q objckpt benchmarks >/dev/null
exec python -m benchmarks.bench_rivals "$@"
