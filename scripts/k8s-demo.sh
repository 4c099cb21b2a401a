#!/usr/bin/env bash
# k8s-demo.sh — the CubeNode pod for real on this machine, in one command (root):
# setup, eBPF + debug build, the images (scripts/build-images.sh, cached), then the pod drill
# of tests/tests/k8s_pod.rs with its progress lines: the chart rendered in underlay mode onto a
# test node namespace, `podman kube play` of its DaemonSet template, Ensure + TAP fd + a real
# QEMU guest through the pod's sockets, CubeEgress health and TPROXY rules, then the agent
# container replaced in place by a newer image while the guest uploads over TCP (no reset).
# Everything it creates is removed at the end; images stay cached in target/k8s.
# Exit status: that of the test (0 = every check passed); 2 not root or an argument (only
# --help is taken).
set -euo pipefail
# -h/--help: this header, before anything is installed or built (builtins only); no other
# argument is taken.
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  while IFS= read -r line; do
    [[ "$line" == "#!"* ]] && continue
    [[ "$line" == "#"* ]] || break
    line="${line#\#}"
    printf '%s\n' "${line# }"
  done <"$0"
  exit 0
fi
if (($#)); then
  printf 'k8s-demo.sh: unknown argument %s (see --help)\n' "$1" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
(( EUID == 0 )) || { echo "k8s-demo.sh: needs root" >&2; exit 2; }
SETUP_QUIET=1 bash scripts/setup.sh
cargo xtask build-ebpf --release
cargo build --workspace --exclude cubevs-ebpf --bins
bash scripts/build-images.sh --profile debug --no-save
exec cargo test -p cubenet-tests --test k8s_pod -- --nocapture
