#!/usr/bin/env bash
# Entrypoint of the cube-egress-net container: keeps CubeEgress's capture plumbing
# (scripts/cube-egress-net.sh) installed in the dataplane namespace.
#
#   1. wait for the ingress device (cube-dev, created by network-agent), logging every
#      CUBE_EGRESS_NET_LOG_SECS (60) while it is missing;
#   2. `cube-egress-net.sh up` (idempotent: builds TRANSPROXY.new, verifies, swaps);
#   3. re-run `up` every CUBE_EGRESS_NET_REAPPLY_SECS (30), repairing rules someone removed.
#
# SIGTERM exits WITHOUT `down`: a container restart or in-place image update must not stop
# L7 capture for the running sandboxes; the successor's `up` adopts the rules. Removing the
# plumbing is an explicit operator action (`cube-egress-net.sh down`), docs/decisions.md K4.
set -euo pipefail
iface=${CUBE_INGRESS_IFACE:-cube-dev}
log_secs=${CUBE_EGRESS_NET_LOG_SECS:-60}
reapply=${CUBE_EGRESS_NET_REAPPLY_SECS:-30}
run() { /usr/local/bin/cubenet-netns-exec.sh "$@"; }
log() { printf '[cube-egress-net-entrypoint] %s\n' "$*" >&2; }

trap 'log "SIGTERM: leaving the capture rules in place"; exit 0' TERM INT

t0=$SECONDS last=-$log_secs
until run ip link show dev "$iface" >/dev/null 2>&1; do
  if (( SECONDS - last >= log_secs )); then
    log "waiting for $iface in ${CUBENET_DATAPLANE_NETNS:-the pod namespace} ($((SECONDS - t0)) s)"
    last=$SECONDS
  fi
  sleep 1 & wait $!
done
while true; do
  if run /usr/local/bin/cube-egress-net.sh up; then
    :
  else
    log "up failed (rc $?); retrying in ${reapply}s"
  fi
  sleep "$reapply" & wait $!
done
