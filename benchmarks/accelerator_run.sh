#!/usr/bin/env bash
# bench_accelerator on a lent accelerator machine (a TPU VM, or the CUDA image of an NVIDIA GPU),
# in one call (no network there: file:// and tmpfs only).
#
#   bash benchmarks/accelerator_run.sh --fetch-wheels          # here, before the call: .whl-accel/
#   bash benchmarks/accelerator_run.sh OUT_DIR [--no-facts] [bench_accelerator.py arguments...]   # there
#
# Those machines have no package index of the outside world, and each its own Python (3.11 on the
# TPU VM, 3.12 on the CUDA image). `--fetch-wheels` downloads fsspec, crc32c and tqdm for both
# into .whl-accel/ (carry it: `carry: [".whl-accel"]`). There, each of them that the machine's
# Python cannot import is installed from those wheels (pip picks the one for its Python), and
# orbax-checkpoint, where it is not importable, from the machine's own package index if it has
# one; all under /tmp and at the end of PYTHONPATH, so the machine's JAX stays first. Then prints
# benchmarks/accelerator_facts.py's facts (`--no-facts` skips them: about 40 s on a chip) and
# runs benchmarks/bench_accelerator.py with the arguments given, writing accelerator.json and the
# logs into OUT_DIR (taken relative to where it is called from). With `--profile /tmp/profiles`
# among them it also writes the cProfile summaries of every save and restore (profiles.txt); the
# timed figures of a profiled run carry the profiler's overhead, so the committed results come
# from runs without it.
set -euo pipefail
if [ "${1:-}" != "--fetch-wheels" ]; then
  mkdir -p "$1"
  out="$(cd "$1" && pwd)"; shift
fi
cd "$(dirname "$0")/.."
wheels=.whl-accel
needed=(fsspec crc32c tqdm)
if [ "${1:-}" = "--fetch-wheels" ]; then
  for py in 3.11 3.12; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
      --platform manylinux_2_17_x86_64 -d "$wheels" "${needed[@]}"
  done
  ls "$wheels"
  exit 0
fi
facts=1
if [ "${1:-}" = "--no-facts" ]; then facts=0; shift; fi
export PIP_CONFIG_FILE=/dev/null PYTHONUNBUFFERED=1
missing=()
for name in "${needed[@]}"; do
  python3 -c "import $name" 2>/dev/null || missing+=("$name")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing from $wheels: ${missing[*]}"
  python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
    --find-links "$wheels" --target /tmp/site "${missing[@]}"
fi
if ! python3 -c "import orbax.checkpoint" 2>/dev/null; then
  python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/orbax \
    orbax-checkpoint > "$out/pip.log" 2>&1 || echo "orbax-checkpoint did not install: its columns are skipped (see $out/pip.log)"
fi
export PYTHONPATH="${PYTHONPATH:-}:/tmp/site:/tmp/orbax:$PWD"
# The room the stores have (tmpfs on a small VM can be a few GiB), before anything is measured.
{ nproc; free -g; df -h /dev/shm /tmp; } 2>&1 | tee "$out/machine.log"
if [ "$facts" = 1 ]; then python3 benchmarks/accelerator_facts.py 2>&1 | tee "$out/facts.log"; fi
python3 benchmarks/bench_accelerator.py --out "$out/accelerator.json" "$@" 2>&1 | tee "$out/bench.log"
for f in /tmp/profiles/*.prof; do  # one file: the device tool brings back at most 8
  [ -e "$f" ] || continue
  echo "=== $(basename "$f")"
  python3 -c 'import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats("cumulative").print_stats(30)' "$f"
done > "$out/profiles.txt" 2>&1
