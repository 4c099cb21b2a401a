#!/usr/bin/env bash
# Entrypoint of the network-agent container (chart `underlay.surge`, decision K15): lets a
# surged CubeNode pod take the node's agent over from the running pod with the agent's live
# hand-over, and makes the old pod's agent stand down for good.
#
#   CUBENET_POD_UID          this pod's uid (downward API metadata.uid); unset = plain start
#                            (exec start-network-agent.sh, the pre-K15 behaviour)
#   CUBENET_HANDOVER_DIR     host path both pods of a node mount (default /run/cubenet-handover):
#                            the agent's hand-over socket (config.toml `handover_socket`) and
#                            `agent.owner`, the uid of the pod that last claimed the node
#   CUBENET_POD_RUN          emptyDir of this pod (default /run/cubenet-pod): `agent.claimed`
#                            tells a container restart from the pod's first start
#   CUBENET_HEALTH_PORT      port the stood-down container answers /healthz on (default 19090)
#
# First start of the pod's agent container: write our uid to agent.owner (claim), start the
# agent; its `handover_socket` makes it take the listeners and TAP fds over from a running
# agent (the predecessor's pod), or start fresh when none runs. When the agent exits 0 and
# agent.owner names another pod, a newer pod took over: stand down. A restart of this
# container (crash, liveness) runs the agent again only while agent.owner still names this
# pod; otherwise it stands down at once, so an old pod never takes the node back (no
# ping-pong). Standing down = `busybox httpd` answers GET /healthz (liveness passes, so the
# kubelet does not restart the container) and nothing else (/readyz 404: the pod is not
# ready) until SIGTERM, which the DaemonSet controller's deletion of the pod sends.
#
# SIGHUP is passed on to the agent (it re-reads `always_denied_cidrs`, R51): without the trap
# bash would die of it and the container's exit would kill the agent without a hand-over
# (decision O17). Find the agent's PID in the pod with `busybox pidof network-agent`. A SIGHUP
# ignored when bash starts (a parent under `nohup`) cannot be trapped (POSIX); container
# runtimes start PID 1 with every signal at its default action.
set -euo pipefail
bindir=${CUBENET_IMAGE_BIN:-/usr/local/bin}
log() { printf '[agent-entrypoint] %s\n' "$*" >&2; }

if [[ -z "${CUBENET_POD_UID:-}" ]]; then
  exec "$bindir/start-network-agent.sh"
fi
me=$CUBENET_POD_UID
dir=${CUBENET_HANDOVER_DIR:-/run/cubenet-handover}
podrun=${CUBENET_POD_RUN:-/run/cubenet-pod}
owner_file="$dir/agent.owner"
owner() { cat "$owner_file" 2>/dev/null || true; }

stand_down() {
  log "standing down: $1; answering /healthz only until SIGTERM"
  : >"$podrun/agent.stood-down"
  local www="$podrun/agent-www"
  mkdir -p "$www"
  printf 'stood down: pod %s serves this node\n' "$(owner)" >"$www/healthz"
  trap 'log "SIGTERM while stood down: exit 0"; exit 0' TERM INT
  trap 'log "SIGHUP while stood down: no agent here to reload"' HUP
  busybox httpd -f -p "${CUBENET_HEALTH_PORT:-19090}" -h "$www" &
  wait $! || true
  # httpd gone (port taken?): keep standing down without it.
  while true; do sleep 3600 & wait $!; done
}

mkdir -p "$dir" "$podrun"
if [[ ! -e "$podrun/agent.claimed" ]]; then
  prev=$(owner)
  printf '%s\n' "$me" >"$owner_file.tmp.$$"
  mv -f "$owner_file.tmp.$$" "$owner_file"
  : >"$podrun/agent.claimed"
  log "pod $me claims the node's agent (previous claim: ${prev:-none}); hand-over socket in $dir"
elif [[ "$(owner)" != "$me" ]]; then
  stand_down "restarted after pod $(owner) took the node over"
fi

# The traps go in before the agent starts: a SIGHUP or SIGTERM in between would otherwise end
# bash (the default action) while the agent runs on. A SIGHUP before the agent exists needs no
# forwarding (the agent reads its config at start); a SIGTERM then stops it as soon as it exists.
pid=
termed=0
sig=0
trap 'sig=1; termed=1; [[ -z $pid ]] || kill -TERM "$pid" 2>/dev/null || true' TERM INT
trap 'sig=1; if [[ -n $pid ]]; then log "SIGHUP: passed on to the agent (pid $pid)"; kill -HUP "$pid" 2>/dev/null || true; fi' HUP
"$bindir/start-network-agent.sh" &
pid=$!
if ((termed)); then
  kill -TERM "$pid" 2>/dev/null || true
fi
# `wait` returns early (>128) when a trapped signal arrives: wait again for the agent's own
# status (bash keeps the status of a child it already reaped), not the interrupted wait's.
while :; do
  sig=0 rc=0
  wait "$pid" || rc=$?
  ((sig)) || break
done
if [[ $termed -eq 0 && $rc -eq 0 && "$(owner)" != "$me" ]]; then
  trap - TERM INT
  stand_down "the agent handed the node over to pod $(owner)"
fi
exit "$rc"
