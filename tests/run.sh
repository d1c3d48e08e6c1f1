#!/usr/bin/env bash
# The whole test suite: lint, type check, checkov on terraform/, then pytest (which starts
# the local S3 and GCS servers from backends/ itself). Sets up .venv on first use.
#
#   ./tests/run.sh            everything, as CI runs it; pytest on OBJCKPT_TEST_WORKERS
#                             processes (pytest-xdist, default 3; 0 runs in this process)
#   ./tests/run.sh --quick    the inner loop: ruff, then the tests marked `quick` (pure planning
#                             and format tests, one save/restore per store kind; conftest.py)
#
# Other arguments go to pytest: `./tests/run.sh --quick -x`, `./tests/run.sh tests/test_plan.py`.
set -euo pipefail
. "$(dirname "$0")/../.ci/setup-env"
quick=0
args=()
for arg in "$@"; do
  if [ "$arg" = "--quick" ]; then quick=1; else args+=("$arg"); fi
done
workers="${OBJCKPT_TEST_WORKERS:-3}"
if [ "$quick" = 1 ]; then
  echo "== ruff"; ruff check objckpt backends tests benchmarks
  echo "== pytest (quick tier)"
  exec python -m pytest -p no:cacheprovider -m quick -n "${OBJCKPT_TEST_WORKERS:-0}" "${args[@]}"
fi
echo "== ruff"; ruff check objckpt backends tests benchmarks
echo "== mypy"; mypy objckpt
echo "== checkov (terraform/)"; bash terraform/check.sh
echo "== pytest ($workers workers)"
python -m pytest -p no:cacheprovider -n "$workers" --dist loadgroup "${args[@]}"
