//! The TLS 1.2 session-ID cache: server-side session state that a client resuming by session
//! ID (no ticket extension: `openssl s_client -tls1_2 -no_ticket`, older Java/Go/OpenSSL
//! configurations) needs, shared by every leaf config of a process and handed to a successor
//! at a swap (decision E26).
//!
//! rustls' `ServerSessionMemoryCache` cannot be read out, so this is our own
//! [`StoresServerSessions`]: one process-wide ring of at most [`MAX_SESSIONS`] entries (the
//! oldest stored is evicted first, as rustls' own cache does), each at most [`MAX_VALUE_LEN`]
//! bytes, forgotten after [`LIFETIME`] (the session-ticket lifetime, E23). Every leaf config
//! sees it through a [`SessionView`] whose keys are prefixed with the leaf's cache key, so a
//! session made with one leaf never resumes with another one (as with rustls' per-config
//! caches before). Values hold the session's master secret: they live in memory only, never
//! logged (`Debug` prints counts and ages), never written to disk. TLS 1.3 never reaches this
//! store (the ticketer is enabled: rustls then issues stateless tickets only).

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use rustls::server::StoresServerSessions;
use serde::{Deserialize, Serialize};

use crate::certs::{hex, unhex};

/// Most sessions held (and handed over) per process.
pub const MAX_SESSIONS: usize = 4096;
/// Largest stored session value, bytes (rustls' encoded TLS 1.2 session without client
/// certificates is about 80 bytes plus the SNI and ALPN; larger ones are not stored).
pub const MAX_VALUE_LEN: usize = 1024;
/// Largest stored key, bytes: a leaf cache key (a DNS name of at most 253 bytes or
/// `ip:<addr>`), one separator byte and a session ID of at most 32 bytes.
pub const MAX_KEY_LEN: usize = 320;
/// How long a session resumes after it was made (as long as a session ticket, E23).
pub const LIFETIME: Duration = crate::tickets::ROTATE;

/// One session as handed to a successor: key and value as lower-case hex, age. `Debug` omits
/// the value (it holds the master secret).
#[derive(Clone, Serialize, Deserialize)]
pub struct SessionMaterial {
    /// Store key (leaf cache key, a zero byte, session ID), hex, at most [`MAX_KEY_LEN`] bytes.
    pub key: String,
    /// rustls' encoded session value, hex, at most [`MAX_VALUE_LEN`] bytes.
    pub value: String,
    /// Seconds since the session was stored.
    pub age_secs: u64,
}

impl std::fmt::Debug for SessionMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionMaterial").field("age_secs", &self.age_secs).finish_non_exhaustive()
    }
}

struct Entry {
    value: Vec<u8>,
    stored: Instant,
    seq: u64,
}

#[derive(Default)]
struct Inner {
    map: HashMap<Vec<u8>, Entry>,
    /// Insertion order; an item whose `seq` differs from its key's entry is stale (the key
    /// was stored again or taken) and skipped.
    order: VecDeque<(u64, Vec<u8>)>,
    seq: u64,
}

impl Inner {
    fn is_current(&self, seq: u64, key: &[u8]) -> bool {
        self.map.get(key).is_some_and(|e| e.seq == seq)
    }

    fn insert(&mut self, key: Vec<u8>, value: Vec<u8>, stored: Instant) {
        self.seq += 1;
        let seq = self.seq;
        self.order.push_back((seq, key.clone()));
        self.map.insert(key, Entry { value, stored, seq });
        while self.map.len() > MAX_SESSIONS {
            let Some((s, k)) = self.order.pop_front() else { break };
            if self.is_current(s, &k) {
                self.map.remove(&k);
            }
        }
        if self.order.len() > 2 * MAX_SESSIONS {
            let mut order = std::mem::take(&mut self.order);
            order.retain(|(s, k)| self.is_current(*s, k));
            self.order = order;
        }
    }
}

/// The process's TLS 1.2 sessions, shared by every leaf config (through [`SessionView`]s).
#[derive(Default)]
pub struct SessionStore {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for SessionStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionStore").field("len", &self.len()).finish_non_exhaustive()
    }
}

