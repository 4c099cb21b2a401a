#!/usr/bin/env bash
# Shared by scripts/setup.sh and scripts/guest-image.sh: the prerequisites of the real-Linux
# guest (QEMU, busybox, cpio) and the guest kernel package. Source it; it defines functions and
# runs nothing.
# shellcheck shell=bash

# Debian packages the guest image and `cubenet_tests::vm` need.
GUEST_APT_PACKAGES=(qemu-system-x86 busybox-static cpio)

# Prints the name of the newest `linux-image-6.1.0-<n>-amd64` package apt knows about (the
# Debian 12 kernel series; the image depends on its module layout), or nothing.
guest_kernel_package() {
  local names
  names=$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' 2>/dev/null || true)
  printf '%s\n' "$names" | awk 'NF {print $1}' | sort -V | tail -n 1
}

# Installs the missing GUEST_APT_PACKAGES (no recommends: no GUI front ends for QEMU).
guest_apt_install() {
  local p status missing=()
  for p in "${GUEST_APT_PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [[ "$status" == "install ok installed" ]] || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  printf '[guest] apt-get install %s\n' "${missing[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Makes sure `<dir>/kernel.deb` is the newest guest kernel package: downloads it with
# `apt-get download` unless that exact version is already cached. Idempotent; without apt
# metadata for the kernel it keeps a cached .deb. Prints the .deb path.
guest_kernel_fetch() {
  local dir=$1 pkg out
  mkdir -p "$dir"
  pkg=$(guest_kernel_package)
  if [[ -z "$pkg" && ! -f "$dir/kernel.deb" ]]; then
    # A fresh machine may have no apt lists yet.
    apt-get update -qq >&2 || true
    pkg=$(guest_kernel_package)
  fi
  if [[ -z "$pkg" ]]; then
    if [[ -f "$dir/kernel.deb" ]]; then
      printf '%s\n' "$dir/kernel.deb"
      return 0
    fi
    echo "[guest] apt knows no linux-image-6.1.0-*-amd64 (run apt-get update)" >&2
    return 1
  fi
  if [[ ! -f "$dir/$pkg.deb" ]]; then
    echo "[guest] apt-get download $pkg" >&2
    rm -f "$dir"/linux-image-*.deb
    # apt-get download writes into the working directory; its "unsandboxed as root" notice is
    # noise, real failures still fail the function.
    out=$(cd "$dir" && apt-get download -q "$pkg" 2>&1) || { printf '%s\n' "$out" >&2; return 1; }
    local got
    got=$(find "$dir" -maxdepth 1 -name "${pkg}_*.deb" -print -quit)
    [[ -n "$got" ]] || { echo "[guest] download of $pkg produced no .deb" >&2; return 1; }
    mv "$got" "$dir/$pkg.deb"
  fi
  ln -sfn "$pkg.deb" "$dir/kernel.deb"
  printf '%s\n' "$dir/kernel.deb"
}
