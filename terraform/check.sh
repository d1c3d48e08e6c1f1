#!/usr/bin/env bash
# Static checks of terraform/ that need no terraform CLI and no cloud: checkov, with every
# framework it has (Terraform, secrets, ...). No failed check may remain; a check that does
# not apply is skipped by a `# checkov:skip=CKV_...: reason` comment next to its resource.
#
# checkov pins its own boto3/botocore (and packaging, ...), which conflict with the versions
# s3fs/aiobotocore need in .venv, so it lives in a venv of its own: .venv/checkov (inside the
# ignored .venv, so `rm -rf .venv` resets everything). Created on first use (~30 s, ~300 MB),
# reinstalled only when CHECKOV_VERSION changes. The scan itself takes a few seconds and makes
# no network calls (--skip-download).
#   bash terraform/check.sh            # what tests/run.sh and .ci/run run
#   bash terraform/check.sh --compact  # extra flags go to checkov
set -euo pipefail
CHECKOV_VERSION=3.3.30
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CHECKOV_VENV:-$root/.venv/checkov}"
stamp="$venv/.checkov-version"

if [ ! -x "$venv/bin/checkov" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$CHECKOV_VERSION" ]; then
  echo "installing checkov $CHECKOV_VERSION into ${venv#"$root"/} ..."
  rm -rf "$venv"
  python3 -m venv "$venv"
  if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check "checkov==$CHECKOV_VERSION" >"$venv/install.log" 2>&1; then
    cat "$venv/install.log" >&2
    exit 1
  fi
  echo "$CHECKOV_VERSION" > "$stamp"
fi

cd "$root"
exec "$venv/bin/checkov" --directory terraform --quiet --compact --skip-download "$@"
