#!/usr/bin/env bash
# The test command of the README: prerequisites, eBPF build, formatting, lints, then every
# test including the root-only ones (they create their own network namespaces and a private
# bpffs; nothing touches the machine's own interfaces). Fails on the first error.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }
start=$(date +%s)

step "setup"
bash scripts/setup.sh

step "shellcheck"
shellcheck scripts/*.sh .ci/run

step "build eBPF"
cargo xtask build-ebpf --release

step "fmt"
cargo fmt --all -- --check

step "clippy (host crates)"
cargo clippy --workspace --exclude cubevs-ebpf --all-targets --locked -- -D warnings

step "clippy (eBPF crate, nightly)"
cargo xtask clippy-ebpf

step "build binaries (the agent tests start target/debug/network-agent)"
cargo build --workspace --exclude cubevs-ebpf --bins --locked

step "tests"
if [[ $(id -u) -ne 0 ]]; then
  echo "!!! not root: root-only tests will print SKIPPED and pass vacuously !!!"
fi
test_log="$(mktemp)"
trap 'rm -f "$test_log"' EXIT
cargo test --workspace --exclude cubevs-ebpf --locked 2>&1 | tee "$test_log"
# One total over every test binary (cargo prints one result line per binary).
totals=$(awk '/^test result:/ {p += $4; f += $6; i += $8} END {printf "%d %d %d", p, f, i}' "$test_log")
read -r n_passed n_failed n_ignored <<<"$totals"

step "leak check"
# Names carry the creating test process's PID (cnt<pid>x…, cubenet-bpffs-<pid>-…). Every test
# process of this run has exited by now, so a live PID means a concurrent run from another
# checkout on the same machine: not ours, not a leak.
alive() { [[ -n "$1" && -d "/proc/$1" ]]; }
leaks=""
for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
  case "$ns" in
    cnt*)
      pid=${ns#cnt}; pid=${pid%%x*}
      alive "$pid" || leaks+=" netns:$ns"
      ;;
  esac
done
for d in /tmp/cubenet-bpffs-*; do
  [[ -e "$d" ]] || continue
  pid=${d#/tmp/cubenet-bpffs-}; pid=${pid%%-*}
  alive "$pid" || leaks+=" bpffs:$d"
done
if [[ -n "$leaks" ]]; then
  echo "tests left resources behind:$leaks"
  exit 1
fi
echo "no namespaces or bpffs mounts left"

echo
echo "(${n_ignored} ignored: report-only tests, run with -- --ignored)"
echo "tests: ${n_passed} passed, ${n_failed} failed"
echo "all checks passed in $(( $(date +%s) - start ))s"
