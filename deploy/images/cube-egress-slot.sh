#!/usr/bin/env bash
# Entrypoint of the two CubeEgress slots of the CubeNode pod (cube-egress, cube-egress-standby).
# Both run this script with the same settings; whichever finds no serving gateway starts
# cube-egress in the dataplane namespace (cubenet-netns-exec.sh), the other parks as a hot
# standby polling the gateway's health (GET http://$CUBE_EGRESS_ADMIN_ADDR/admin/v1/health)
# every second and starts as soon as it stops answering. An in-place image update of one slot
# therefore never leaves the node without a gateway for longer than a restart of the other:
# update the standby first, then the active one (README "Upgrades"). Two slots that start at
# the same moment may both try to bind; the loser exits, is restarted and parks.
#
# The CA is read (and converted) when the slot starts its gateway, not when the script starts:
# a standby parked since before a CA rotation takes over with the Secret's current CA.
# CUBENET_IMAGE_BIN (default /usr/local/bin) is where the image's programs live (tests).
#
# Surge upgrades (chart `underlay.surge`, decision K15): with CUBE_EGRESS_HANDOFF_SOCKET set (a
# host path both pods of the node mount; cube-egress reads the variable itself), every gateway
# serves its listeners and state there, and is started with `--takeover-socket` on the same
# path and `--takeover-optional`: it takes over from whoever serves it, or binds fresh. The
# first slot of a pod to start (it creates `claimed` in the pod's CUBE_EGRESS_RUN_DIR, an
# emptyDir) does not park: it takes the node's gateway over from the older pod at once (E18
# swap: nothing refused, keep-alive connections drain to it). Every other start — the pod's
# second slot, any container restart — parks while a gateway answers, so a slot of the old pod
# that exits after handing over and is restarted never takes the node back.
set -euo pipefail
admin=${CUBE_EGRESS_ADMIN_ADDR:-127.0.0.1:9091}
bindir=${CUBENET_IMAGE_BIN:-/usr/local/bin}
run() { "$bindir/cubenet-netns-exec.sh" "$@"; }
log() { printf '[cube-egress-slot %s] %s\n' "${CUBE_EGRESS_SLOT:-?}" "$*" >&2; }
# busybox wget's -T segfaults in bookworm's static build: bound it with coreutils timeout.
alive() { run timeout 3 wget -q -O /dev/null "http://$admin/admin/v1/health" 2>/dev/null; }

# CA key format: Helm's genPrivateKey (selfSigned mode) and most tooling write SEC1
# ("EC PRIVATE KEY") or PKCS#1 ("RSA PRIVATE KEY"); cube-egress loads PKCS#8. Convert into the
# slot's memory-backed run directory and point CUBE_EGRESS_CA_DIR there (the Secret stays as is).
convert_ca() {
  local ca=${CUBE_EGRESS_CA_DIR:-/etc/cube/ca} first conv
  if [[ -r "$ca/cube-root-ca.key" ]]; then
    first=$(head -n 1 "$ca/cube-root-ca.key")
    if [[ "$first" == *"EC PRIVATE KEY"* || "$first" == *"RSA PRIVATE KEY"* ]]; then
      conv="${CUBE_EGRESS_RUN_DIR:-/run/cube-egress}/${CUBE_EGRESS_SLOT:-a}/ca"
      mkdir -p "$conv"; chmod 700 "$conv"
      (umask 077; openssl pkcs8 -topk8 -nocrypt -in "$ca/cube-root-ca.key" -out "$conv/cube-root-ca.key")
      cp "$ca/cube-root-ca.crt" "$conv/cube-root-ca.crt"
      export CUBE_EGRESS_CA_DIR="$conv"
      log "CA key converted to PKCS#8 in $conv"
    fi
  fi
}

trap 'exit 0' TERM INT
takeover=()
if [[ -n "${CUBE_EGRESS_HANDOFF_SOCKET:-}" ]]; then
  takeover=(--takeover-socket "$CUBE_EGRESS_HANDOFF_SOCKET" --takeover-optional)
  rundir=${CUBE_EGRESS_RUN_DIR:-/run/cube-egress}
  mkdir -p "$rundir" "$(dirname "$CUBE_EGRESS_HANDOFF_SOCKET")"
  if mkdir "$rundir/claimed" 2>/dev/null; then
    log "first slot of this pod: taking the node's gateway over through $CUBE_EGRESS_HANDOFF_SOCKET (fresh start if none serves it)"
    convert_ca
    exec "$bindir/cubenet-netns-exec.sh" "$bindir/cube-egress" "${takeover[@]}" "$@"
  fi
fi
if alive; then
  log "a gateway already answers on $admin: parked as standby"
  while alive; do sleep 1 & wait $!; done
  log "the active gateway stopped answering: taking over"
fi
convert_ca
exec "$bindir/cubenet-netns-exec.sh" "$bindir/cube-egress" "${takeover[@]}" "$@"
