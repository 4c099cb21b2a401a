#!/usr/bin/env bash
# cube-egress-net.sh up|down|status — the capture plumbing of CubeEgress in the current
# network namespace (run it with `ip netns exec <ns>` to target another one):
#
#   mangle chain TRANSPROXY (jumped to from PREROUTING):
#     -i $IFACE -p tcp -m mark --mark $MARK_HTTP/$MASK  -j TPROXY --on-ip $G --on-port $HTTP_PORT
#     -i $IFACE -p tcp -m mark --mark $MARK_HTTPS/$MASK -j TPROXY --on-ip $G --on-port $HTTPS_PORT
#     -j RETURN
#   ip rule fwmark $MARK_HTTP/$MASK lookup $TABLE ; ip rule fwmark $MARK_HTTPS/$MASK lookup $TABLE
#   ip route local 0.0.0.0/0 dev lo table $TABLE
#
# The datapath sets the marks; G = network($CUBE_SANDBOX_NETWORK_CIDR) + 1 (upstream.md §4.2).
# `up` builds the new chain as TRANSPROXY.new, verifies every rule, then swaps it in, so the
# old chain keeps working until the new one is complete; it is idempotent. `down` removes
# exactly what `up` adds. `status` exits 0 when fully up, 3 when fully down, 1 when partial.
#
# Environment (defaults):
#   CUBE_INGRESS_IFACE=cube-dev          CUBE_SANDBOX_NETWORK_CIDR=192.168.0.0/18
#   CUBE_EGRESS_LISTEN_IP=<G>            CUBE_EGRESS_HTTP_PORT=8080  CUBE_EGRESS_HTTPS_PORT=8443
#   CUBE_EGRESS_MARK_HTTP=0xCE010000     CUBE_EGRESS_MARK_HTTPS=0xCE020000
#   CUBE_EGRESS_MARK_MASK=0xFFFF0000     CUBE_EGRESS_ROUTE_TABLE=100
#   CUBE_EGRESS_MARKS_CONF=/etc/cubeegress/l7-marks.conf (optional; MARK_HTTP=, MARK_HTTPS=, MARK_MASK= lines)
#   IPTABLES=iptables
set -euo pipefail

IFACE=${CUBE_INGRESS_IFACE:-cube-dev}
CIDR=${CUBE_SANDBOX_NETWORK_CIDR:-192.168.0.0/18}
HTTP_PORT=${CUBE_EGRESS_HTTP_PORT:-8080}
HTTPS_PORT=${CUBE_EGRESS_HTTPS_PORT:-8443}
MARK_HTTP=${CUBE_EGRESS_MARK_HTTP:-0xCE010000}
MARK_HTTPS=${CUBE_EGRESS_MARK_HTTPS:-0xCE020000}
MARK_MASK=${CUBE_EGRESS_MARK_MASK:-0xFFFF0000}
TABLE=${CUBE_EGRESS_ROUTE_TABLE:-100}
MARKS_CONF=${CUBE_EGRESS_MARKS_CONF:-/etc/cubeegress/l7-marks.conf}
IPT=${IPTABLES:-iptables}
CHAIN=TRANSPROXY
NEW=TRANSPROXY.new

log() { printf '[cube-egress-net] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

if [[ -r "$MARKS_CONF" ]]; then
  while IFS='=' read -r k v; do
    v=${v//[[:space:]]/}
    case "$k" in
      MARK_HTTP) MARK_HTTP=$v ;;
      MARK_HTTPS) MARK_HTTPS=$v ;;
      MARK_MASK) MARK_MASK=$v ;;
      ''|\#*) ;;
      *) die "$MARKS_CONF: unknown key $k" ;;
    esac
  done <"$MARKS_CONF"
fi

is_num() { [[ "$1" =~ ^(0[xX][0-9a-fA-F]{1,8}|[0-9]+)$ ]]; }

validate() {
  local m
  for m in "$MARK_HTTP" "$MARK_HTTPS" "$MARK_MASK"; do
    is_num "$m" || die "mark/mask $m is not a number"
    (( m >= 0 && m <= 0xFFFFFFFF )) || die "mark/mask $m does not fit 32 bits"
  done
  (( MARK_MASK != 0 )) || die "mask must not be 0"
  (( (MARK_HTTP & ~MARK_MASK & 0xFFFFFFFF) == 0 )) || die "MARK_HTTP $MARK_HTTP has bits outside mask $MARK_MASK"
  (( (MARK_HTTPS & ~MARK_MASK & 0xFFFFFFFF) == 0 )) || die "MARK_HTTPS $MARK_HTTPS has bits outside mask $MARK_MASK"
  (( MARK_HTTP != 0 && MARK_HTTPS != 0 )) || die "marks must be non-zero"
  (( MARK_HTTP != MARK_HTTPS )) || die "HTTP and HTTPS marks must differ"
  for m in "$HTTP_PORT" "$HTTPS_PORT" "$TABLE"; do
    [[ "$m" =~ ^[0-9]+$ ]] || die "$m is not a number"
  done
  (( HTTP_PORT >= 1 && HTTP_PORT <= 65535 && HTTPS_PORT >= 1 && HTTPS_PORT <= 65535 )) || die "bad listener port"
  [[ "$IFACE" =~ ^[A-Za-z0-9_.@-]{1,15}$ ]] || die "bad interface name $IFACE"
}

