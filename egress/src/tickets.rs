//! TLS session-ticket keys: one ticketer shared by every leaf's server config, whose keys a
//! predecessor hands to its successor so that a client resumes across a swap (decision E23).
//!
//! rustls' own `Ticketer` keeps its keys private, so this is a [`ProducesTickets`] with keys we
//! hold: ChaCha20-Poly1305 (ring), a ticket is `key name (16 bytes) ‖ nonce (12 bytes, random)
//! ‖ ciphertext ‖ tag (16 bytes)`, the key name is the AEAD's associated data. Keys rotate as
//! rustls' `Ticketer` does: a new key every [`ROTATE`] (checked when a ticket is issued), the
//! previous one still decrypts for one more [`ROTATE`], tickets are announced with a lifetime of
//! [`ROTATE`]. At most two keys exist; the key bytes live in memory only (never logged: `Debug`
//! prints key names only; never written to disk).

use std::{
    sync::RwLock,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use ring::{
    aead::{self, Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey},
    rand::{SecureRandom, SystemRandom},
};
use rustls::server::ProducesTickets;

use crate::certs::hex;
use serde::{Deserialize, Serialize};

/// How long a key issues tickets (and the lifetime announced to clients); a key decrypts for
/// twice as long.
pub const ROTATE: Duration = Duration::from_secs(6 * 3600);
/// Bytes of a key name (the ticket's first bytes).
pub const NAME_LEN: usize = 16;
/// Bytes of a ChaCha20-Poly1305 key.
pub const KEY_LEN: usize = 32;
/// Most keys handed over or held (current and previous).
pub const MAX_KEYS: usize = 2;

/// One ticket key as handed to a successor: name and key as lower-case hex, creation time in
/// Unix seconds. `Debug` shows the name only.
#[derive(Clone, Serialize, Deserialize)]
pub struct TicketKeyMaterial {
    /// Key name, [`NAME_LEN`] bytes as hex.
    pub name: String,
    /// Key bytes, [`KEY_LEN`] bytes as hex.
    pub key: String,
    /// When the key was created, Unix seconds.
    pub created_unix: u64,
}

impl std::fmt::Debug for TicketKeyMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TicketKeyMaterial")
            .field("name", &self.name)
            .field("key", &"<redacted>")
            .field("created_unix", &self.created_unix)
            .finish()
    }
}

struct Key {
    name: [u8; NAME_LEN],
    raw: [u8; KEY_LEN],
    aead: LessSafeKey,
    created_unix: u64,
}

impl Key {
    fn new(name: [u8; NAME_LEN], raw: [u8; KEY_LEN], created_unix: u64) -> Key {
        let aead = LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, &raw).expect("32-byte ChaCha20 key"));
        Key { name, raw, aead, created_unix }
    }

    fn generate(rng: &SystemRandom, now: u64) -> Option<Key> {
        let (mut name, mut raw) = ([0u8; NAME_LEN], [0u8; KEY_LEN]);
        rng.fill(&mut name).ok()?;
        rng.fill(&mut raw).ok()?;
        Some(Key::new(name, raw, now))
    }

    fn age(&self, now: u64) -> u64 {
        now.saturating_sub(self.created_unix)
    }
}

struct Keys {
    current: Option<Key>,
    previous: Option<Key>,
}

/// The node's ticket keys (current and previous), shared by every leaf config of a process.
pub struct TicketKeys {
    keys: RwLock<Keys>,
    rng: SystemRandom,
}

impl std::fmt::Debug for TicketKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let k = self.keys.read().unwrap_or_else(|e| e.into_inner());
        let names: Vec<String> = [&k.current, &k.previous].into_iter().flatten().map(|k| hex(&k.name)).collect();
        f.debug_struct("TicketKeys").field("names", &names).finish_non_exhaustive()
    }
}

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs()
}

/// Exactly `N` bytes from hex; `None` otherwise.
fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    crate::certs::unhex(s)?.try_into().ok()
}

