#!/usr/bin/env bash
# Builds the CubeNet node images with buildah, offline (no registry pull, no base image):
#
#   cubenet/network-agent  network-agent, cubenet-cli, cubevs.bpf.o (next to the agent, where
#                          cubevs::default_object_path() finds it), start-network-agent.sh,
#                          deploy/images/{cubenet-preflight.sh,cubenet-netns-exec.sh,agent-prestop.sh,agent-entrypoint.sh}
#   cubenet/cube-egress    cube-egress, cube-egress-net.sh, deploy/images/cube-egress-slot.sh,
#                          deploy/images/{cube-egress-net-entrypoint.sh,cubenet-netns-exec.sh}
#
# Each image is FROM scratch: the binaries of this checkout plus a minimal root made of the
# Debian packages they need (bash, coreutils, iproute2, util-linux for nsenter/mount,
# busybox-static for wget/modprobe in probes and plumbing, iptables and ca-certificates (the
# upstream TLS trust store) for the egress image),
# fetched with `apt-get download` at the host's installed versions and unpacked with
# `dpkg-deb -x` (no maintainer scripts run). The shared-library closure is found with ldd, so
# the Rust binaries stay the ordinary glibc build (bookworm's glibc = the build host's).
# docs/decisions.md K1.
#
# Usage: scripts/build-images.sh [--profile release|debug] [--tag TAG] [--no-save] [--build]
#   --profile   which cargo build to package (default release); the binaries must exist
#               unless --build is given, which runs the cargo/xtask builds first
#   --tag       image tag (default: the workspace version, e.g. 0.1.0)
#   --no-save   skip the `podman save` archives
#   --build     run `cargo xtask build-ebpf --release` and `cargo build [--release] --bins` first
#
# Output: images in the private storage of scripts/k8s-lib.sh (target/k8s/containers), and
# target/images/<name>-<tag>.oci.tar (`podman save --format oci-archive`), importable with
# `ctr -n k8s.io images import`, `k3s ctr images import` or `kind load image-archive`.
# Idempotent and cached: an image whose inputs (files, package versions, this script) hash to
# the digest in its `io.cubenet.inputs` label is not rebuilt, nor its archive re-saved.
set -euo pipefail

log() { printf '[build-images] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC1091 # sourced by path; test.sh runs shellcheck without -x
source "$root/scripts/k8s-lib.sh"

profile=release tag="" save=1 build=0
while (($#)); do
  case "$1" in
    --profile) profile=${2:?}; shift 2 ;;
    --tag) tag=${2:?}; shift 2 ;;
    --no-save) save=0; shift ;;
    --build) build=1; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[[ "$profile" == release || "$profile" == debug ]] || die "--profile must be release or debug"
(( EUID == 0 )) || die "needs root (buildah with the private storage of target/k8s)"
for t in buildah podman runc apt-get dpkg-deb ldd sha256sum; do
  command -v "$t" >/dev/null || die "$t not found (run scripts/setup.sh)"
done

version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -n1)
[[ -n "$tag" ]] || tag=$version
revision=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
if [[ -n "$(git -C "$root" status --porcelain 2>/dev/null || true)" ]]; then revision="$revision-dirty"; fi
# Deterministic `created`: the commit time (SOURCE_DATE_EPOCH convention).
epoch=${SOURCE_DATE_EPOCH:-$(git -C "$root" log -1 --format=%ct 2>/dev/null || echo 0)}
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)

if ((build)); then
  log "cargo xtask build-ebpf --release; cargo build --bins ($profile)"
  (cd "$root" && cargo xtask build-ebpf --release)
  flag=(); [[ "$profile" == release ]] && flag=(--release)
  (cd "$root" && cargo build "${flag[@]}" -p network-agent -p cube-egress --bins)
fi
bin="$root/target/$profile"
for f in "$bin/network-agent" "$bin/cubenet-cli" "$bin/cube-egress" "$root/target/ebpf/cubevs.bpf.o"; do
  [[ -f "$f" ]] || die "$f missing: build it first (or pass --build)"
done

k8s_podman_env "$root"
work="$root/target/k8s/build"
debs="$root/target/k8s/debs"
out="$root/target/images"
mkdir -p "$work" "$debs" "$out"