impl SessionStore {
    /// An empty store.
    pub fn new() -> SessionStore {
        SessionStore::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sessions held (expired ones included until they are evicted or looked up).
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether no session is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The view of one leaf config: keys are prefixed with `scope` (the leaf's cache key).
    pub fn view(self: &Arc<Self>, scope: &str) -> Arc<SessionView> {
        let mut prefix = scope.as_bytes().to_vec();
        prefix.push(0);
        Arc::new(SessionView { store: self.clone(), prefix })
    }

    /// The (at most `max`) most recently stored live sessions, newest first, for a successor.
    pub fn export(&self, max: usize) -> Vec<SessionMaterial> {
        let inner = self.lock();
        inner
            .order
            .iter()
            .rev()
            .filter_map(|(s, k)| inner.map.get(k).filter(|e| e.seq == *s).map(|e| (k, e)))
            .filter(|(_, e)| e.stored.elapsed() < LIFETIME)
            .take(max)
            .map(|(k, e)| SessionMaterial { key: hex(k), value: hex(&e.value), age_secs: e.stored.elapsed().as_secs() })
            .collect()
    }

    /// Adds a predecessor's sessions (newest first, as [`Self::export`] gives them; at most
    /// [`MAX_SESSIONS`] are read) keeping their ages, so the oldest is still evicted first.
    /// Skipped: malformed hex, a key or value over its bound or empty, a session past
    /// [`LIFETIME`]. Returns how many were stored and how many skipped.
    pub fn import(&self, sessions: &[SessionMaterial]) -> (usize, usize) {
        let now = Instant::now();
        let (mut stored, mut skipped) = (0, 0);
        let mut inner = self.lock();
        for m in sessions.iter().take(MAX_SESSIONS).rev() {
            let age = Duration::from_secs(m.age_secs);
            let ok = (age < LIFETIME)
                .then(|| Some((unhex(&m.key)?, unhex(&m.value)?, now.checked_sub(age)?)))
                .flatten()
                .filter(|(k, v, _)| fits(k, v));
            match ok {
                Some((k, v, at)) => {
                    inner.insert(k, v, at);
                    stored += 1;
                }
                None => skipped += 1,
            }
        }
        (stored, skipped)
    }

    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> bool {
        if !fits(&key, &value) {
            return false;
        }
        self.lock().insert(key, value, Instant::now());
        true
    }

    fn get(&self, key: &[u8], remove: bool) -> Option<Vec<u8>> {
        let mut inner = self.lock();
        let fresh = inner.map.get(key)?.stored.elapsed() < LIFETIME;
        if remove || !fresh {
            let e = inner.map.remove(key)?;
            return fresh.then_some(e.value);
        }
        inner.map.get(key).map(|e| e.value.clone())
    }
}

fn fits(key: &[u8], value: &[u8]) -> bool {
    !key.is_empty() && key.len() <= MAX_KEY_LEN && !value.is_empty() && value.len() <= MAX_VALUE_LEN
}

/// One leaf config's window on the [`SessionStore`] (rustls' `session_storage`).
pub struct SessionView {
    store: Arc<SessionStore>,
    prefix: Vec<u8>,
}

impl std::fmt::Debug for SessionView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionView").field("scope", &String::from_utf8_lossy(&self.prefix)).finish_non_exhaustive()
    }
}

impl SessionView {
    fn key(&self, id: &[u8]) -> Vec<u8> {
        [self.prefix.as_slice(), id].concat()
    }
}

impl StoresServerSessions for SessionView {
    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> bool {
        self.store.put(self.key(&key), value)
    }

    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.store.get(&self.key(key), false)
    }

    fn take(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.store.get(&self.key(key), true)
    }

    fn can_cache(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Views do not see each other's sessions; the ring keeps the newest [`MAX_SESSIONS`];
    /// bounds are enforced on put; `take` removes.
    #[test]
    fn views_ring_and_bounds() {
        let s = Arc::new(SessionStore::new());
        let (a, b) = (s.view("a.example.test"), s.view("b.example.test"));
        assert!(a.put(b"id1".to_vec(), b"secret-a".to_vec()));
        assert_eq!(a.get(b"id1").as_deref(), Some(&b"secret-a"[..]));
        assert!(b.get(b"id1").is_none(), "another leaf's session does not resume");
        assert!(!a.put(b"big".to_vec(), vec![1; MAX_VALUE_LEN + 1]));
        assert!(!a.put(vec![1; MAX_KEY_LEN], b"v".to_vec()), "key over the bound with the prefix");
        assert_eq!(a.take(b"id1").as_deref(), Some(&b"secret-a"[..]));
        assert!(a.get(b"id1").is_none());
        for i in 0..MAX_SESSIONS + 10 {
            assert!(b.put(format!("{i}").into_bytes(), b"v".to_vec()));
        }
        // The same key stored again does not count twice.
        assert!(b.put(b"4000".to_vec(), b"w".to_vec()));
        assert_eq!(s.len(), MAX_SESSIONS);
        assert!(b.get(b"0").is_none() && b.get(b"9").is_none(), "oldest evicted first");
        assert!(b.get(b"10").is_some() && b.get(b"4105").is_some());
        assert!(s.lock().order.len() <= 2 * MAX_SESSIONS + 1);
        assert_eq!(s.export(3).len(), 3);
        assert_eq!(s.export(usize::MAX).len(), MAX_SESSIONS);
    }

    /// Export → import keeps keys, values and order (the newest stays newest); bad entries
    /// and expired ones are skipped; `Debug` never shows a value.
    #[test]
    fn export_import_round_trip() {
        let s = Arc::new(SessionStore::new());
        let v = s.view("api.example.test");
        v.put(b"old".to_vec(), b"master-secret-old".to_vec());
        v.put(b"new".to_vec(), b"master-secret-new".to_vec());
        let m = s.export(10);
        assert_eq!(m.len(), 2);
        assert_eq!(unhex(&m[0].value).unwrap(), b"master-secret-new", "newest first");
        let dbg = format!("{m:?} {s:?}");
        assert!(!dbg.contains(&m[0].value) && !dbg.contains("master"), "{dbg}");
        let t = Arc::new(SessionStore::new());
        let mut bad = m.clone();
        bad.push(SessionMaterial { key: "zz".into(), value: "00".into(), age_secs: 0 });
        bad.push(SessionMaterial { key: hex(b"k"), value: hex(b"v"), age_secs: LIFETIME.as_secs() });
        bad.push(SessionMaterial { key: hex(b"k"), value: String::new(), age_secs: 0 });
        assert_eq!(t.import(&bad), (2, 3));
        let w = t.view("api.example.test");
        assert_eq!(w.get(b"old").as_deref(), Some(&b"master-secret-old"[..]));
        assert!(t.view("other.test").get(b"old").is_none());
        let again = t.export(10);
        assert_eq!(again.iter().map(|x| &x.key).collect::<Vec<_>>(), m.iter().map(|x| &x.key).collect::<Vec<_>>());
    }
}
