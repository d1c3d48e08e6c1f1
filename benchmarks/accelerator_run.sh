#!/usr/bin/env bash
# bench_accelerator on a lent TPU machine, in one call (no network there: file:// and tmpfs only).
#
#   bash benchmarks/accelerator_run.sh OUT_DIR [bench_accelerator.py arguments...]
#
# Installs what the machine lacks: fsspec, crc32c and tqdm from wheels carried in .whl-tpu/
# (fetched beforehand with `pip download --no-deps --only-binary=:all: --python-version 3.11
# --platform manylinux_2_17_x86_64 ... -d .whl-tpu fsspec crc32c tqdm`), and orbax-checkpoint from
# the machine's own package index, both under /tmp and at the end of PYTHONPATH so the machine's
# JAX stays first. Then prints benchmarks/accelerator_facts.py's facts and runs
# benchmarks/bench_accelerator.py with the arguments given, writing accelerator.json and the logs
# into OUT_DIR. With `--profile /tmp/profiles` among them it also writes the cProfile summaries of
# every save and restore (profiles.txt); the timed figures of a profiled run carry the
# profiler's overhead, so the committed results come from runs without it.
set -euo pipefail
out="$1"; shift
mkdir -p "$out"
export PIP_CONFIG_FILE=/dev/null PYTHONUNBUFFERED=1
python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl
python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/orbax orbax-checkpoint \
  > "$out/pip.log" 2>&1 || echo "orbax-checkpoint did not install: its columns are skipped (see $out/pip.log)"
export PYTHONPATH="${PYTHONPATH:-}:/tmp/site:/tmp/orbax:$PWD"
python3 benchmarks/accelerator_facts.py 2>&1 | tee "$out/facts.log"
python3 benchmarks/bench_accelerator.py --out "$out/accelerator.json" "$@" 2>&1 | tee "$out/bench.log"
for f in /tmp/profiles/*.prof; do  # one file: the device tool brings back at most 8
  [ -e "$f" ] || continue
  echo "=== $(basename "$f")"
  python3 -c 'import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats("cumulative").print_stats(30)' "$f"
done > "$out/profiles.txt" 2>&1
