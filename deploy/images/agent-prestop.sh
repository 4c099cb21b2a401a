#!/usr/bin/env bash
# preStop of the network-agent container. It stops nothing: SIGTERM (sent by the kubelet
# after this hook) makes the agent exit and leave the datapath, the TAPs and the pins running,
# and the next agent adopts them. The hook records what the successor must adopt — the TAP
# table as JSON — in the log directory, so an upgrade can be audited afterwards. Bounded to
# 5 s; its failure never blocks the termination.
set -uo pipefail
dir=${NETWORK_AGENT_LOG_DIR:-/data/log/network-agent}
http=${CUBENET_PRESTOP_HTTP:-127.0.0.1:19090}
ts=$(date -u +%Y%m%dT%H%M%SZ)
# A pod whose agent stood down (agent-entrypoint.sh, K15) has nothing to record: the node's
# agent runs in the newer pod.
if [[ -e "${CUBENET_POD_RUN:-/run/cubenet-pod}/agent.stood-down" ]]; then
  exit 0
fi
if [[ -d "$dir" ]]; then
  timeout 5 cubenet-cli --http "$http" --json taps >"$dir/prestop-$ts.json" 2>&1 || true
  # Keep the newest 10 (names sort by time).
  shopt -s nullglob
  snaps=("$dir"/prestop-*.json)
  for ((i = 0; i + 10 < ${#snaps[@]}; i++)); do rm -f "${snaps[$i]}"; done
fi
exit 0
