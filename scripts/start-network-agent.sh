#!/usr/bin/env bash
# Starts the CubeNet network-agent the way the node image does (the seed's init sequence):
#   (1) wait, bounded, for the directories the agent uses but must not create: the log file's
#       directory when the log goes to a file, and any listed volumes (nothing by default: the
#       agent creates its socket and state directories itself);
#   (2) make sure bpffs is mounted under bpffs_dir, then the agent loads the eBPF datapath;
#   (3) the agent creates or reconciles cube-dev;
#   (4) the agent recovers state and warms the TAP pool (tap_init_num, 500 by default);
#   (5) the agent serves health (/healthz, /readyz) first,
#   (6) then gRPC and the TAP fd socket.
# Steps 3-6 are performed, in that order and each logged with its duration, by the agent,
# which this script `exec`s so SIGTERM reaches it directly. SIGTERM stops the agent and leaves
# the datapath, TAPs and pins in place. SIGHUP makes the agent re-read NETWORK_AGENT_CONFIG and
# apply its always_denied_cidrs (other changed keys are logged as needing a restart).
#
# Environment:
#   NETWORK_AGENT_CONFIG     TOML config file (optional; every key has a default)
#   NETWORK_AGENT_BIN        agent binary (default: network-agent next to this script's
#                            target/release or target/debug build, else on PATH)
#   NETWORK_AGENT_HANDOVER_SOCKET  live upgrade: the agent's hand-over socket (optional,
#                            `--handover-socket`); a new agent started while one runs there
#                            takes its listeners and TAP fds over instead of binding afresh.
#                            To upgrade, run this script again with the new NETWORK_AGENT_BIN
#                            and the same socket while the old agent runs: the old one hands
#                            over and exits by itself (README "Live upgrade")
#   NETWORK_AGENT_ARGS       extra flags for the agent (word-split), e.g. "--tap-init-num 8"
#   NETWORK_AGENT_LOG_FORMAT json: one JSON object per line (the chart's default); else text
#   NETWORK_AGENT_LOG_FILE   append the agent's log here instead of stderr (optional); its
#                            directory is waited for (a missing log volume is an error, never
#                            created here: logs written into the container would be lost)
#   NETWORK_AGENT_LOG_DIR    another log directory to wait for (optional, e.g. a volume a
#                            sidecar reads)
#   NETWORK_AGENT_VOLUMES    extra directories to wait for (space-separated), e.g. host-path
#                            volumes shared with cubelet such as /tmp/cube
#   NETWORK_AGENT_WAIT_SECS  bound of the wait (default 60)
#   NETWORK_AGENT_BPFFS_ROOT where bpffs is mounted when missing (default /sys/fs/bpf)
#   NETWORK_AGENT_MOUNT_BPFFS  1 (default): mount bpffs there if missing; 0: fail instead
#
# Arguments: none (-h/--help prints this). Anything else is refused with status 2: the agent
# would otherwise start with the defaults, whose dataplane_netns is the node's namespace.
set -euo pipefail

log() { printf '[start-network-agent] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

case "${1:-}" in
  -h | --help)
    while IFS= read -r line; do
      [[ "$line" == "#!"* ]] && continue
      [[ "$line" == "#"* ]] || break
      line="${line#\#}"
      printf '%s\n' "${line# }"
    done <"$0"
    exit 0
    ;;
  "") ;;
  *)
    log "error: no arguments taken (got '$1'); set NETWORK_AGENT_CONFIG and NETWORK_AGENT_ARGS (see --help)"
    exit 2
    ;;
esac

here="$(cd "$(dirname "$0")" && pwd)"
bin="${NETWORK_AGENT_BIN:-}"
if [[ -z "$bin" ]]; then
  for c in "$here/../target/release/network-agent" "$here/../target/debug/network-agent"; do
    if [[ -x "$c" ]]; then bin="$c"; break; fi
  done
fi
if [[ -z "$bin" ]]; then
  bin="$(command -v network-agent || true)"
fi
[[ -n "$bin" && -x "$bin" ]] || die "network-agent binary not found (set NETWORK_AGENT_BIN)"

