#!/usr/bin/env bash
# The quick tier and the tests of objckpt's JAX-version seams, on the newest JAX the package index
# offers. objckpt supports JAX 0.4.30 onwards, and .venv (tests/run.sh) holds Python 3.11, whose
# newest JAX is 0.10; JAX 0.11 onwards needs Python 3.12 (as on the CUDA image of a GPU machine),
# and 0.12 changed calls objckpt makes (objckpt/core/jax_compat.py). Sets up .venv-newest on
# first use, with python3.12 or python3.13 (on PATH, or among pyenv's); where neither runs, it
# says so and exits 0 (the main suite still ran).
#
#   bash tests/newest_jax.sh          # tests/run.sh runs it last
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py=""
pyenv_root="$(pyenv root 2>/dev/null || true)"
for v in 3.12 3.13; do
  # On PATH, or installed by pyenv but not selected (its shim then refuses to run it).
  for candidate in "python$v" ${pyenv_root:+"$pyenv_root"/versions/"$v"*/bin/python"$v"}; do
    if "$candidate" -c "import sys" 2>/dev/null; then py="$candidate"; break 2; fi
  done
done
if [ -z "$py" ]; then
  echo "== newest JAX: skipped, no python3.12 or python3.13 on this machine"
  exit 0
fi
venv="$root/.venv-newest"
stamp="$venv/.objckpt-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade -e "$root[dev]"
  echo "$want" > "$stamp"
fi
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false PATH="$venv/bin:$PATH"
echo "== newest JAX: $("$venv/bin/python" -c 'import jax, sys; print(f"jax {jax.__version__}, Python {sys.version.split()[0]}")')"
"$venv/bin/python" -m pytest -p no:cacheprovider -q -m quick
"$venv/bin/python" -m pytest -p no:cacheprovider -q tests/test_jax_compat.py tests/test_device_reads.py tests/test_recycled.py