impl TicketKeys {
    /// Fresh keys (the first is generated when the first ticket is issued).
    pub fn new() -> TicketKeys {
        TicketKeys { keys: RwLock::new(Keys { current: None, previous: None }), rng: SystemRandom::new() }
    }

    /// Keys still able to decrypt, newest first, for a successor (at most [`MAX_KEYS`]). A
    /// current key is created first when there is none or it is due for rotation, so the
    /// predecessor (still draining) and its successor issue tickets under the same key.
    pub fn export(&self) -> Vec<TicketKeyMaterial> {
        let now = now_unix();
        self.ensure_current(now);
        let k = self.keys.read().unwrap_or_else(|e| e.into_inner());
        [&k.current, &k.previous]
            .into_iter()
            .flatten()
            .filter(|k| k.age(now) < 2 * ROTATE.as_secs())
            .map(|k| TicketKeyMaterial { name: hex(&k.name), key: hex(&k.raw), created_unix: k.created_unix })
            .collect()
    }

    /// Replaces the keys with a predecessor's (newest first, as [`Self::export`] gives them).
    /// Keys past their decrypt lifetime are dropped. Errors (the keys are left unchanged): more
    /// than [`MAX_KEYS`], a name or key of the wrong length or not hex, a creation time in the
    /// future by more than a minute (a clock step would otherwise keep a key forever).
    pub fn import(&self, material: &[TicketKeyMaterial]) -> Result<usize, String> {
        if material.len() > MAX_KEYS {
            return Err(format!("ticket_keys: {} keys, at most {MAX_KEYS}", material.len()));
        }
        let now = now_unix();
        let mut keys = Vec::new();
        for (i, m) in material.iter().enumerate() {
            let name =
                unhex::<NAME_LEN>(&m.name).ok_or_else(|| format!("ticket_keys[{i}].name: not {NAME_LEN} hex bytes"))?;
            let raw =
                unhex::<KEY_LEN>(&m.key).ok_or_else(|| format!("ticket_keys[{i}].key: not {KEY_LEN} hex bytes"))?;
            if m.created_unix > now + 60 {
                return Err(format!("ticket_keys[{i}].created_unix: in the future"));
            }
            let k = Key::new(name, raw, m.created_unix);
            if k.age(now) < 2 * ROTATE.as_secs() {
                keys.push(k);
            }
        }
        let n = keys.len();
        let mut it = keys.into_iter();
        let mut k = self.keys.write().unwrap_or_else(|e| e.into_inner());
        *k = Keys { current: it.next(), previous: it.next() };
        Ok(n)
    }

    /// Rotates when the current key is missing or older than [`ROTATE`].
    fn ensure_current(&self, now: u64) {
        let mut k = self.keys.write().unwrap_or_else(|e| e.into_inner());
        if k.current.as_ref().is_none_or(|c| c.age(now) >= ROTATE.as_secs())
            && let Some(fresh) = Key::generate(&self.rng, now)
        {
            k.previous = k.current.replace(fresh);
        }
    }

    fn seal(&self, key: &Key, plain: &[u8]) -> Option<Vec<u8>> {
        let mut nonce = [0u8; aead::NONCE_LEN];
        self.rng.fill(&mut nonce).ok()?;
        let mut out = Vec::with_capacity(NAME_LEN + nonce.len() + plain.len() + CHACHA20_POLY1305.tag_len());
        out.extend_from_slice(&key.name);
        out.extend_from_slice(&nonce);
        let mut body = plain.to_vec();
        key.aead.seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(&key.name), &mut body).ok()?;
        out.extend_from_slice(&body);
        Some(out)
    }
}

impl Default for TicketKeys {
    fn default() -> Self {
        TicketKeys::new()
    }
}