# --- Debian package closure -----------------------------------------------------------------
# Package owning a file (dpkg records /bin/x or /usr/bin/x depending on the package: try both).
owner() {
  local p=$1 c
  for c in "$p" "${p#/usr}" "/usr$p"; do
    if dpkg-query -S "$c" >/dev/null 2>&1; then
      dpkg-query -S "$c" 2>/dev/null | head -n1 | sed 's/: .*//; s/:amd64$//; s/, .*//'
      return 0
    fi
  done
  return 1
}
installed_version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null; }

# Fetch PKG into target/k8s/debs (cached), print the .deb path: the host's installed version
# when the archive still has it (the ldd closure below is computed against it), else the
# archive's candidate (same bookworm sonames).
fetch_deb() {
  local p=$1 v f
  v=$(installed_version "$p") || true
  [[ -n "$v" ]] || die "package $p is not installed on the build host (scripts/setup.sh)"
  f=$(find "$debs" -maxdepth 1 -name "${p}_*.deb" -print -quit)
  if [[ -z "$f" ]]; then
    (cd "$debs" && { apt-get download -qq -o APT::Sandbox::User=root "$p=$v" >/dev/null 2>&1 || apt-get download -qq -o APT::Sandbox::User=root "$p" >/dev/null; }) ||
      die "apt-get download $p failed"
    f=$(find "$debs" -maxdepth 1 -name "${p}_*.deb" -print -quit)
    [[ -n "$f" ]] || die "downloaded $p but found no .deb"
  fi
  printf '%s\n' "$f"
}

