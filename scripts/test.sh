#!/usr/bin/env bash
# The test command of the README: prerequisites, eBPF build, formatting, lints, then every
# test including the root-only ones (they create their own network namespaces and a private
# bpffs; nothing touches the machine's own interfaces). Fails on the first error; every test
# binary runs, and the summary counts tests that skipped themselves (not root, no QEMU …)
# as skipped, listing each with its reason.
#
#   bash scripts/test.sh                          everything
#   bash scripts/test.sh --tests-only [ARGS...]   only the binaries build and `cargo test ARGS`
#                                                 (default: the whole workspace), same summary
#   bash scripts/test.sh --help                   this text; any other argument exits 2
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
if [[ $# -gt 0 && "$1" != "--tests-only" ]]; then
  printf 'test.sh: unknown argument %s (see --help)\n' "$1" >&2
  exit 2
fi
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }
start=$(date +%s)

test_args=(--workspace --exclude cubevs-ebpf)
tests_only=0
if [[ "${1:-}" == "--tests-only" ]]; then
  tests_only=1
  shift
  if (( $# > 0 )); then test_args=("$@"); fi
fi

if (( ! tests_only )); then
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
fi

step "build binaries (the agent tests start target/debug/network-agent)"
cargo build --workspace --exclude cubevs-ebpf --bins --locked

# The swap rollback tests run against real older CubeEgress builds, built from git history
# (a few minutes cold; one target directory shared by both, so the dependencies build once).
# Without the history the tests report themselves skipped.
old_egress() { # <commit> <env var> <what>
  local commit=$1 var=$2 what=$3 dir="$PWD/target/old-egress"
  [[ -z "${!var:-}" ]] || return 0
  git cat-file -e "${commit}^{commit}" 2>/dev/null || return 0
  step "cube-egress ${commit:0:7} for $what"
  if [[ ! -x "$dir/cube-egress-$commit" ]]; then
    # Extracted with fresh mtimes (-m): cargo's metadata for workspace crates does not depend on
    # their path, so only a newer mtime than the other commit's artifacts makes them rebuild.
    rm -rf "$dir/src-$commit"
    mkdir -p "$dir/src-$commit"
    git archive "$commit" | tar -x -m -C "$dir/src-$commit"
    # No debug info: these builds only serve as peers; with it they took ~1.8 GB.
    CARGO_PROFILE_DEV_DEBUG=0 cargo build --locked --manifest-path "$dir/src-$commit/Cargo.toml" \
      -p cube-egress --target-dir "$dir/target"
    cp "$dir/target/debug/cube-egress" "$dir/cube-egress-$commit"
  fi
  export "$var=$dir/cube-egress-$commit"
}
# egress_swap_with_a_pre_e24_build: 7c0ffea's, from before the hand-over extras (E24).
old_egress 7c0ffea219008aa9fc575390c661a63fb6018c52 CUBENET_BASELINE_EGRESS "the pre-E24 swap rollback test"
# egress_swap_with_a_pre_e26_build: 420fe3d's, extras without TLS 1.2 sessions (E26).
old_egress 420fe3d4549d033ada844f47b6d15ba2f53d430c CUBENET_PRE_E26_EGRESS "the pre-E26 swap rollback test"
# Only the two binaries are needed from here on (a later run finds them and builds nothing).
rm -rf "$PWD/target/old-egress/target" "$PWD"/target/old-egress/src-*

step "tests"
if [[ $(id -u) -ne 0 ]]; then
  echo "!!! not root: root-only tests will be reported as skipped !!!"
fi
test_log="$(mktemp)"
# Tests that cannot run here (not root, no QEMU, no guest kernel …) record themselves here
# (cubenet_tests::skip); cargo counts them as passed, the summary below does not.
CUBENET_SKIP_DIR="$(mktemp -d)"
export CUBENET_SKIP_DIR
trap 'rm -rf "$test_log" "$CUBENET_SKIP_DIR"' EXIT
set +e
cargo test --locked --no-fail-fast "${test_args[@]}" 2>&1 | tee "$test_log"
test_status=${PIPESTATUS[0]}
set -e
# One total over every test binary (cargo prints one result line per binary).
totals=$(awk '/^test result:/ {p += $4; f += $6; i += $8} END {printf "%d %d %d", p, f, i}' "$test_log")
read -r n_passed n_failed n_ignored <<<"$totals"
skipped=()
for f in "$CUBENET_SKIP_DIR"/*; do
  [[ -e "$f" ]] || continue
  skipped+=("$(basename "$f"): $(head -n 1 "$f")")
done
n_skipped=${#skipped[@]}
n_passed=$(( n_passed - n_skipped ))
summary() {
  echo
  echo "(${n_ignored} ignored: report-only tests, run with -- --ignored)"
  if (( n_skipped > 0 )); then
    echo "skipped (did not run here):"
    printf '  SKIPPED: %s\n' "${skipped[@]}"
  fi
  echo "tests: ${n_passed} passed, ${n_failed} failed, ${n_skipped} skipped"
}
if (( test_status != 0 )); then
  summary
  echo "tests failed (cargo test exit status ${test_status})"
  exit "$test_status"
fi

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

summary
echo "all checks passed in $(( $(date +%s) - start ))s"
