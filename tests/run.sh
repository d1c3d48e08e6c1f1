#!/usr/bin/env bash
# The whole test suite: lint, type check, checkov on terraform/, then pytest (which starts
# the local S3 and GCS servers from backends/ itself, runs every example of README.md and docs/,
# and builds the documentation site with `mkdocs build --strict`: tests/test_api_reference.py).
# Sets up .venv on first use.
#
#   ./tests/run.sh            everything, as CI runs it; pytest on OBJCKPT_TEST_WORKERS
#                             processes (pytest-xdist, default 3; 0: one process), then the
#                             tests marked `serial` in one process, then the quick tier on the
#                             newest JAX (tests/newest_jax.sh: Python 3.12, .venv-newest)
#   ./tests/run.sh --quick    the inner loop: ruff, then the tests marked `quick` (pure planning
#                             and format tests, one save/restore per store kind; conftest.py)
#
# Other arguments go to pytest: `./tests/run.sh --quick -x`, `./tests/run.sh tests/test_plan.py`.
set -euo pipefail
. "$(dirname "$0")/../.ci/setup-env"
quick=0
marks=0  # the caller selects by marker (-m): one run, on the workers
args=()
for arg in "$@"; do
  if [ "$arg" = "--quick" ]; then quick=1; else args+=("$arg"); fi
  case "$arg" in -m*) marks=1 ;; esac
done
workers="${OBJCKPT_TEST_WORKERS:-3}"
if [ "$quick" = 1 ]; then
  echo "== ruff"; ruff check objckpt backends tests benchmarks docs/_mkdocs
  echo "== pytest (quick tier)"
  exec python -m pytest -p no:cacheprovider -m quick -n "${OBJCKPT_TEST_WORKERS:-0}" "${args[@]}"
fi
echo "== ruff"; ruff check objckpt backends tests benchmarks docs/_mkdocs
echo "== mypy"; mypy objckpt
echo "== checkov (terraform/)"; bash terraform/check.sh
pytest=(python -m pytest -p no:cacheprovider)
if [ "$workers" = 0 ]; then
  echo "== pytest"
  exec "${pytest[@]}" "${args[@]}"
fi
if [ "$marks" = 1 ]; then
  echo "== pytest ($workers workers)"
  exec "${pytest[@]}" -n "$workers" --dist loadgroup "${args[@]}"
fi
# The tests marked `serial` (a wall-clock bound of a second or two) run after the others,
# in one process, so that no busy worker beside them decides their outcome.
echo "== pytest ($workers workers)"
rc=0
"${pytest[@]}" -n "$workers" --dist loadgroup -m "not serial" "${args[@]}" || rc=$?
echo "== pytest (serial)"
serial_rc=0
"${pytest[@]}" -m serial "${args[@]}" || serial_rc=$?
# pytest's 5: the arguments selected no test in that run; a failure only if in both.
if [ "$rc" = 5 ] && [ "$serial_rc" = 5 ]; then exit 5; fi
[ "$rc" = 5 ] && rc=0
[ "$serial_rc" = 5 ] && serial_rc=0
[ "$rc" = 0 ] && rc=$serial_rc
# The whole suite (no arguments): then the quick tier on the newest JAX, which needs Python 3.12.
if [ "${#args[@]}" = 0 ]; then
  newest_rc=0
  bash tests/newest_jax.sh || newest_rc=$?
  [ "$rc" = 0 ] && rc=$newest_rc
fi
exit "$rc"