# Network address + 1 of an IPv4 CIDR.
gateway_ip() {
  local ip=${1%/*} len=${1#*/} a b c d n mask
  if ! [[ "$1" == */* && "$len" =~ ^[0-9]+$ ]] || (( len > 30 )); then die "bad CIDR $1"; fi
  IFS=. read -r a b c d <<<"$ip"
  for n in "$a" "$b" "$c" "$d"; do
    if ! [[ "$n" =~ ^[0-9]+$ ]] || (( n > 255 )); then die "bad CIDR $1"; fi
  done
  n=$(( (a << 24) | (b << 16) | (c << 8) | d ))
  mask=$(( len == 0 ? 0 : (0xFFFFFFFF << (32 - len)) & 0xFFFFFFFF ))
  n=$(( (n & mask) + 1 ))
  printf '%d.%d.%d.%d\n' $(( (n >> 24) & 255 )) $(( (n >> 16) & 255 )) $(( (n >> 8) & 255 )) $(( n & 255 ))
}

hex() { printf '0x%x' $(( $1 )); }

validate
G=${CUBE_EGRESS_LISTEN_IP:-$(gateway_ip "$CIDR")}
MH=$(hex "$MARK_HTTP"); MS=$(hex "$MARK_HTTPS"); MM=$(hex "$MARK_MASK")

rule_args() { # <mark> <port>
  printf '%s\n' -i "$IFACE" -p tcp -m mark --mark "$1/$MM" -j TPROXY --on-ip "$G" --on-port "$2"
}

chain_exists() { "$IPT" -t mangle -S "$1" >/dev/null 2>&1; }
jump_exists() { "$IPT" -t mangle -C PREROUTING -j "$1" >/dev/null 2>&1; }

# Every `ip rule` line (lower-case) of our table, to match without `| grep -q`.
ip_rules() { local out; out=$(ip -4 rule show); printf '%s\n' "${out,,}"; }
has_rule() { local rules; rules=$(ip_rules); [[ "$rules" == *"fwmark $1/$MM lookup $TABLE"* ]]; }

drop_chain() {
  while jump_exists "$1"; do "$IPT" -t mangle -D PREROUTING -j "$1"; done
  if chain_exists "$1"; then
    "$IPT" -t mangle -F "$1"
    "$IPT" -t mangle -X "$1"
  fi
}

up() {
  modprobe -q xt_TPROXY 2>/dev/null || log "warning: modprobe xt_TPROXY failed (built in?)"
  modprobe -q xt_socket 2>/dev/null || log "warning: modprobe xt_socket failed (built in?)"
  modprobe -q nf_tproxy_ipv4 2>/dev/null || log "warning: modprobe nf_tproxy_ipv4 failed (built in?)"

  # Routing first: marked packets must be delivered locally before any chain marks them.
  ip -4 route replace local 0.0.0.0/0 dev lo table "$TABLE"
  local m port
  for m in "$MH" "$MS"; do
    has_rule "$m" || ip -4 rule add fwmark "$m/$MM" lookup "$TABLE"
  done
  for port in 80 443; do # legacy rules of older releases
    while ip -4 rule del iif "$IFACE" ipproto tcp dport "$port" lookup "$TABLE" 2>/dev/null; do :; done
  done

  # Build the new chain completely and verify it before it carries traffic.
  drop_chain "$NEW"
  "$IPT" -t mangle -N "$NEW"
  mapfile -t r1 < <(rule_args "$MH" "$HTTP_PORT")
  mapfile -t r2 < <(rule_args "$MS" "$HTTPS_PORT")
  if ! { "$IPT" -t mangle -A "$NEW" "${r1[@]}" && "$IPT" -t mangle -A "$NEW" "${r2[@]}" &&
         "$IPT" -t mangle -A "$NEW" -j RETURN &&
         "$IPT" -t mangle -C "$NEW" "${r1[@]}" && "$IPT" -t mangle -C "$NEW" "${r2[@]}"; }; then
    drop_chain "$NEW"
    die "could not build $NEW (is xt_TPROXY available?); the previous $CHAIN is untouched"
  fi
  # Swap: jump to the new chain first, then retire the old one, then take its name.
  "$IPT" -t mangle -A PREROUTING -j "$NEW"
  drop_chain "$CHAIN"
  "$IPT" -t mangle -E "$NEW" "$CHAIN"
  jump_exists "$CHAIN" || "$IPT" -t mangle -A PREROUTING -j "$CHAIN"
  status >/dev/null || die "verification after up failed"
  log "up: $IFACE marks $MH/$MS mask $MM -> $G:$HTTP_PORT/$HTTPS_PORT, table $TABLE"
}

down() {
  drop_chain "$CHAIN"
  drop_chain "$NEW"
  local m
  for m in "$MH" "$MS"; do
    while has_rule "$m"; do ip -4 rule del fwmark "$m/$MM" lookup "$TABLE"; done
  done
  ip -4 route flush table "$TABLE" 2>/dev/null || true
  log "down: removed $CHAIN, fwmark rules and table $TABLE"
}

# Prints one line per component; returns 0 all present, 3 none present, 1 partial.
status() {
  local have=0 total=0 routes
  check() { total=$((total + 1)); if "$@"; then have=$((have + 1)); echo "ok      ${*: -1}"; else echo "missing ${*: -1}"; fi; }
  mapfile -t r1 < <(rule_args "$MH" "$HTTP_PORT")
  mapfile -t r2 < <(rule_args "$MS" "$HTTPS_PORT")
  rule_ok() { "$IPT" -t mangle -C "$CHAIN" "${@:1:$#-1}" >/dev/null 2>&1; }
  check jump_exists "$CHAIN"
  check rule_ok "${r1[@]}" "http-tproxy"
  check rule_ok "${r2[@]}" "https-tproxy"
  check has_rule "$MH"
  check has_rule "$MS"
  routes=$(ip -4 route show table "$TABLE" 2>/dev/null || true)
  local_route() { [[ "$routes" == *"local default dev lo"* ]]; }
  check local_route "local-route-table-$TABLE"
  if (( have == total )); then return 0; elif (( have == 0 )); then return 3; else return 1; fi
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
