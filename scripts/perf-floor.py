#!/usr/bin/env python3
"""Breaks the agent's CPU during the gRPC + fd floor rounds of `cubenet-bench agent-cpu` into parts.

Usage (docs/profile-ensure.md, "floor"):
    perf record -a -e cpu-clock -F 999 --call-graph dwarf,8192 -o f.data -- <agent-cpu runs>
    perf script -i f.data --comms network-agent,tokio-rt-worker,netns-exec \
        -F comm,pid,tid,time,ip,sym,dso | scripts/perf-floor.py

The floor rounds run last on each agent, so per agent process the window is from its last sample
inside the core (`Agent::ensure`/`Agent::release`) to its last sample in the fd server. Each
sample in a window is charged to the first matching part below (any frame of its call chain).
"""

import collections
import re
import sys

HEADER = re.compile(r"^(\S.*?)\s+(\d+)/(\d+)\s+(\d+\.\d+):")
CORE = re.compile(r"Agent::ensure|Agent::release|ensure_inner|release_inner")
FD = re.compile(r"fdserver")
PARTS = [
    ("upkeep between bursts (netns thread, TAP, maps, state file, HTTP poll)",
     r"NetnsHost|create_tap|Agent::warm|Agent::trim|tcx_|__sys_bpf|aya::|StateStore|"
     r"network_agent::http::|maintenance|netlink|rtnetlink"),
    ("fd server: JSON parse", r"serde_json"),
    ("fd server: accept, peer cred, read, lookup, sendmsg, metrics",
     r"fdserver|peer_allowed|unix_stream_sendmsg|unix_stream_recvmsg|unix_accept|peer_cred"),
    (":authority rewriter", r"uds_authority|loona_hpack"),
    ("h2 codec/streams (frames, HPACK, flow control)", r"h2::(codec|hpack|frame|proto)"),
    ("tonic/hyper/tower service path (routing, handler, Status, body)",
     r"tonic::|hyper::|hyper_util|tower::|network_agent::grpc|prost::"),
    ("tracing/logging", r"tracing_subscriber|tracing_core"),
    ("tokio scheduler/timer/I/O driver", r"tokio::|mio::|epoll"),
]
PARTS = [(name, re.compile(rx)) for name, rx in PARTS]
OTHER = "other (kernel/libc frames that do not unwind into the agent)"


def samples(lines):
    cur = []
    for line in lines:
        if not line.strip():
            if cur:
                yield cur
            cur = []
            continue
        cur.append(line.rstrip("\n"))
    if cur:
        yield cur


def main():
    kept = []
    window = {}
    for s in samples(sys.stdin):
        m = HEADER.match(s[0])
        if not m:
            continue
        pid, t = int(m.group(2)), float(m.group(4))
        chain = "\n".join(s[1:])
        w = window.setdefault(pid, [0.0, 0.0])
        if CORE.search(chain):
            w[0] = max(w[0], t)
        if FD.search(chain):
            w[1] = max(w[1], t)
        kept.append((pid, t, chain))
    counts = collections.Counter()
    total = 0
    for pid, t, chain in kept:
        start, end = window[pid]
        if not (start and end and start < t <= end):
            continue
        total += 1
        counts[next((name for name, rx in PARTS if rx.search(chain)), OTHER)] += 1
    if total == 0:
        sys.exit("no samples in a floor window")
    spans = {p: round(e - s, 3) for p, (s, e) in window.items() if s and e}
    print(f"{total} samples in the floor windows (seconds per agent pid: {spans})")
    for name, n in counts.most_common():
        print(f"{100.0 * n / total:5.1f} %  {name}")


if __name__ == "__main__":
    main()
