//! Per-sandbox mutual exclusion (`reference/upstream.md §2.1`: Ensure, Release and Reconcile
//! of one id never interleave) whose map holds an entry only while some call holds or waits
//! for that id's lock, so it does not grow with every id ever seen.
//!
//! Own code rather than a crate: keyed locks are a few lines over `Mutex` + `Condvar`, and the
//! crates that offer them keep entries until an explicit clean-up.

use std::{
    collections::HashMap,
    sync::{Condvar, Mutex},
};

use super::lock;

#[derive(Debug, Default)]
struct Entry {
    held: bool,
    waiters: usize,
}

/// The lock map.
#[derive(Debug, Default)]
pub struct SandboxLocks {
    map: Mutex<HashMap<String, Entry>>,
    freed: Condvar,
}

/// Holds the lock of one sandbox id until dropped.
#[derive(Debug)]
pub struct SandboxGuard<'a> {
    locks: &'a SandboxLocks,
    id: String,
}

impl SandboxLocks {
    /// Blocks until the lock of `id` is free, then holds it.
    pub fn lock(&self, id: &str) -> SandboxGuard<'_> {
        let mut m = lock(&self.map);
        loop {
            let e = m.entry(id.to_string()).or_default();
            if !e.held {
                e.held = true;
                return SandboxGuard { locks: self, id: id.to_string() };
            }
            e.waiters += 1;
            m = self.freed.wait(m).unwrap_or_else(|e| e.into_inner());
            // A waiter keeps the entry alive, so it is still there.
            if let Some(e) = m.get_mut(id) {
                e.waiters -= 1;
            }
        }
    }

    /// Entries in the map (ids locked or waited for).
    pub fn len(&self) -> usize {
        lock(&self.map).len()
    }
}

impl Drop for SandboxGuard<'_> {
    fn drop(&mut self) {
        let mut m = lock(&self.locks.map);
        let Some(e) = m.get_mut(&self.id) else { return };
        e.held = false;
        if e.waiters == 0 {
            m.remove(&self.id);
        } else {
            self.locks.freed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        },
        time::Duration,
    };

    use super::*;

    #[test]
    fn exclusive_per_id_and_empty_when_unused() {
        let locks = Arc::new(SandboxLocks::default());
        let inside = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let (l, inside) = (locks.clone(), inside.clone());
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        let _g = l.lock(["a", "b"][i % 2]);
                        assert_eq!(inside[i % 2].fetch_add(1, Ordering::SeqCst), 0, "two holders of one id");
                        std::thread::sleep(Duration::from_micros(50));
                        inside[i % 2].fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(locks.len(), 0);
        let g = locks.lock("x");
        let h = locks.lock("y");
        assert_eq!(locks.len(), 2);
        drop((g, h));
        assert_eq!(locks.len(), 0);
    }
}
