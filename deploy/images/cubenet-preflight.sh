#!/usr/bin/env bash
# cubenet-preflight.sh — init container of the CubeNode pod; refuses to start the node when
#   (1) the sandbox CIDR ($CUBENET_CIDR) overlaps a route of the dataplane namespace, in any
#       routing table (a sandbox address would shadow or be shadowed by a node network), or
#   (2) the kernel has no bpf filesystem, or $CUBENET_BPFFS_ROOT (default /sys/fs/bpf) is not
#       bpffs while CUBENET_REQUIRE_BPFFS=1 (the default: pins must outlive the pod, so bpffs
#       must be the host's mount, not one made inside the container).
# Routes on the agent's own gateway device ($CUBENET_CUBE_DEV, default cube-dev), the default
# route and CubeEgress's `local 0.0.0.0/0 table 100` are ignored: they are ours or cover
# everything. Run it through cubenet-netns-exec.sh to inspect the dataplane namespace.
# Exit 0: ok; 1: refused (the reason on stderr); 2: bad input.
set -euo pipefail
cidr=${CUBENET_CIDR:?CUBENET_CIDR (the sandbox CIDR) is required}
cube_dev=${CUBENET_CUBE_DEV:-cube-dev}
bpffs_root=${CUBENET_BPFFS_ROOT:-/sys/fs/bpf}
log() { printf '[cubenet-preflight] %s\n' "$*" >&2; }

# to_int A.B.C.D -> 32-bit integer; fails on a malformed address.
to_int() {
  local a b c d n
  IFS=. read -r a b c d <<<"$1"
  for n in "$a" "$b" "$c" "$d"; do
    [[ "$n" =~ ^[0-9]{1,3}$ ]] && (( n <= 255 )) || return 1
  done
  printf '%d\n' $(( (a << 24) | (b << 16) | (c << 8) | d ))
}
# parse PREFIX -> "net len"
parse() {
  local p=$1 ip len n
  ip=${p%/*}; len=32; [[ "$p" == */* ]] && len=${p#*/}
  [[ "$len" =~ ^[0-9]{1,2}$ ]] && (( len <= 32 )) || return 1
  n=$(to_int "$ip") || return 1
  printf '%d %d\n' $(( n & (len == 0 ? 0 : (0xFFFFFFFF << (32 - len)) & 0xFFFFFFFF) )) "$len"
}

read -r cnet clen < <(parse "$cidr") || { log "bad CUBENET_CIDR $cidr"; exit 2; }
(( clen >= 16 && clen <= 24 )) || { log "CUBENET_CIDR $cidr: prefix must be /16../24 (agent limit)"; exit 2; }

overlaps=()
while read -r line; do
  [[ -n "$line" ]] || continue
  read -r -a w <<<"$line"
  # `ip -o route show table all`: [type] DEST [via X] dev D ... [table T] ...
  i=0
  case "${w[0]}" in unicast|local|broadcast|anycast|multicast|blackhole|unreachable|prohibit|throw|nat) i=1 ;; esac
  dest=${w[$i]}
  [[ "$dest" == default || "$dest" == 0.0.0.0/0 ]] && continue
  dev="" table=main
  for ((j = i; j < ${#w[@]}; j++)); do
    [[ "${w[$j]}" == dev ]] && dev=${w[$((j + 1))]:-}
    [[ "${w[$j]}" == table ]] && table=${w[$((j + 1))]:-}
  done
  [[ "$dev" == "$cube_dev" ]] && continue
  read -r rnet rlen < <(parse "$dest") || continue
  (( rlen < clen )) && m=$rlen || m=$clen
  mask=$(( m == 0 ? 0 : (0xFFFFFFFF << (32 - m)) & 0xFFFFFFFF ))
  if (( (rnet & mask) == (cnet & mask) )); then
    overlaps+=("$dest dev ${dev:-?} table $table")
  fi
done < <(ip -4 -o route show table all)

if ((${#overlaps[@]})); then
  log "refusing: sandbox CIDR $cidr overlaps routes of the dataplane namespace:"
  for o in "${overlaps[@]}"; do log "  $o"; done
  log "choose another cidr (chart value cidr) that no node network uses"
  exit 1
fi
log "sandbox CIDR $cidr overlaps no route"

fs=$(cat /proc/filesystems)
if [[ "$fs" != *$'\tbpf'* ]]; then
  log "refusing: the kernel has no bpf filesystem (CONFIG_BPF_SYSCALL)"
  exit 1
fi
if [[ "${CUBENET_REQUIRE_BPFFS:-1}" == 1 ]]; then
  t=$(stat -f -c %T "$bpffs_root" 2>/dev/null || echo missing)
  if [[ "$t" != bpf_fs ]]; then
    log "refusing: $bpffs_root is $t, not bpffs: mount bpffs on the node (mount -t bpf bpf /sys/fs/bpf)"
    log "so pinned maps and links outlive the pod, or set preflight.requireHostBpffs=false"
    exit 1
  fi
fi
log "bpffs at $bpffs_root: ok"
