#!/bin/sh
# /init of the CubeNet test guest: copied into the initramfs by scripts/guest-image.sh and run
# by the guest kernel as PID 1 under busybox sh. Not meant to run on the host.
#
# Reads its configuration from the kernel command line (/proc/cmdline):
#   cubenet.ip=A.B.C.D/N       eth0 address                    (required)
#   cubenet.gw=A.B.C.D         default gateway                  (required)
#   cubenet.gwmac=MAC          static ARP entry for the gateway (optional)
#   cubenet.mac=MAC            eth0 MAC                         (optional; QEMU sets it too)
#   cubenet.mtu=N              eth0 MTU                         (optional)
#   cubenet.serve=PORT         run busybox httpd on PORT: / is index.html, /cgi-bin/whoami
#                              answers "you are <client ip>:<client port>"
#   cubenet.timeout=SECONDS    per-check timeout (default 5)
#   cubenet.ca=BASE64          a CA certificate (DER, base64) the https check trusts; written
#                              as PEM to /etc/cubenet-ca.pem (optional)
#   cubenet.check=KIND:ARGS    a check, repeatable, run in order:
#       arp:IP                 an ARP request for IP on eth0 is answered  (detail: the MAC)
#       ping:IP                one ICMP echo to IP is answered            (detail: rtt)
#       http:IP:PORT[/PATH]    HTTP GET succeeds                           (detail: first body line)
#       fetch:IP:PORT[/PATH]   HTTP GET succeeds                           (detail: "bytes <body size>")
#       send:IP:PORT:BYTES     BYTES zero bytes sent over TCP, then EOF    (detail: first reply line)
#       refused:IP:PORT        a TCP connect is actively refused (RST)     (detail: the error)
#       dns:NAME@SERVER        nslookup -type=a NAME SERVER answers        (detail: first address)
#       vhost:NAME@IP:PORT/PATH=CODE  HTTP GET with Host: NAME answers status CODE
#                              (detail: first body line)
#       https:NAME@IP:PORT/PATH=CODE  HTTPS GET with SNI and Host NAME, trusting only
#                              cubenet.ca (/bin/cubenet-https-get), answers status CODE
#                              (detail: first body line)
# and prints to the console (ttyS0), one line each:
#   CUBENET-INFO <key> <value>              diagnostics (virtio-net-features: negotiated bits)
#   CUBENET-READY <ip> <ms since boot>      eth0 is configured (and httpd started)
#   CUBENET-CHECK <spec> PASS|FAIL <ms> <detail>
#   CUBENET-DONE <passed> <failed>          all checks ran
#   CUBENET-ERROR <message>                 setup failed; the guest powers off
# After CUBENET-DONE the guest powers off, unless it serves: then it runs until killed.
# shellcheck shell=sh

PATH=/bin
export PATH

/bin/mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mkdir -p /tmp

off() {
  sync
  poweroff -f
  sleep 5
  reboot -f
}

fatal() {
  echo "CUBENET-ERROR $*"
  off
}

now_ms() {
  awk '{ printf "%d", $1 * 1000 }' /proc/uptime
}

