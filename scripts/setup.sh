#!/usr/bin/env bash
# Installs every prerequisite of CubeNet's build and tests on a fresh Debian 12 machine with
# the preinstalled stable + nightly Rust toolchains. Idempotent: each step checks first.
#
# Env: SETUP_QUIET=1 hides apt/cargo progress.
set -euo pipefail

log() { printf '[setup] %s\n' "$*"; }

# Debian packages: LLVM 22 for bpf-linker, iproute2/iputils for the namespace harness,
# the shell linter for the scripts, protoc for the gRPC codegen (proto/build.rs) and python3-venv
# for the wire-compatibility client test (grpcio-tools from PyPI).
APT_PACKAGES=(
  llvm-22-dev libpolly-22-dev libzstd-dev zlib1g-dev
  iproute2 iputils-ping ethtool procps
  shellcheck
  protobuf-compiler python3-venv
  # benchmarks (cargo xtask bench): iperf3; iptables also serves the bridge+iptables baseline
  iperf3
  # --- CubeEgress: TPROXY plumbing (scripts/cube-egress-net.sh) and the end-to-end test's
  # --- TLS client / certificate checks (tests/tests/egress.rs).
  iptables openssl curl ca-certificates
  # --- Kubernetes (scripts/build-images.sh, tests/tests/k8s_pod.rs): OCI builds and pod runs
  # --- offline; runc because crun fails on this host's hybrid cgroups (packaging.md).
  podman buildah runc
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  if [[ "$status" != "install ok installed" ]]; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
else
  log "apt packages present"
fi

# ---- real Linux guest (issue 5 building block) ---------------------------------------------
# QEMU, static busybox and cpio (GUEST_APT_PACKAGES in scripts/guest-lib.sh, installed without
# recommends), and the newest Debian 12 guest kernel package (`linux-image-6.1.0-<n>-amd64`,
# resolved with apt-cache) downloaded — not installed — into target/guest/. The same functions
# serve scripts/guest-image.sh, which builds the image from them.
setup_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck disable=SC1091 # sourced by path; test.sh runs shellcheck without -x
source "$setup_dir/guest-lib.sh"
guest_apt_install
log "guest kernel package: $(guest_kernel_fetch "$(dirname "$setup_dir")/target/guest")"
# ---- end real Linux guest -------------------------------------------------------------------

# rust-src for -Z build-std=core with the preinstalled nightly (LLVM 22).
installed_components=$(rustup component list --toolchain nightly --installed)
if [[ "$installed_components" != *rust-src* ]]; then
  log "rustup component add rust-src --toolchain nightly"
  rustup component add rust-src --toolchain nightly
else
  log "nightly rust-src present"
fi
for c in clippy rustfmt; do
  if [[ "$(rustup component list --toolchain stable --installed)" != *"$c"* ]]; then
    rustup component add "$c" --toolchain stable
  fi
  if [[ "$(rustup component list --toolchain nightly --installed)" != *"$c"* ]]; then
    rustup component add "$c" --toolchain nightly
  fi
done

# bpf-linker built against LLVM 22 (the nightly's LLVM); rebuild if missing or linked
# against another LLVM (../shared/reference/toolchain.md).
need_linker=1
if command -v bpf-linker >/dev/null 2>&1; then
  linked=$(ldd "$(command -v bpf-linker)" 2>/dev/null || true)
  if [[ "$linked" == *libLLVM.so.22* ]]; then
    need_linker=0
  else
    log "bpf-linker present but not linked against LLVM 22"
  fi
fi
if ((need_linker)); then
  log "cargo install bpf-linker (LLVM 22)"
  LLVM_PREFIX=/usr/lib/llvm-22 cargo install bpf-linker --locked --force \
    --no-default-features --features llvm-22
else
  log "bpf-linker (LLVM 22) present"
fi

# Kubernetes tooling venv (helm-python-sdk, kubernetes-validate; pinned, target/k8s-venv).
# A failure only warns: the chart tests then print SKIPPED.
if bash "$setup_dir/k8s-venv.sh" >/dev/null; then
  log "k8s venv present (target/k8s-venv)"
else
  log "warning: scripts/k8s-venv.sh failed (PyPI unreachable?); the k8s tests will be SKIPPED"
fi

log "done"
