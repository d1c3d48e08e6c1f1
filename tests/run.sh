#!/usr/bin/env bash
# The whole test suite: lint, type check, checkov on terraform/, then pytest (which starts
# the local S3 and GCS servers from backends/ itself). Sets up .venv on first use.
set -euo pipefail
. "$(dirname "$0")/../.ci/setup-env"
echo "== ruff"; ruff check objckpt backends tests benchmarks
echo "== mypy"; mypy objckpt
echo "== checkov (terraform/)"; bash terraform/check.sh
echo "== pytest"; python -m pytest -p no:cacheprovider "$@"
