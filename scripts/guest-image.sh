#!/usr/bin/env bash
# Builds the real-Linux test guest: the Debian 12 kernel (vmlinuz), and an initramfs with
# static busybox, the virtio-net modules, scripts/guest-init.sh as /init and
# /bin/cubenet-https-get (guest-tools/, built here statically with cargo: busybox's own TLS
# client cannot talk to rustls servers, decision L20).
#
# Usage: scripts/guest-image.sh [DIR]     (or CUBENET_GUEST_DIR=DIR; default <repo>/target/guest)
# Writes DIR/vmlinuz and DIR/initramfs.cpio.gz and prints DIR. Idempotent and cached: it
# rebuilds only when the kernel package, busybox, /init, cubenet-https-get or this script changed
# (DIR/stamp).
# Installs nothing itself except through scripts/guest-lib.sh (shared with setup.sh).
# Exit status 3: a prerequisite could not be obtained (apt install or kernel download failed),
# i.e. the machine cannot run guests; any other failure is a defect.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
dir=${1:-${CUBENET_GUEST_DIR:-$repo/target/guest}}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
# One builder at a time per cache directory (parallel tests share it).
exec 9>"$dir/.lock"
flock 9
# Sourced by path relative to this script; test.sh runs shellcheck without -x.
# shellcheck disable=SC1091
source "$here/guest-lib.sh"

log() { printf '[guest-image] %s\n' "$*" >&2; }

if ! command -v qemu-system-x86_64 >/dev/null || [[ ! -x /bin/busybox ]] || ! command -v cpio >/dev/null; then
  guest_apt_install || { log "cannot install ${GUEST_APT_PACKAGES[*]}"; exit 3; }
fi
busybox_file=$(readlink -f /bin/busybox)
# ldd fails on a static executable; the guest has no dynamic loader.
! ldd "$busybox_file" >/dev/null 2>&1 || {
  log "/bin/busybox is dynamically linked; install busybox-static"
  exit 3
}

deb=$(guest_kernel_fetch "$dir") || { log "cannot obtain the guest kernel package"; exit 3; }
deb=$(readlink -f "$deb")

# The guest's HTTPS client: static (glibc, -static-pie), release profile, in the repo's target
# directory (or $CARGO_TARGET_DIR). `cargo rustc` so crt-static applies to this binary only.
log "cargo: static cubenet-https-get"
(cd "$repo" && cargo rustc --release --locked -q -p cubenet-guest-tools --bin cubenet-https-get \
  -- -C target-feature=+crt-static) >&2 || { log "cannot build guest-tools/cubenet-https-get"; exit 1; }
https_get=${CARGO_TARGET_DIR:-$repo/target}/release/cubenet-https-get
# Static (also static-pie, which ldd calls "statically linked" with status 0): no ELF interpreter.
headers=$(readelf -l "$https_get") || { log "cannot read $https_get"; exit 1; }
[[ "$headers" != *INTERP* ]] || { log "$https_get is dynamically linked"; exit 1; }

# Modules virtio-net needs on the microvm machine, in load order (guest-init.sh loads them).
MODULES=(virtio_ring virtio virtio_mmio failover net_failover virtio_net)

stamp_now=$(
  {
    basename "$deb"
    sha256sum "$busybox_file" "$here/guest-init.sh" "$here/guest-image.sh" "$https_get" | awk '{print $1}'
  } | sha256sum | awk '{print $1}'
)
if [[ -f "$dir/stamp" && -f "$dir/vmlinuz" && -f "$dir/initramfs.cpio.gz" ]]; then
  stamp_old=$(<"$dir/stamp")
  if [[ "$stamp_old" == "$stamp_now" ]]; then
    log "cached: $dir ($(basename "$deb"))"
    printf '%s\n' "$dir"
    exit 0
  fi
fi

log "building from $(basename "$deb")"
work=$(mktemp -d "$dir/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
dpkg -x "$deb" "$work/deb"

vmlinuz=$(find "$work/deb/boot" -name 'vmlinuz-*' -print -quit)
[[ -n "$vmlinuz" ]] || { log "no vmlinuz in $deb"; exit 1; }

root=$work/root
mkdir -p "$root"/{bin,dev,proc,sys,tmp,lib/modules,www/cgi-bin}
for m in "${MODULES[@]}"; do
  ko=$(find "$work/deb/lib/modules" -name "$m.ko*" -print -quit)
  [[ -n "$ko" ]] || { log "module $m missing from $deb"; exit 1; }
  case "$ko" in
    *.ko) cp "$ko" "$root/lib/modules/$m.ko" ;;
    *.ko.xz) xz -dc "$ko" >"$root/lib/modules/$m.ko" ;;
    *.ko.zst) zstd -qdc "$ko" >"$root/lib/modules/$m.ko" ;;
    *) log "unsupported module file $ko"; exit 1 ;;
  esac
done

cp "$busybox_file" "$root/bin/busybox"
applets=$("$root/bin/busybox" --list)
for a in $applets; do
  [[ "$a" == busybox ]] || ln -s busybox "$root/bin/$a"
done
install -m 0755 "$here/guest-init.sh" "$root/init"
# Stripped: a smaller initramfs boots faster under TCG.
strip -o "$root/bin/cubenet-https-get" "$https_get"
chmod 0755 "$root/bin/cubenet-https-get"

# What the guest serves with cubenet.serve=PORT (busybox httpd, CGI from /cgi-bin).
printf 'cubenet guest\n' >"$root/www/index.html"
cat >"$root/www/cgi-bin/whoami" <<'CGI'
#!/bin/sh
printf 'Content-Type: text/plain\r\n\r\nyou are %s:%s\n' "$REMOTE_ADDR" "$REMOTE_PORT"
CGI
chmod 0755 "$root/www/cgi-bin/whoami"

(cd "$root" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet) | gzip -9n >"$work/initramfs.cpio.gz"
cp "$vmlinuz" "$work/vmlinuz"
mv -f "$work/vmlinuz" "$dir/vmlinuz"
mv -f "$work/initramfs.cpio.gz" "$dir/initramfs.cpio.gz"
printf '%s\n' "$stamp_now" >"$dir/stamp"
log "built $dir/vmlinuz and $dir/initramfs.cpio.gz ($(du -h "$dir/initramfs.cpio.gz" | cut -f1))"
printf '%s\n' "$dir"
