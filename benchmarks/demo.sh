#!/usr/bin/env bash
# The main job: save a ~256 MiB sharded model to S3 and restore it onto another mesh.
# With no argument it starts a local S3 server (SeaweedFS); pass a URL to use a real bucket.
set -euo pipefail
. "$(dirname "$0")/../.ci/setup-env"
exec python -m benchmarks.demo "$@"
