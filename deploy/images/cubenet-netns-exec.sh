#!/usr/bin/env bash
# cubenet-netns-exec.sh CMD [ARGS…] — runs CMD in the CubeNet dataplane network namespace.
#
# CUBENET_DATAPLANE_NETNS names it: empty (overlay mode: the pod's own namespace) runs CMD
# as is; a path (underlay mode: /proc/1/ns/net with hostPID, or /run/netns/NAME) runs it under
# `nsenter --net=PATH`. CubeEgress's transparent listeners and its TPROXY rules must live
# where cube-dev and the sandbox TAPs live, which is the agent's dataplane_netns.
set -euo pipefail
ns=${CUBENET_DATAPLANE_NETNS:-}
(($#)) || { echo "usage: cubenet-netns-exec.sh CMD [ARGS...]" >&2; exit 2; }
if [[ -z "$ns" ]]; then
  exec "$@"
fi
[[ -e "$ns" ]] || { echo "cubenet-netns-exec: namespace $ns does not exist" >&2; exit 1; }
exec nsenter --net="$ns" -- "$@"