impl ProducesTickets for TicketKeys {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        ROTATE.as_secs() as u32
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        let now = now_unix();
        {
            let k = self.keys.read().unwrap_or_else(|e| e.into_inner());
            if let Some(cur) = &k.current
                && cur.age(now) < ROTATE.as_secs()
            {
                return self.seal(cur, plain);
            }
        }
        // Another issuer may have rotated meanwhile: `ensure_current` checks again.
        self.ensure_current(now);
        let k = self.keys.read().unwrap_or_else(|e| e.into_inner());
        self.seal(k.current.as_ref()?, plain)
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        let tag = CHACHA20_POLY1305.tag_len();
        if cipher.len() < NAME_LEN + aead::NONCE_LEN + tag {
            return None;
        }
        let (name, rest) = cipher.split_at(NAME_LEN);
        let (nonce, body) = rest.split_at(aead::NONCE_LEN);
        let now = now_unix();
        let k = self.keys.read().unwrap_or_else(|e| e.into_inner());
        let key = [&k.current, &k.previous]
            .into_iter()
            .flatten()
            .find(|k| k.name.as_slice() == name && k.age(now) < 2 * ROTATE.as_secs())?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buf = body.to_vec();
        let plain = key.aead.open_in_place(nonce, Aad::from(&key.name), &mut buf).ok()?;
        Some(plain.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ticket issued by one process opens in another that imported its keys, and nowhere
    /// else; a flipped bit, a truncated ticket or another key name opens nowhere.
    #[test]
    fn tickets_open_only_with_the_handed_keys() {
        let a = TicketKeys::new();
        let t = a.encrypt(b"session state").unwrap();
        assert_eq!(a.decrypt(&t).unwrap(), b"session state");
        let b = TicketKeys::new();
        assert!(b.decrypt(&t).is_none(), "fresh keys do not open another process's tickets");
        let m = a.export();
        assert_eq!(m.len(), 1);
        assert_eq!(b.import(&m).unwrap(), 1);
        assert_eq!(b.decrypt(&t).unwrap(), b"session state", "imported keys open the predecessor's ticket");
        assert_eq!(a.decrypt(&b.encrypt(b"x").unwrap()).unwrap(), b"x", "same current key both ways");
        for i in [0, NAME_LEN, NAME_LEN + aead::NONCE_LEN, t.len() - 1] {
            let mut bad = t.clone();
            bad[i] ^= 1;
            assert!(b.decrypt(&bad).is_none(), "bit {i} flipped");
        }
        assert!(b.decrypt(&t[..t.len() - 1]).is_none());
        assert!(b.decrypt(&[]).is_none());
        let dbg = format!("{:?} {:?}", b, m);
        assert!(!dbg.contains(&m[0].key), "key bytes in Debug output: {dbg}");
    }

    /// Rotation: an expired current key is replaced on the next issue, the previous one still
    /// opens its tickets; keys past twice the rotation are neither exported nor imported.
    #[test]
    fn rotation_and_bounds() {
        let a = TicketKeys::new();
        let old = a.encrypt(b"old").unwrap();
        let mut m = a.export();
        m[0].created_unix -= ROTATE.as_secs() + 1;
        a.import(&m).unwrap();
        let new = a.encrypt(b"new").unwrap();
        assert_ne!(old[..NAME_LEN], new[..NAME_LEN], "rotated");
        assert_eq!(a.decrypt(&old).unwrap(), b"old", "previous key still opens");
        assert_eq!(a.export().len(), 2);
        let mut stale = a.export();
        stale[1].created_unix -= 2 * ROTATE.as_secs();
        assert_eq!(a.import(&stale).unwrap(), 1, "expired key dropped");
        assert!(a.decrypt(&old).is_none());
        let three = vec![stale[0].clone(), stale[0].clone(), stale[0].clone()];
        assert!(a.import(&three).is_err());
        let mut short = stale[0].clone();
        short.key.pop();
        assert!(a.import(&[short]).unwrap_err().contains("ticket_keys[0].key"));
        let mut future = stale[0].clone();
        future.created_unix = now_unix() + 3600;
        assert!(a.import(&[future]).is_err());
    }
}
