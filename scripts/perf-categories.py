#!/usr/bin/env python3
"""Breaks a `perf script` dump of the network-agent into CPU categories (docs/profile-ensure.md).

Usage: perf script -i agent.data -F comm,tid,ip,sym,dso | scripts/perf-categories.py

Each sample is charged to one category: allocation and lock frames at the leaf win (what the CPU
was doing), then the first work frame from the leaf outwards (what it was doing it for), then the
runtime (gRPC stack, tokio), else "kernel/other". Prints % of samples per category and the top
leaf symbols of the largest ones.
"""

import collections
import re
import sys

# (category, regex on a frame's symbol or dso). Checked in this order for each frame, leaf first.
LEAF = [
    ("allocation (malloc/free)", re.compile(r"^(__libc_)?(malloc|free|realloc|calloc|cfree)\b|_int_malloc|_int_free|"
                                            r"malloc_consolidate|__rust_(alloc|dealloc|realloc)|alloc::raw_vec|"
                                            r"RawVec.*grow|unlink_chunk|sysmalloc|tcache")),
    ("locks (futex, mutexes)", re.compile(r"futex|std::sys::sync::mutex|parking_lot|pthread_mutex|"
                                          r"std::sync::poison|lock_contended|RawMutex")),
]
WORK = [
    ("state file (write, fsync, rename)", re.compile(r"StateStore|state::StateStore|serde_json::ser|"
                                                     r"do_renameat2|vfs_rename|shmem_|do_sys_openat2.*")),
    ("fd handoff (fd socket)", re.compile(r"fdserver|tap_fd|scm_send|unix_stream_sendmsg|__sys_sendmsg|"
                                          r"unix_stream_recvmsg|reopen_tap")),
    ("bpf map syscalls", re.compile(r"__sys_bpf|bpf_map_|map_update_elem|map_delete_elem|map_lookup_elem|"
                                    r"trie_(update|delete|lookup)|htab_|aya::maps|aya::sys|cubevs::policy|"
                                    r"cubevs::sandbox|cubevs::ports|cubevs::sandbox_stats|generic_map_")),
    ("HTTP listener (the bench's pool polling)", re.compile(r"network_agent::http::")),
    ("TAP creation/deletion (pool refill, trim)", re.compile(r"create_tap|Agent::warm|Agent::trim|delete_tap|"
                                                              r"tun_|attach_sandbox|detach_sandbox|tcx_|"
                                                              r"synchronize_rcu|NetnsHost")),
    ("netlink", re.compile(r"netlink|rtnetlink|rtnl_")),
    ("tracing/logging", re.compile(r"tracing_subscriber|tracing_core|tracing::|fmt::Write|"
                                   r"core::fmt::write|<.* as core::fmt::Display>")),
    ("metrics (prometheus)", re.compile(r"prometheus")),
    ("agent logic", re.compile(r"network_agent::agent|network_agent::grpc|network_agent::ports")),
]
RUNTIME = [
    ("gRPC (tonic/h2/hyper/prost, :authority rewrite)", re.compile(r"tonic::|h2::|hyper::|prost::|http_body|"
                                                                   r"tower::|hyper_util|loona_hpack|uds_authority")),
    ("tokio (scheduler, I/O driver, blocking pool)", re.compile(r"tokio::|mio::|epoll|std::thread|clone3|"
                                                                 r"start_thread")),
]


def categorize(frames, comm=""):
    """frames: list of symbols, leaf first; comm: the thread's name."""
    # The namespace threads only run netlink, ioctls and sysctl writes for TAP creation,
    # deletion and the free check's reopen (the pool upkeep), never the Ensure path.
    if comm.startswith("netns-exec"):
        for f in frames:
            for cat, rx in WORK[:1]:
                if rx.search(f):
                    return cat
        return "namespace thread: TAP create/delete, free-check reopen (pool upkeep)"
    if frames:
        for cat, rx in LEAF:
            if rx.search(frames[0]):
                return cat
        # A lock or allocator a few frames down (glibc internals in between).
        for f in frames[:4]:
            for cat, rx in LEAF:
                if rx.search(f):
                    return cat
    for f in frames:
        for cat, rx in WORK:
            if rx.search(f):
                return cat
    for f in frames:
        for cat, rx in RUNTIME:
            if rx.search(f):
                return cat
    return "kernel/other (scheduler, syscall entry, idle paths)"


def samples(lines):
    cur = None
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            if cur is not None:
                yield cur
            cur = None
            continue
        if cur is None:
            cur = [line.split()[0]]  # header line: comm tid ...
            continue
        parts = line.strip().split(None, 1)
        sym = parts[1] if len(parts) > 1 else parts[0]
        cur.append(sym)
    if cur is not None:
        yield cur


def main():
    counts = collections.Counter()
    leaves = collections.defaultdict(collections.Counter)
    total = 0
    for sample in samples(sys.stdin):
        comm, frames = sample[0], sample[1:]
        cat = categorize(frames, comm)
        counts[cat] += 1
        leaves[cat][re.sub(r"\+0x[0-9a-f]+", "", frames[0] if frames else "?")[:90]] += 1
        total += 1
    if total == 0:
        sys.exit("no samples")
    print(f"{total} samples")
    for cat, n in counts.most_common():
        print(f"{100.0 * n / total:5.1f} %  {cat}")
    print()
    for cat, _ in counts.most_common(6):
        print(f"top leaves of {cat}:")
        for sym, n in leaves[cat].most_common(6):
            print(f"    {100.0 * n / total:5.1f} %  {sym}")


if __name__ == "__main__":
    main()