IP='' GW='' GWMAC='' MAC='' MTU='' SERVE='' TIMEOUT=5 CHECKS='' CA=''
read -r cmdline </proc/cmdline
set -f
for arg in $cmdline; do
  case "$arg" in
    cubenet.ip=*) IP=${arg#*=} ;;
    cubenet.gw=*) GW=${arg#*=} ;;
    cubenet.gwmac=*) GWMAC=${arg#*=} ;;
    cubenet.mac=*) MAC=${arg#*=} ;;
    cubenet.mtu=*) MTU=${arg#*=} ;;
    cubenet.serve=*) SERVE=${arg#*=} ;;
    cubenet.timeout=*) TIMEOUT=${arg#*=} ;;
    cubenet.check=*) CHECKS="$CHECKS ${arg#*=}" ;;
    cubenet.ca=*) CA=${arg#*=} ;;
  esac
done
{ [ -n "$IP" ] && [ -n "$GW" ]; } || fatal "cubenet.ip and cubenet.gw are required"
if [ -n "$CA" ]; then
  mkdir -p /etc
  {
    echo "-----BEGIN CERTIFICATE-----"
    printf '%s\n' "$CA" | fold -w 64
    echo "-----END CERTIFICATE-----"
  } >/etc/cubenet-ca.pem || fatal "write /etc/cubenet-ca.pem"
fi

# Keep the console for our lines: only emergencies from the kernel from now on.
dmesg -n 1
for m in virtio_ring virtio virtio_mmio failover net_failover virtio_net; do
  insmod "/lib/modules/$m.ko" || fatal "insmod $m"
done
i=0
while [ ! -e /sys/class/net/eth0 ]; do
  i=$((i + 1))
  [ "$i" -le 50 ] || fatal "no eth0 after loading virtio_net"
  sleep 0.1
done

ip link set lo up
if [ -n "$MAC" ]; then
  ip link set eth0 address "$MAC" || fatal "set MAC $MAC"
fi
if [ -n "$MTU" ]; then
  ip link set eth0 mtu "$MTU" || fatal "set MTU $MTU"
fi
ip addr add "$IP" dev eth0 || fatal "address $IP"
ip link set eth0 up || fatal "eth0 up"
ip route add default via "$GW" dev eth0 || fatal "default via $GW"
if [ -n "$GWMAC" ]; then
  arp -i eth0 -s "$GW" "$GWMAC" || fatal "static ARP $GW $GWMAC"
fi
if [ -n "$SERVE" ]; then
  httpd -p "0.0.0.0:$SERVE" -h /www || fatal "httpd on port $SERVE"
fi
set +f
for f in /sys/bus/virtio/drivers/virtio_net/virtio*/features; do
  [ -r "$f" ] && echo "CUBENET-INFO virtio-net-features $(cat "$f")"
done
set -f
echo "CUBENET-READY $IP $(now_ms)"

CR=$(printf '\r')

# HTTP/1.0 GET IP:PORT PATH [HOST] over busybox nc, response in /tmp/http (Host: HOST, default
# IP:PORT). Not busybox wget: the static (glibc) busybox's wget crashes in this NSS-less
# initramfs.
http_get() {
  printf 'GET %s HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n' "$2" "${3:-$1}" |
    timeout "$((TIMEOUT + 1))" nc -w "$TIMEOUT" "${1%:*}" "${1##*:}" >/tmp/http 2>/tmp/http.err
}

# Sets hostport and path (default /) from "IP:PORT[/PATH]".
split_url() {
  hostport=${1%%/*}
  path=/
  [ "$hostport" = "$1" ] || path=/${1#*/}
}

# Sets vname, want, hostport and path from "NAME@IP:PORT[/PATH]=CODE" (vhost, https).
split_vcheck() {
  vname=${1%%@*}
  rest=${1#*@}
  want=${rest##*=}
  split_url "${rest%=*}"
}

# PASS when status code $1 is the wanted one; the detail is body line $2 (and the code when
# it is not).
expect_code() {
  if [ "$1" = "$want" ]; then RESULT=PASS DETAIL=$2; else DETAIL="status $1: $2"; fi
}

# One check: sets RESULT (PASS|FAIL) and DETAIL (one line).
run_check() {
  kind=${1%%:*}
  args=${1#*:}
  RESULT=FAIL
  case "$kind" in
    arp)
      out=$(arping -f -c 1 -w "$TIMEOUT" -I eth0 "$args" 2>&1)
      mac=$(printf '%s\n' "$out" | sed -n 's/.*reply from [0-9.]* \[\([0-9a-fA-F:]*\)\].*/\1/p' | head -n 1)
      if [ -n "$mac" ]; then RESULT=PASS DETAIL=$mac; else DETAIL=$out; fi
      ;;
    ping)
      if out=$(ping -c 1 -W "$TIMEOUT" "$args" 2>&1); then
        RESULT=PASS
        DETAIL=$(printf '%s\n' "$out" | sed -n 's/.*time=\([0-9.]* ms\).*/rtt \1/p' | head -n 1)
      else
        DETAIL=$out
      fi
      ;;
    http | fetch)
      split_url "$args"
      if http_get "$hostport" "$path"; then
        status=$(head -n 1 /tmp/http | tr -d '\r')
        case "$status" in
          "HTTP/1."?" 200 "*)
            RESULT=PASS
            if [ "$kind" = http ]; then
              DETAIL=$(sed "1,/^$CR\$/d" /tmp/http | head -n 1)
            else
              DETAIL="bytes $(($(wc -c </tmp/http) - $(sed -n "1,/^$CR\$/p" /tmp/http | wc -c)))"
            fi
            ;;
          *) DETAIL="status: $status" ;;
        esac
      else
        DETAIL="no response: $(cat /tmp/http.err)"
      fi
      rm -f /tmp/http /tmp/http.err
      ;;
    vhost)
      split_vcheck "$args"
      if http_get "$hostport" "$path" "$vname"; then
        expect_code "$(head -n 1 /tmp/http | tr -d '\r' | cut -d ' ' -f 2)" "$(sed "1,/^$CR\$/d" /tmp/http | head -n 1)"
      else
        DETAIL="no response: $(cat /tmp/http.err)"
      fi
      rm -f /tmp/http /tmp/http.err
      ;;
    https)
      split_vcheck "$args"
      if timeout "$((TIMEOUT + 1))" cubenet-https-get "${hostport%:*}" "${hostport##*:}" "$vname" "$path" \
        /etc/cubenet-ca.pem >/tmp/http 2>/tmp/http.err; then
        expect_code "$(head -n 1 /tmp/http | cut -d ' ' -f 2)" "$(sed 1d /tmp/http | head -n 1)"
      else
        DETAIL="no response: $(cat /tmp/http.err)"
      fi
      rm -f /tmp/http /tmp/http.err
      ;;
    send)
      bytes=${args##*:}
      hostport=${args%:*}
      if out=$(head -c "$bytes" /dev/zero | timeout "$((TIMEOUT + 1))" nc -w "$TIMEOUT" "${hostport%:*}" "${hostport##*:}" 2>&1); then
        RESULT=PASS
      fi
      DETAIL=$(printf '%s\n' "$out" | head -n 1)
      ;;
    refused)
      out=$(timeout "$((TIMEOUT + 1))" nc -w "$TIMEOUT" "${args%:*}" "${args##*:}" </dev/null 2>&1)
      rc=$?
      case "$out" in
        *"Connection refused"*) RESULT=PASS DETAIL="connection refused" ;;
        *) DETAIL="not refused (exit $rc): $out" ;;
      esac
      ;;
    dns)
      name=${args%@*}
      server=${args##*@}
      out=$(timeout "$((TIMEOUT + 1))" nslookup -type=a "$name" "$server" 2>&1)
      rc=$?
      addr=$(printf '%s\n' "$out" | sed -n '/^Name:/,$ s/^Address: *\([0-9.]*\).*/\1/p' | head -n 1)
      if [ "$rc" -eq 0 ] && [ -n "$addr" ]; then RESULT=PASS DETAIL=$addr; else DETAIL="no answer (exit $rc): $out"; fi
      ;;
    *) DETAIL="unknown check kind '$kind'" ;;
  esac
  DETAIL=$(printf '%s' "$DETAIL" | tr '\r\n\t' '   ' | cut -c 1-200)
}

passed=0 failed=0
for c in $CHECKS; do
  t0=$(now_ms)
  run_check "$c"
  echo "CUBENET-CHECK $c $RESULT $(($(now_ms) - t0)) $DETAIL"
  if [ "$RESULT" = PASS ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
done
echo "CUBENET-DONE $passed $failed"

if [ -n "$SERVE" ]; then
  while :; do sleep 3600; done
fi
off
