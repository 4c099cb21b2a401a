//! A named background thread that runs a tick every interval until dropped: the loop of the
//! session reaper ([`crate::reaper::Reaper`]) and the DNS reaper
//! ([`crate::dns_reaper::DnsReaper`]). A plain thread, not a tokio task: ticks make blocking
//! map syscalls.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

/// The thread; stopped (within 20 ms, or one interval if shorter) and joined on drop.
#[derive(Debug)]
pub(crate) struct Periodic {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Periodic {
    /// Runs `tick` every `interval`, the first one `interval` after the start, on a thread
    /// named `name`. Panics only when the thread cannot be spawned.
    pub(crate) fn spawn(name: &str, interval: Duration, mut tick: impl FnMut() + Send + 'static) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let mut next = Instant::now() + interval;
                while !s.load(Ordering::Relaxed) {
                    if Instant::now() < next {
                        thread::sleep(Duration::from_millis(20).min(interval));
                        continue;
                    }
                    next = Instant::now() + interval;
                    tick();
                }
            })
            .unwrap_or_else(|e| panic!("spawn {name} thread: {e}"));
        Self { stop, thread: Some(thread) }
    }
}

impl Drop for Periodic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
