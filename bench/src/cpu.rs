//! CPU time between two snapshots, for the CPU cost of a connection (decision V8): this
//! process's own time (`getrusage(RUSAGE_SELF)`: every thread, the client and server threads of
//! a benchmark included, with the softirq work the kernel ran in their context, since this
//! kernel charges softirq ticks to the interrupted task), plus the `ksoftirqd/N` threads (the
//! softirq work deferred out of that context), plus the share of all CPUs that was busy
//! machine-wide (`/proc/stat`, which also sees other processes: context, not the cost).

/// One reading of the counters.
pub struct Snapshot {
    own_user_us: u64,
    own_sys_us: u64,
    ksoftirqd_ticks: u64,
    busy_ticks: u64,
    all_ticks: u64,
}

/// CPU used between two snapshots.
#[derive(Clone, Copy, Debug)]
pub struct Usage {
    /// This process in user space, seconds.
    pub user_s: f64,
    /// This process in the kernel (system calls and softirqs run in its context), seconds.
    pub sys_s: f64,
    /// The `ksoftirqd/N` threads, seconds (clock-tick resolution).
    pub ksoftirqd_s: f64,
    /// Busy share of all CPUs machine-wide, 0..=1 (every process, not only this one).
    pub machine_busy: f64,
}

impl Usage {
    /// Everything charged to the benchmark: own user + kernel time + ksoftirqd, seconds.
    pub fn total_s(&self) -> f64 {
        self.user_s + self.sys_s + self.ksoftirqd_s
    }
}

fn tv_us(t: libc::timeval) -> u64 {
    t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64
}

/// `utime + stime` (clock ticks) of every `ksoftirqd/N` thread.
fn ksoftirqd_ticks() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    let mut sum = 0;
    for e in dir.flatten() {
        let p = e.path();
        let is_ksoftirqd =
            std::fs::read_to_string(p.join("comm")).map(|c| c.starts_with("ksoftirqd/")).unwrap_or(false);
        if !is_ksoftirqd {
            continue;
        }
        if let Ok(stat) = std::fs::read_to_string(p.join("stat")) {
            // Fields after the parenthesised comm: state is field 3, utime 14, stime 15.
            let rest = stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or("");
            let f: Vec<&str> = rest.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            sum += num(11) + num(12);
        }
    }
    sum
}

/// (busy, all) clock ticks of the aggregate `cpu` line of `/proc/stat`.
fn machine_ticks() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = s.lines().find(|l| l.starts_with("cpu ")) else { return (0, 0) };
    let v: Vec<u64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    let get = |i: usize| v.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let busy = get(0) + get(1) + get(2) + get(5) + get(6) + get(7);
    (busy, busy + get(3) + get(4))
}

/// Reads the counters now.
pub fn snapshot() -> Snapshot {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let (busy_ticks, all_ticks) = machine_ticks();
    Snapshot {
        own_user_us: tv_us(ru.ru_utime),
        own_sys_us: tv_us(ru.ru_stime),
        ksoftirqd_ticks: ksoftirqd_ticks(),
        busy_ticks,
        all_ticks,
    }
}

/// CPU used from `a` to `b`.
pub fn between(a: &Snapshot, b: &Snapshot) -> Usage {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let all = b.all_ticks.saturating_sub(a.all_ticks);
    Usage {
        user_s: b.own_user_us.saturating_sub(a.own_user_us) as f64 / 1e6,
        sys_s: b.own_sys_us.saturating_sub(a.own_sys_us) as f64 / 1e6,
        ksoftirqd_s: b.ksoftirqd_ticks.saturating_sub(a.ksoftirqd_ticks) as f64 / hz,
        machine_busy: if all == 0 { 0.0 } else { b.busy_ticks.saturating_sub(a.busy_ticks) as f64 / all as f64 },
    }
}