args=()
if [[ -n "${NETWORK_AGENT_CONFIG:-}" ]]; then
  [[ -r "$NETWORK_AGENT_CONFIG" ]] || die "config $NETWORK_AGENT_CONFIG is not readable"
  args+=(--config "$NETWORK_AGENT_CONFIG")
fi
if [[ -n "${NETWORK_AGENT_HANDOVER_SOCKET:-}" ]]; then
  args+=(--handover-socket "$NETWORK_AGENT_HANDOVER_SOCKET")
fi
if [[ -n "${NETWORK_AGENT_ARGS:-}" ]]; then
  read -r -a extra <<<"$NETWORK_AGENT_ARGS"
  args+=("${extra[@]}")
fi

# The effective configuration (file + flags + defaults), validated by the agent itself.
effective="$("$bin" "${args[@]}" --print-config)" || die "invalid configuration"
cfg() {
  local key="$1" line
  while IFS= read -r line; do
    if [[ "$line" == "$key = "* ]]; then
      line="${line#"$key = "}"
      line="${line#\"}"
      printf '%s\n' "${line%\"}"
      return 0
    fi
  done <<<"$effective"
  return 1
}
bpffs_dir="$(cfg bpffs_dir)"

# (1) Directories the agent needs but does not create, bounded wait. The socket directories
# and state_dir are created by the agent (mkdir -p), so they are not waited for.
wait_secs="${NETWORK_AGENT_WAIT_SECS:-60}"
volumes=()
if [[ -n "${NETWORK_AGENT_LOG_FILE:-}" ]]; then
  volumes+=("$(dirname "$NETWORK_AGENT_LOG_FILE")")
fi
if [[ -n "${NETWORK_AGENT_LOG_DIR:-}" ]]; then
  [[ " ${volumes[*]} " == *" $NETWORK_AGENT_LOG_DIR "* ]] || volumes+=("$NETWORK_AGENT_LOG_DIR")
fi
if [[ -n "${NETWORK_AGENT_VOLUMES:-}" ]]; then
  read -r -a more <<<"$NETWORK_AGENT_VOLUMES"
  volumes+=("${more[@]}")
fi
t0=$SECONDS
for v in "${volumes[@]}"; do
  until [[ -d "$v" ]]; do
    if (( SECONDS - t0 >= wait_secs )); then
      die "directory $v (log or volume) did not appear within ${wait_secs}s; create or mount it, or unset the variable naming it"
    fi
    sleep 1
  done
done
log "(1) directories present: ${volumes[*]:-none to wait for} ($(( SECONDS - t0 ))s)"

# (2) bpffs: bpffs_dir must live on a bpf filesystem. If it lies under the bpffs root
# (default /sys/fs/bpf) and that is not mounted, mount it there; anything else is an error.
bpffs_root="${NETWORK_AGENT_BPFFS_ROOT:-/sys/fs/bpf}"
root="$bpffs_dir"
while [[ ! -d "$root" ]]; do root="$(dirname "$root")"; done
fstype="$(stat -f -c %T "$root")"
if [[ "$fstype" != "bpf_fs" ]]; then
  if [[ "${NETWORK_AGENT_MOUNT_BPFFS:-1}" == 1 && "$bpffs_dir/" == "$bpffs_root/"* && -d "$bpffs_root" ]]; then
    log "(2) mounting bpffs at $bpffs_root"
    mount -t bpf bpf "$bpffs_root" || die "mount bpffs at $bpffs_root failed"
  else
    die "$root is on $fstype, not bpffs (mount bpffs there or set bpffs_dir)"
  fi
fi
log "(2) bpffs ready; the agent loads the datapath and pins under $bpffs_dir"

if [[ -n "${NETWORK_AGENT_LOG_FILE:-}" ]]; then
  exec >>"$NETWORK_AGENT_LOG_FILE" 2>&1
fi
log "(3-6) exec $bin ${args[*]}: cube-dev, recovery + TAP pool, health, then gRPC and the TAP socket"
exec "$bin" "${args[@]}"