# Packages needed by ELF files: the owners of the libraries ldd resolves on the build host
# (each library looked up once).
lib_packages() {
  (($#)) || return 0
  local l
  while read -r l; do
    owner "$(readlink -f "$l")" || owner "$l" || die "no package owns $l"
  done < <(ldd "$@" 2>/dev/null | awk '/=> \//{print $3} /^\t\/.*ld-linux/{print $1}' | sort -u)
}

# Builds a root filesystem in DIR from the given packages plus their library closure.
make_rootfs() {
  local dir=$1; shift
  local -A have=() seen=()
  local queue=("$@" libc6 base-files) p new f
  rm -rf "$dir"; mkdir -p "$dir"
  while ((${#queue[@]})); do
    new=()
    for p in "${queue[@]}"; do
      [[ -n "${have[$p]:-}" ]] && continue
      have[$p]=1
      dpkg-deb -x "$(fetch_deb "$p")" "$dir"
      new+=("$p")
    done
    queue=()
    ((${#new[@]})) || break
    # ELF files not yet inspected -> library owners not yet present.
    local hostpaths=()
    while IFS= read -r -d '' f; do
      [[ -n "${seen[$f]:-}" ]] && continue
      seen[$f]=1
      hostpaths+=("/${f#"$dir"/}") # non-ELF files: ldd just says "not a dynamic executable"
    done < <(find "$dir" -type f \( -perm -u+x -o -name '*.so*' \) -print0)
    while read -r p; do
      [[ -n "$p" && -z "${have[$p]:-}" ]] && queue+=("$p")
    done < <(lib_packages "${hostpaths[@]}" | sort -u)
  done
  # Merged /usr, as bookworm installs it (unpacking skips usrmerge's maintainer scripts).
  local d
  for d in bin sbin lib lib64; do
    if [[ -d "$dir/$d" && ! -L "$dir/$d" ]]; then
      mkdir -p "$dir/usr/$d"
      cp -a "$dir/$d/." "$dir/usr/$d/"
      rm -rf "${dir:?}/$d"
    fi
    [[ -e "$dir/usr/$d" ]] && ln -sfn "usr/$d" "$dir/$d"
  done
  rm -rf "$dir/usr/share/doc" "$dir/usr/share/man" "$dir/usr/share/info" "$dir/usr/share/locale" "$dir/usr/share/lintian"
  mkdir -p "$dir/tmp" "$dir/etc" "$dir/run" "$dir/var/tmp" "$dir/proc" "$dir/sys" "$dir/dev"
  chmod 1777 "$dir/tmp" "$dir/var/tmp"
  printf 'root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' >"$dir/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$dir/etc/group"
  printf 'hosts: files dns\n' >"$dir/etc/nsswitch.conf"
  # busybox applets used by probes and plumbing where no Debian tool is in the image.
  if [[ -x "$dir/usr/bin/busybox" ]]; then
    for f in wget modprobe; do
      [[ -e "$dir/usr/bin/$f" || -e "$dir/usr/sbin/$f" ]] || ln -s busybox "$dir/usr/bin/$f"
    done
  fi
  # update-alternatives does not run either: iptables = the nft variant, as on bookworm and
  # current Kubernetes nodes (IPTABLES=iptables-legacy selects the other in cube-egress-net.sh).
  if [[ -x "$dir/usr/sbin/xtables-nft-multi" ]]; then
    for f in iptables iptables-save iptables-restore; do
      ln -sfn "$f-nft" "$dir/usr/sbin/$f" # replaces the dangling /etc/alternatives link
    done
  fi
  # ca-certificates' postinst (update-ca-certificates) does not run: build the bundle it
  # would, every Mozilla root, where rustls-native-certs / OpenSSL look first.
  if [[ -d "$dir/usr/share/ca-certificates/mozilla" ]]; then
    mkdir -p "$dir/etc/ssl/certs"
    find "$dir/usr/share/ca-certificates/mozilla" -name '*.crt' -print0 | sort -z | xargs -0 cat >"$dir/etc/ssl/certs/ca-certificates.crt"
  fi
  printf '%s\n' "${!have[@]}" | sort >"$dir.packages"
}

# --- one image ------------------------------------------------------------------------------
# build_image NAME DESCRIPTION ROOTFS_PACKAGES(space-separated) ENTRYPOINT_JSON FILE:DEST...
build_image() {
  local name=$1 desc=$2 pkgs=$3 entry=$4; shift 4
  local ref="localhost/cubenet/$name:$tag" rootfs="$work/$name-rootfs" digest p spec src dst
  # Inputs digest: this script, the files, the package versions.
  digest=$({
    sha256sum "$root/scripts/build-images.sh" "$root/scripts/k8s-lib.sh"
    for spec in "$@"; do sha256sum "${spec%%:*}"; done
    for p in $pkgs; do printf '%s=%s\n' "$p" "$(installed_version "$p")"; done
    printf 'tag=%s revision=%s created=%s\n' "$tag" "$revision" "$created"
  } | sha256sum | cut -d' ' -f1)
  local have_digest
  have_digest=$(podman image inspect --format '{{index .Labels "io.cubenet.inputs"}}' "$ref" 2>/dev/null || true)
  if [[ "$have_digest" == "$digest" ]]; then
    log "$ref up to date (inputs $digest)"
  else
    local t0=$SECONDS srcs=()
    for spec in "$@"; do srcs+=("${spec%%:*}"); done
    local libs
    libs=$(lib_packages "${srcs[@]}" | sort -u | tr '\n' ' ')
    # The root filesystem is cached per package set (binaries change far more often).
    local rkey
    rkey=$({ declare -f make_rootfs fetch_deb lib_packages owner; for p in $pkgs $libs; do printf '%s=%s\n' "$p" "$(installed_version "$p")"; done; } | sha256sum | cut -d' ' -f1)
    if [[ -d "$rootfs" && "$(cat "$rootfs.key" 2>/dev/null || true)" == "$rkey" ]]; then
      log "$name root filesystem cached ($rootfs)"
    else
      # shellcheck disable=SC2086 # package lists are word-split on purpose
      make_rootfs "$rootfs" $pkgs $libs
      printf '%s\n' "$rkey" >"$rootfs.key"
    fi
    local ctr
    ctr=$(buildah from --pull=never scratch)
    # shellcheck disable=SC2064 # expand now: remove this working container on failure
    trap "buildah rm $ctr >/dev/null 2>&1 || true" EXIT
    buildah copy --quiet "$ctr" "$rootfs/" / >/dev/null
    for spec in "$@"; do
      src=${spec%%:*} dst=${spec#*:}
      if [[ "$src" == "$bin/"* ]]; then
        # Debug builds carry ~100 MB of DWARF per binary: ship them without it.
        mkdir -p "$work/stage"
        strip --strip-debug -o "$work/stage/${src##*/}" "$src"
        src="$work/stage/${src##*/}"
      fi
      local mode=0644
      [[ -x "$src" || "$dst" == /usr/local/bin/*.sh ]] && mode=0755
      buildah copy --quiet --chmod "$mode" "$ctr" "$src" "$dst" >/dev/null
    done
    buildah config \
      --entrypoint "$entry" --cmd '' \
      --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --workingdir / \
      --label "org.opencontainers.image.title=cubenet/$name" \
      --label "org.opencontainers.image.description=$desc" \
      --label "org.opencontainers.image.version=$tag" \
      --label "org.opencontainers.image.revision=$revision" \
      --label "org.opencontainers.image.created=$created" \
      --label "org.opencontainers.image.source=https://github.com/TencentCloudAgentRuntime/CubeSandbox" \
      --label "org.opencontainers.image.licenses=Apache-2.0" \
      --label "io.cubenet.build-profile=$profile" \
      --label "io.cubenet.inputs=$digest" \
      "$ctr"
    buildah commit --quiet --rm --timestamp "$epoch" "$ctr" "$ref" >/dev/null
    trap - EXIT
    # The previous build of this ref is now untagged: drop it (private storage only; an image
    # a container still uses stays).
    podman image prune --force >/dev/null 2>&1 || true
    log "$ref built in $((SECONDS - t0)) s ($(wc -l <"$rootfs.packages") Debian packages: $(tr '\n' ' ' <"$rootfs.packages"))"
  fi
  if ((save)); then
    local archive="$out/$name-$tag.oci.tar"
    if [[ -f "$archive" && "$(cat "$archive.inputs" 2>/dev/null)" == "$digest" ]]; then
      log "$archive up to date"
    else
      rm -f "$archive"
      podman save --quiet --format oci-archive -o "$archive" "$ref"
      printf '%s\n' "$digest" >"$archive.inputs"
      log "saved $archive ($(du -h "$archive" | cut -f1))"
    fi
  fi
  printf '%s\n' "$ref"
}

img="$root/deploy/images"
build_image network-agent \
  "CubeNet network-agent: TAP pool, gRPC, TAP fd hand-off, CubeVS eBPF datapath" \
  "bash coreutils util-linux mount iproute2 busybox-static" \
  '["/usr/local/bin/agent-entrypoint.sh"]' \
  "$bin/network-agent:/usr/local/bin/network-agent" \
  "$bin/cubenet-cli:/usr/local/bin/cubenet-cli" \
  "$root/target/ebpf/cubevs.bpf.o:/usr/local/bin/cubevs.bpf.o" \
  "$root/scripts/start-network-agent.sh:/usr/local/bin/start-network-agent.sh" \
  "$img/cubenet-preflight.sh:/usr/local/bin/cubenet-preflight.sh" \
  "$img/cubenet-netns-exec.sh:/usr/local/bin/cubenet-netns-exec.sh" \
  "$img/agent-prestop.sh:/usr/local/bin/agent-prestop.sh" \
  "$img/agent-entrypoint.sh:/usr/local/bin/agent-entrypoint.sh"
build_image cube-egress \
  "CubeEgress: transparent L7 egress gateway of CubeSandbox, with its TPROXY plumbing" \
  "bash coreutils util-linux iproute2 iptables busybox-static openssl ca-certificates" \
  '["/usr/local/bin/cube-egress-slot.sh"]' \
  "$bin/cube-egress:/usr/local/bin/cube-egress" \
  "$root/scripts/cube-egress-net.sh:/usr/local/bin/cube-egress-net.sh" \
  "$img/cube-egress-net-entrypoint.sh:/usr/local/bin/cube-egress-net-entrypoint.sh" \
  "$img/cube-egress-slot.sh:/usr/local/bin/cube-egress-slot.sh" \
  "$img/cubenet-netns-exec.sh:/usr/local/bin/cubenet-netns-exec.sh"
