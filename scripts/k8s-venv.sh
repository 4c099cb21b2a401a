#!/usr/bin/env bash
# Creates (once) the Python venv of the Kubernetes tooling under target/k8s-venv and prints
# its python: helm-python-sdk 0.2.2 (Helm v4 SDK as a C library: render and lint, no helm
# binary, no cluster), kubernetes-validate 1.37.0 (bundled OpenAPI schemas) and PyYAML, all
# from PyPI with pinned versions. Idempotent (a stamp names the pins); concurrent callers
# serialise on a lock. Exit 1 when the install fails (the tests then print SKIPPED).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/target/k8s-venv"
pins="helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 PyYAML==6.0.2"
mkdir -p "$root/target"
exec 9>"$root/target/.k8s-venv.lock"
flock 9
if [[ "$(cat "$venv/.cubenet-pins" 2>/dev/null || true)" != "$pins" ]]; then
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  # shellcheck disable=SC2086 # the pins are word-split on purpose
  "$venv/bin/pip" install --quiet --disable-pip-version-check $pins >&2
  printf '%s\n' "$pins" >"$venv/.cubenet-pins"
fi
printf '%s\n' "$venv/bin/python"
