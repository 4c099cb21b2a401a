#!/usr/bin/env bash
# The main job in one command: real Linux guests get their network from the network-agent.
#
# Installs the prerequisites (scripts/setup.sh, idempotent), builds the eBPF object and the
# release binaries, builds the cached guest image (scripts/guest-image.sh), then runs
# target/release/cubenet-demo, which creates its own namespaces (node, world, agent), starts
# the agent with scripts/start-network-agent.sh, plays cubelet for four sandboxes, boots a
# real Linux guest under QEMU on each TAP fd, checks from inside and outside, prints a summary
# table, releases everything and removes what it created. Nothing touches the machine's own
# interfaces, routes, sysctls or /sys/fs/bpf.
#
# Usage: bash scripts/demo.sh [--keep] [--guests 1|2|3|4] [--accel tcg|kvm] [--profile release|debug]
#        (root; arguments go to cubenet-demo, whose --help after a build describes each)
#        bash scripts/demo.sh --help    this text, without installing or building anything
# Exit status: 0 all checks passed, 1 a check failed (or the run failed), 2 not root or bad
# arguments.
set -euo pipefail

# -h/--help: this header, before anything is installed or built (builtins only).
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  while IFS= read -r line; do
    [[ "$line" == "#!"* ]] && continue
    [[ "$line" == "#"* ]] || break
    line="${line#\#}"
    printf '%s\n' "${line# }"
  done <"$0"
  exit 0
fi
cd "$(dirname "$0")/.."

if [[ $(id -u) -ne 0 ]]; then
  echo "demo.sh: needs root (network namespaces, TAPs, eBPF); run: sudo bash scripts/demo.sh" >&2
  exit 2
fi

step() { printf '\n=== %s\n' "$*"; }
start=$(date +%s)

step "setup (idempotent)"
bash scripts/setup.sh

step "build eBPF (target/ebpf/cubevs.bpf.o)"
cargo xtask build-ebpf --release

step "build release binaries (network-agent, cubenet-cli, cube-egress, cubenet-demo)"
cargo build --release --locked -p network-agent -p cube-egress -p cubenet-demo --bins

step "guest image (built on first use, then cached)"
bash scripts/guest-image.sh >/dev/null

step "demo"
built=$(date +%s)
rc=0
target/release/cubenet-demo "$@" || rc=$?
end=$(date +%s)
echo "demo.sh: exit $rc; demo $((end - built))s, total $((end - start))s (setup and builds included)"
exit "$rc"
