//! The interception CA, leaf minting (`reference/upstream.md §4.6`) and the upstream trust store.
//!
//! Leaves are minted only after the policy admitted the SNI (anchors D.17), cached per name,
//! minted once per name under concurrency (single flight), and rate-limited per sandbox.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr},
    path::Path,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    SanType, SerialNumber,
};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, pem::PemObject};

use crate::{metrics::Metrics, sessions::SessionStore, tickets::TicketKeys};

/// CA certificate file name inside the CA directory.
pub const CA_CERT_FILE: &str = "cube-root-ca.crt";
/// CA key file name inside the CA directory.
pub const CA_KEY_FILE: &str = "cube-root-ca.key";
/// Leaf validity (7 days) and how long a cached leaf is reused (6 days).
pub const LEAF_VALIDITY: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long a minted leaf stays in the cache.
pub const LEAF_CACHE_TTL: Duration = Duration::from_secs(6 * 24 * 3600);
/// A CA expiring sooner than this logs a warning at start.
pub const CA_WARN_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);

/// The ring crypto provider every TLS config uses.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The interception CA: signs leaves.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert_der: CertificateDer<'static>,
    /// Seconds until the CA expires (negative when expired) at load time.
    pub expires_in_secs: i64,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").field("expires_in_secs", &self.expires_in_secs).finish_non_exhaustive()
    }
}

impl Ca {
    /// Loads `cube-root-ca.{crt,key}` from `dir`. Errors: unreadable/unparsable files, a key
    /// that does not match the certificate, a certificate that is not a CA, or an expired CA.
    /// Logs a warning when it expires within 30 days.
    pub fn load(dir: &Path) -> anyhow::Result<Ca> {
        let cert_path = dir.join(CA_CERT_FILE);
        let key_path = dir.join(CA_KEY_FILE);
        // A missing CA is the first thing a new operator hits: say what belongs there (O9).
        const WHAT: &str = "ca_dir (--ca-dir, CUBE_EGRESS_CA_DIR) must hold the interception CA as \
                            cube-root-ca.crt + cube-root-ca.key (PEM; README CubeEgress \"TLS\")";
        if !cert_path.exists() {
            bail!("CA certificate {} not found: {WHAT}", cert_path.display());
        }
        if !key_path.exists() {
            bail!("CA key {} not found: {WHAT}", key_path.display());
        }
        let cert_der = CertificateDer::from_pem_file(&cert_path)
            .with_context(|| format!("read CA certificate {}", cert_path.display()))?;
        let key_pem = std::fs::read(&key_path).with_context(|| format!("read CA key {}", key_path.display()))?;
        let key = key_pair_from_pem(&key_pem).with_context(|| format!("parse CA key {}", key_path.display()))?;
        let (_, x509) = x509_parser::parse_x509_certificate(&cert_der)
            .map_err(|e| anyhow::anyhow!("parse CA certificate {}: {e}", cert_path.display()))?;
        if x509.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            bail!("CA key {} does not match certificate {}", key_path.display(), cert_path.display());
        }
        if !x509.is_ca() {
            bail!("{} is not a CA certificate (basicConstraints CA:TRUE missing)", cert_path.display());
        }
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let expires_in_secs = x509.validity().not_after.timestamp() - now;
        if expires_in_secs <= 0 {
            bail!("CA certificate {} expired {} s ago", cert_path.display(), -expires_in_secs);
        }
        if expires_in_secs < CA_WARN_BEFORE.as_secs() as i64 {
            tracing::warn!(days = expires_in_secs / 86400, "CA certificate expires soon");
        }
        let subject = x509.subject().to_string();
        let not_after = x509.validity().not_after.to_string();
        let issuer = Issuer::from_ca_cert_der(&cert_der, key).context("use CA certificate as issuer")?;
        let ca = Ca { issuer, cert_der, expires_in_secs };
        // Which CA this process signs with: compare with `openssl x509 -noout -fingerprint
        // -sha256 -in cube-root-ca.crt` after a rotation (decision O8).
        tracing::info!(sha256 = %ca.fingerprint_sha256(), %subject, %not_after, path = %cert_path.display(), "CA loaded");
        Ok(ca)
    }

    /// SHA-256 of the CA certificate's DER as `openssl x509 -fingerprint -sha256` prints it:
    /// upper-case hex bytes joined by `:`.
    pub fn fingerprint_sha256(&self) -> String {
        use sha2::Digest;
        sha2::Sha256::digest(self.cert_der.as_ref()).iter().map(|b| format!("{b:02X}")).collect::<Vec<_>>().join(":")
    }

    /// The CA certificate (DER).
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// Mints a leaf for `name`: new EC P-256 key, serial from time + random, notBefore now−60 s,
    /// notAfter now+7 d, CN = the name, SAN = DNS name or IP, CA:FALSE, digitalSignature +
    /// keyEncipherment, EKU serverAuth. Returns (chain [leaf, CA], key).
    pub fn mint(&self, name: &CertName) -> anyhow::Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        let cn = match name {
            CertName::Dns(n) => n.clone(),
            CertName::Ip(ip) => ip.to_string(),
        };
        dn.push(DnType::CommonName, cn);
        p.distinguished_name = dn;
        p.subject_alt_names = vec![match name {
            CertName::Dns(n) => SanType::DnsName(n.clone().try_into().context("SNI is not a valid DNS name")?),
            CertName::Ip(ip) => SanType::IpAddress(*ip),
        }];
        let now = time::OffsetDateTime::now_utc();
        p.not_before = now - time::Duration::seconds(60);
        p.not_after = now + LEAF_VALIDITY;
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let mut serial = (now.unix_timestamp_nanos() / 1000).to_be_bytes()[8..].to_vec();
        let mut rnd = [0u8; 8];
        rustls::crypto::ring::default_provider()
            .secure_random
            .fill(&mut rnd)
            .map_err(|_| anyhow::anyhow!("random serial"))?;
        serial.extend_from_slice(&rnd);
        serial[0] &= 0x7f;
        p.serial_number = Some(SerialNumber::from_slice(&serial));
        let cert = p.signed_by(&key, &self.issuer)?;
        let chain = vec![cert.der().clone(), self.cert_der.clone()];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        Ok((chain, key))
    }
}

/// Reads a private key from PEM: PKCS#8 (`PRIVATE KEY`), SEC1 EC (`EC PRIVATE KEY`, what
/// `openssl ecparam -genkey` writes; its `EC PARAMETERS` block is skipped) or PKCS#1 RSA
/// (`RSA PRIVATE KEY`, `openssl genrsa -traditional`, Helm's `genCA`); the first key block
/// wins. rcgen's ring backend only takes PKCS#8, so SEC1 and PKCS#1 keys are wrapped into a
/// PKCS#8 `PrivateKeyInfo` (RFC 5208/5915) with yasna, the DER codec rcgen itself uses.
/// Errors: no unencrypted key block, a SEC1 key without its named curve, a curve or key size
/// ring does not support (P-256, P-384, RSA 2048–8192).
pub fn key_pair_from_pem(pem: &[u8]) -> anyhow::Result<KeyPair> {
    let key = PrivateKeyDer::from_pem_slice(pem)
        .map_err(|e| anyhow::anyhow!("no unencrypted PRIVATE KEY, EC PRIVATE KEY or RSA PRIVATE KEY block ({e})"))?;
    let pkcs8 = match &key {
        PrivateKeyDer::Pkcs8(k) => k.secret_pkcs8_der().to_vec(),
        PrivateKeyDer::Sec1(k) => {
            let curve = sec1_named_curve(k.secret_sec1_der())?;
            wrap_pkcs8(&[1, 2, 840, 10045, 2, 1], Some(&curve), k.secret_sec1_der())
        }
        PrivateKeyDer::Pkcs1(k) => wrap_pkcs8(&[1, 2, 840, 113549, 1, 1, 1], None, k.secret_pkcs1_der()),
        _ => bail!("unsupported private key type"),
    };
    KeyPair::try_from(pkcs8).map_err(|e| anyhow::anyhow!("unsupported key (P-256, P-384 or RSA 2048+): {e}"))
}

/// The named-curve OID of a SEC1 `ECPrivateKey` (its `[0] parameters`).
fn sec1_named_curve(der: &[u8]) -> anyhow::Result<yasna::models::ObjectIdentifier> {
    let curve = yasna::parse_der(der, |r| {
        r.read_sequence(|r| {
            r.next().read_u8()?;
            r.next().read_bytes()?;
            let curve = r.read_optional(|r| r.read_tagged(yasna::Tag::context(0), |r| r.read_oid()))?;
            r.read_optional(|r| r.read_tagged(yasna::Tag::context(1), |r| r.read_bitvec_bytes()))?;
            Ok(curve)
        })
    })
    .map_err(|e| anyhow::anyhow!("malformed EC PRIVATE KEY: {e}"))?;
    curve.context("EC PRIVATE KEY without a named curve")
}

/// `PrivateKeyInfo { version 0, AlgorithmIdentifier { alg, params (OID or NULL) }, OCTET STRING inner }`.
fn wrap_pkcs8(alg: &[u64], params: Option<&yasna::models::ObjectIdentifier>, inner: &[u8]) -> Vec<u8> {
    yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_u8(0);
            w.next().write_sequence(|w| {
                w.next().write_oid(&yasna::models::ObjectIdentifier::from_slice(alg));
                match params {
                    Some(oid) => w.next().write_oid(oid),
                    None => w.next().write_null(),
                }
            });
            w.next().write_bytes(inner);
        })
    })
}

/// What a leaf is minted for: the client's SNI, or the original destination IP without SNI.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CertName {
    /// Lower-case SNI host name.
    Dns(String),
    /// Destination IP (no SNI sent).
    Ip(IpAddr),
}

impl CertName {
    /// The name's part of a cache key: the host name, or `ip:<addr>`.
    fn name_key(&self) -> String {
        match self {
            CertName::Dns(n) => n.clone(),
            CertName::Ip(ip) => format!("ip:{ip}"),
        }
    }

    /// The cache key of this name's leaf for `sandbox`: `<sandbox>/<name key>` (decision R81:
    /// every sandbox has its own leaves, so a leaf never tells one sandbox that, or when,
    /// another one reached the name).
    fn cache_key(&self, sandbox: Ipv4Addr) -> String {
        format!("{sandbox}/{}", self.name_key())
    }
}

/// The sandbox and name of a cache key (`<sandbox>/ip:<addr>` or `<sandbox>/<host name>`);
/// `None` for anything else, such as the unscoped keys (`api.x`, `ip:<addr>`) of a
/// predecessor before R81, whose leaves are minted again on demand.
fn name_of_key(k: &str) -> Option<(Ipv4Addr, CertName)> {
    let (sandbox, name) = k.split_once('/')?;
    let sandbox: Ipv4Addr = sandbox.parse().ok()?;
    let name = match name.strip_prefix("ip:") {
        Some(ip) => ip.parse().ok().map(CertName::Ip),
        None => crate::dest::normalize_dns_name(name).filter(|n| n == name).map(CertName::Dns),
    }?;
    Some((sandbox, name))
}

/// Why no certificate could be produced.
#[derive(Debug, thiserror::Error)]
pub enum MintError {
    /// The sandbox exceeded its mint budget.
    #[error("mint rate limit exceeded")]
    RateLimited,
    /// Signing failed.
    #[error("cert_signer_failed:{0}")]
    Failed(String),
}

/// A minted (or handed-over) leaf: its server config and what built it (for a successor, E25).
struct Minted {
    cfg: Arc<ServerConfig>,
    leaf: CertificateDer<'static>,
    key: PrivatePkcs8KeyDer<'static>,
}

struct Slot {
    cell: Arc<tokio::sync::OnceCell<Arc<Minted>>>,
    created: Instant,
    /// The sandbox whose handshake made the slot (`None`: handed over or pre-minted); a full
    /// cache evicts the inserting sandbox's own oldest slot first (R62).
    owner: Option<Ipv4Addr>,
}

/// One cached leaf as handed to a successor (E25): cache key, leaf certificate and its PKCS#8
/// key (DER, lower-case hex), age. `Debug` omits the key.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct LeafMaterial {
    /// Cache key: `<sandbox>/<SNI name>` or `<sandbox>/ip:<addr>` (R81; a key without the
    /// sandbox, from a predecessor before R81, is skipped).
    pub name: String,
    /// Leaf certificate, DER as hex (the chain's CA is the successor's own).
    pub cert: String,
    /// Leaf private key, PKCS#8 DER as hex.
    pub key: String,
    /// Seconds since the predecessor minted it.
    pub age_secs: u64,
}

impl std::fmt::Debug for LeafMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeafMaterial")
            .field("name", &self.name)
            .field("age_secs", &self.age_secs)
            .finish_non_exhaustive()
    }
}

/// Lower-case hex of `b`.
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Bytes from hex (`None` for odd length or a non-hex digit).
pub(crate) fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}

/// The leaf server config: `chain` and `key`, ALPN `h2`, `http/1.1`, the shared ticket keys and
/// the shared TLS 1.2 session store seen under the leaf's cache key `scope` (E26).
fn leaf_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    tickets: Arc<TicketKeys>,
    sessions: &Arc<SessionStore>,
    scope: &str,
) -> anyhow::Result<ServerConfig> {
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    cfg.ticketer = tickets;
    cfg.session_storage = sessions.view(scope);
    Ok(cfg)
}

/// Token bucket per sandbox IP (our own: a dozen lines, no crate needed).
#[derive(Debug)]
pub(crate) struct RateLimiter {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<Ipv4Addr, (f64, Instant)>>,
}

impl RateLimiter {
    /// `burst` tokens per sandbox, refilled at `rate` per second.
    pub(crate) fn new(rate: f64, burst: u32) -> RateLimiter {
        RateLimiter { rate, burst: f64::from(burst), buckets: Mutex::new(HashMap::new()) }
    }

    /// Forgets `who`'s bucket: its next take starts from a full burst (the address's next
    /// sandbox never inherits what its predecessor spent, R86).
    pub(crate) fn forget(&self, who: Ipv4Addr) {
        self.buckets.lock().expect("limiter lock").remove(&who);
    }

    /// Takes one token of `who`; false when none is left.
    pub(crate) fn take(&self, who: Ipv4Addr) -> bool {
        let now = Instant::now();
        let mut b = self.buckets.lock().expect("limiter lock");
        let (tokens, last) = b.entry(who).or_insert((self.burst, now));
        *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * self.rate).min(self.burst);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Leaf cache with single-flight minting and a per-sandbox mint rate limit; hands out ready
/// rustls server configs (ALPN `h2`, `http/1.1`).
pub struct CertCache {
    ca: Arc<Ca>,
    slots: Mutex<HashMap<String, Slot>>,
    capacity: usize,
    limiter: RateLimiter,
    metrics: Metrics,
    tickets: Arc<TicketKeys>,
    sessions: Arc<SessionStore>,
}

impl CertCache {
    /// A cache of at most `capacity` leaves; each sandbox may mint `burst` leaves at once and
    /// `rate` per second after that.
    pub fn new(ca: Arc<Ca>, capacity: usize, rate: f64, burst: u32, metrics: Metrics) -> CertCache {
        CertCache {
            ca,
            slots: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
            limiter: RateLimiter::new(rate, burst),
            metrics,
            tickets: Arc::new(TicketKeys::new()),
            sessions: Arc::new(SessionStore::new()),
        }
    }

    /// The session-ticket keys every leaf config of this cache uses (E23).
    pub fn tickets(&self) -> &TicketKeys {
        &self.tickets
    }

    /// The TLS 1.2 session-ID cache every leaf config of this cache uses (E26).
    pub fn sessions(&self) -> &SessionStore {
        &self.sessions
    }

    /// The server config for `name` as served to `sandbox`, minting it if needed (charged to
    /// `sandbox`). Leaves are cached per (sandbox, name) (R81): another sandbox's leaf for the
    /// same name is never served, so a handshake costs a sandbox the same whether or not some
    /// other sandbox reached the name before.
    ///
    /// A name not cached costs `sandbox` one token of its mint budget before anything in the
    /// cache changes, so a sandbox over its budget evicts nothing (R62: before, each refused
    /// handshake still inserted an empty slot and evicted an arbitrary leaf, so one sandbox
    /// cycling SNIs under a wildcard rule emptied the cache and every other sandbox had to
    /// mint again, within its own small budget, for each connection). A full cache drops an
    /// expired slot, else the inserting sandbox's own oldest, else the oldest of all.
    pub async fn server_config(&self, sandbox: Ipv4Addr, name: CertName) -> Result<Arc<ServerConfig>, MintError> {
        let key = name.cache_key(sandbox);
        let (cell, charged) = {
            let mut slots = self.slots.lock().expect("cache lock");
            let fresh = slots.get(&key).is_some_and(|s| s.created.elapsed() < LEAF_CACHE_TTL);
            if fresh {
                (slots.get(&key).expect("fresh slot").cell.clone(), false)
            } else {
                if !self.limiter.take(sandbox) {
                    self.metrics.mint_rate_limited.inc();
                    return Err(MintError::RateLimited);
                }
                if slots.len() >= self.capacity {
                    slots.retain(|_, s| s.created.elapsed() < LEAF_CACHE_TTL);
                }
                if slots.len() >= self.capacity {
                    let oldest = |own: bool| {
                        slots
                            .iter()
                            .filter(|(_, s)| !own || s.owner == Some(sandbox))
                            .min_by_key(|(_, s)| s.created)
                            .map(|(k, _)| k.clone())
                    };
                    if let Some(k) = oldest(true).or_else(|| oldest(false)) {
                        slots.remove(&k);
                    }
                }
                let cell = Arc::new(tokio::sync::OnceCell::new());
                slots.insert(key.clone(), Slot { cell: cell.clone(), created: Instant::now(), owner: Some(sandbox) });
                (cell, true)
            }
        };
        if let Some(m) = cell.get() {
            self.metrics.cert_cache_hits.inc();
            return Ok(m.cfg.clone());
        }
        cell.get_or_try_init(|| async {
            // A slot made by another handshake whose mint failed: this one is charged to retry.
            if !charged && !self.limiter.take(sandbox) {
                self.metrics.mint_rate_limited.inc();
                return Err(MintError::RateLimited);
            }
            self.mint_config(name.clone(), key.clone()).await
        })
        .await
        .map(|m| m.cfg.clone())
    }

    /// Drops `sandbox`'s leaves (its policy was deleted, R81: the next sandbox on the address
    /// must not find them, nor learn from them which names it reached) and refills its mint
    /// budget (R86: nor start with its predecessor's spent budget).
    pub fn forget_sandbox(&self, sandbox: Ipv4Addr) {
        let prefix = format!("{sandbox}/");
        self.slots.lock().expect("cache lock").retain(|k, _| !k.starts_with(&prefix));
        self.limiter.forget(sandbox);
    }

    /// Mints a leaf for `name` served under the cache key `scope` (its TLS 1.2 sessions' view).
    async fn mint_config(&self, name: CertName, scope: String) -> Result<Arc<Minted>, MintError> {
        let ca = self.ca.clone();
        let (tickets, sessions) = (self.tickets.clone(), self.sessions.clone());
        let m = tokio::task::spawn_blocking(move || -> anyhow::Result<Minted> {
            let (chain, key) = ca.mint(&name)?;
            let PrivateKeyDer::Pkcs8(pk) = &key else { bail!("minted key is not PKCS#8") };
            let (leaf, pk) = (chain[0].clone(), pk.clone_key());
            let cfg = leaf_config(chain, key, tickets, &sessions, &scope)?;
            Ok(Minted { cfg: Arc::new(cfg), leaf, key: pk })
        })
        .await
        .map_err(|e| MintError::Failed(e.to_string()))?
        .map_err(|e| MintError::Failed(e.to_string()))?;
        self.metrics.mints.inc();
        Ok(Arc::new(m))
    }

    /// SHA-256 of the CA certificate (hex): a successor installs handed-over leaves only when
    /// its CA is the same.
    pub fn ca_sha256(&self) -> String {
        use sha2::Digest;
        hex(&sha2::Sha256::digest(self.ca.cert_der()))
    }

    /// The (at most `max`) most recently minted fresh leaves with their keys, newest first, for
    /// a successor (E25).
    pub fn export_leaves(&self, max: usize) -> Vec<LeafMaterial> {
        let slots = self.slots.lock().expect("cache lock");
        let mut v: Vec<(&String, &Slot, &Arc<Minted>)> = slots
            .iter()
            .filter(|(_, s)| s.created.elapsed() < LEAF_CACHE_TTL)
            .filter_map(|(k, s)| s.cell.get().map(|m| (k, s, m)))
            .collect();
        v.sort_by_key(|e| std::cmp::Reverse(e.1.created));
        v.into_iter()
            .take(max)
            .map(|(k, s, m)| LeafMaterial {
                name: k.clone(),
                cert: hex(&m.leaf),
                key: hex(m.key.secret_pkcs8_der()),
                age_secs: s.created.elapsed().as_secs(),
            })
            .collect()
    }

    /// Installs leaves handed over by a predecessor (E25), at most the cache's capacity: each
    /// served with this process's CA as its chain and the shared ticket keys. Skipped (logged
    /// by name only): a name already cached, a leaf past [`LEAF_CACHE_TTL`], malformed hex, a
    /// key that does not match its certificate. Returns how many were installed.
    pub fn install_leaves(&self, leaves: &[LeafMaterial]) -> usize {
        let mut n = 0;
        for l in leaves {
            let Some(key_name) = name_of_key(&l.name).map(|(sb, n)| n.cache_key(sb)) else { continue };
            let age = Duration::from_secs(l.age_secs);
            let Some(created) = (age < LEAF_CACHE_TTL).then(|| Instant::now().checked_sub(age)).flatten() else {
                continue;
            };
            let (Some(cert), Some(key)) = (unhex(&l.cert), unhex(&l.key)) else {
                tracing::warn!(name = %l.name, "handed-over leaf is not hex; minting it instead");
                continue;
            };
            let leaf = CertificateDer::from(cert);
            let pk = PrivatePkcs8KeyDer::from(key);
            let chain = vec![leaf.clone(), self.ca.cert_der().clone()];
            let key = PrivateKeyDer::Pkcs8(pk.clone_key());
            let cfg = match leaf_config(chain, key, self.tickets.clone(), &self.sessions, &key_name) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(name = %l.name, error = %e, "handed-over leaf refused; minting it instead");
                    continue;
                }
            };
            let m = Arc::new(Minted { cfg: Arc::new(cfg), leaf, key: pk });
            let mut slots = self.slots.lock().expect("cache lock");
            if slots.len() >= self.capacity {
                break;
            }
            if slots.contains_key(&key_name) {
                continue;
            }
            slots.insert(
                key_name,
                Slot { cell: Arc::new(tokio::sync::OnceCell::new_with(Some(m))), created, owner: None },
            );
            n += 1;
        }
        n
    }

    /// Cache keys of the (at most `max`) most recently minted fresh leaves, newest first: what a
    /// successor mints before it takes over (E18). Keys are `<sandbox>/<SNI name>` or
    /// `<sandbox>/ip:<addr>` (R81).
    pub fn recent_names(&self, max: usize) -> Vec<String> {
        let slots = self.slots.lock().expect("cache lock");
        let mut v: Vec<(&String, Instant)> = slots
            .iter()
            .filter(|(_, s)| s.cell.initialized() && s.created.elapsed() < LEAF_CACHE_TTL)
            .map(|(k, s)| (k, s.created))
            .collect();
        v.sort_by_key(|e| std::cmp::Reverse(e.1));
        v.into_iter().take(max).map(|(k, _)| k.clone()).collect()
    }

    /// Mints leaves for cache keys from [`Self::recent_names`] (not charged to any sandbox:
    /// the predecessor already admitted them); returns how many are cached afterwards. Keys
    /// other than `<sandbox>/<host name>` or `<sandbox>/ip:<addr>` are skipped.
    pub async fn premint(&self, keys: &[String]) -> usize {
        let mut n = 0;
        for k in keys {
            let Some((sandbox, name)) = name_of_key(k) else { continue };
            let key = name.cache_key(sandbox);
            let cell = {
                let mut slots = self.slots.lock().expect("cache lock");
                if slots.len() >= self.capacity {
                    break;
                }
                let slot = slots.entry(key.clone()).or_insert_with(|| Slot {
                    cell: Arc::new(tokio::sync::OnceCell::new()),
                    created: Instant::now(),
                    owner: None,
                });
                slot.cell.clone()
            };
            match cell.get_or_try_init(|| self.mint_config(name.clone(), key.clone())).await {
                Ok(_) => n += 1,
                Err(e) => tracing::warn!(name = %k, error = %e, "pre-mint failed"),
            }
        }
        n
    }

    /// Seconds until the CA expires, as measured at load.
    pub fn ca_expires_in_secs(&self) -> i64 {
        self.ca.expires_in_secs
    }

    /// Number of cached leaves.
    pub fn len(&self) -> usize {
        self.slots.lock().expect("cache lock").len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Upstream TLS client config: the system trust store (`rustls-native-certs`) plus an optional
/// extra PEM bundle. Errors: no usable root at all, or an unreadable extra bundle.
pub fn upstream_client_config(extra_ca: Option<&Path>) -> anyhow::Result<ClientConfig> {
    let mut roots = RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for c in native.certs {
        let _ = roots.add(c);
    }
    if let Some(p) = extra_ca {
        for c in CertificateDer::pem_file_iter(p).with_context(|| format!("read {}", p.display()))? {
            roots.add(c.with_context(|| format!("parse {}", p.display()))?).context("add extra CA")?;
        }
    }
    if roots.is_empty() {
        bail!("no trusted root certificates for upstream TLS");
    }
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_ca(dir: &Path, days: i64) -> KeyPair {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut p = CertificateParams::default();
        p.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        p.distinguished_name.push(DnType::CommonName, "test CA");
        let now = time::OffsetDateTime::now_utc();
        p.not_before = now - time::Duration::days(2);
        p.not_after = now + time::Duration::days(days);
        let cert = p.self_signed(&key).unwrap();
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(CA_CERT_FILE), cert.pem()).unwrap();
        std::fs::write(dir.join(CA_KEY_FILE), key.serialize_pem()).unwrap();
        key
    }

    fn tmp(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("cube-egress-{name}-{}", std::process::id()))
    }

    #[test]
    fn ca_validation() {
        let d = tmp("ca-ok");
        write_ca(&d, 365);
        let ca = Ca::load(&d).unwrap();
        assert!(ca.expires_in_secs > 300 * 86400);
        // Key of another CA.
        let other = tmp("ca-other");
        let k = write_ca(&other, 365);
        std::fs::write(d.join(CA_KEY_FILE), k.serialize_pem()).unwrap();
        let e = Ca::load(&d).unwrap_err().to_string();
        assert!(e.contains("does not match"), "{e}");
        // Expired CA.
        write_ca(&d, -1);
        let e = Ca::load(&d).unwrap_err().to_string();
        assert!(e.contains("expired"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
        std::fs::remove_dir_all(&other).unwrap();
    }

    #[tokio::test]
    async fn mint_cache_single_flight_and_rate_limit() {
        let d = tmp("ca-mint");
        write_ca(&d, 365);
        let ca = Arc::new(Ca::load(&d).unwrap());
        let (chain, _) = ca.mint(&CertName::Dns("api.example.test".into())).unwrap();
        let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0]).unwrap();
        let san = leaf.subject_alternative_name().unwrap().unwrap();
        assert_eq!(format!("{:?}", san.value.general_names), "[DNSName(\"api.example.test\")]");
        let validity = leaf.validity().not_after.timestamp() - leaf.validity().not_before.timestamp();
        assert_eq!(validity, 7 * 86400 + 60);
        assert!(!leaf.is_ca());
        let metrics = Metrics::new();
        let cache = Arc::new(CertCache::new(ca, 100, 0.001, 2, metrics.clone()));
        let sb = Ipv4Addr::new(192, 168, 0, 2);
        let mut joins = Vec::new();
        for _ in 0..8 {
            let c = cache.clone();
            joins.push(tokio::spawn(
                async move { c.server_config(sb, CertName::Dns("a.test".into())).await.map(|_| ()) },
            ));
        }
        for j in joins {
            j.await.unwrap().unwrap();
        }
        assert_eq!(metrics.mints.get(), 1, "single flight: one mint for 8 concurrent handshakes");
        cache.server_config(sb, CertName::Dns("b.test".into())).await.unwrap();
        let e = cache.server_config(sb, CertName::Dns("c.test".into())).await.unwrap_err();
        assert!(matches!(e, MintError::RateLimited));
        // Cache hits are free; another sandbox has its own budget.
        cache.server_config(sb, CertName::Dns("a.test".into())).await.unwrap();
        cache.server_config(Ipv4Addr::new(192, 168, 0, 3), CertName::Dns("c.test".into())).await.unwrap();
        assert_eq!(metrics.mints.get(), 3);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Attack (R62): sandbox A, allowed a wildcard SNI, opens handshakes for 200 new names
    /// against a full cache while over its mint budget. B's leaf stays cached: B's next
    /// handshake is a cache hit, no mint, and B's own budget is untouched. Before R62 every
    /// refused handshake of A inserted an empty slot and evicted an arbitrary leaf, B's among
    /// them, so B minted again for each connection until its budget ran out.
    #[tokio::test]
    async fn a_sandbox_cycling_snis_never_evicts_another_sandboxs_leaf() {
        let d = tmp("ca-evict");
        write_ca(&d, 365);
        let ca = Arc::new(Ca::load(&d).unwrap());
        let metrics = Metrics::new();
        let cache = CertCache::new(ca, 4, 0.001, 2, metrics.clone());
        let (a, b) = (Ipv4Addr::new(192, 168, 0, 2), Ipv4Addr::new(192, 168, 0, 3));
        cache.server_config(b, CertName::Dns("api.b.test".into())).await.unwrap();
        let mut refused = 0;
        for i in 0..200 {
            if cache.server_config(a, CertName::Dns(format!("n{i}.a.test"))).await.is_err() {
                refused += 1;
            }
        }
        assert_eq!(refused, 198, "A minted its burst of 2, every other name refused");
        // A refused handshake leaves nothing behind (no empty slot that took a leaf's place).
        assert_eq!(cache.len(), 3, "refused handshakes changed the cache");
        let (mints, hits) = (metrics.mints.get(), metrics.cert_cache_hits.get());
        cache.server_config(b, CertName::Dns("api.b.test".into())).await.unwrap();
        assert_eq!(metrics.mints.get(), mints, "B's leaf was evicted by A's refused handshakes");
        assert_eq!(metrics.cert_cache_hits.get(), hits + 1);

        // Within its budget too, a full cache makes A evict its own leaves before B's.
        let cache = CertCache::new(Arc::new(Ca::load(&d).unwrap()), 4, 0.001, 50, Metrics::new());
        cache.server_config(b, CertName::Dns("api.b.test".into())).await.unwrap();
        for i in 0..40 {
            cache.server_config(a, CertName::Dns(format!("n{i}.a.test"))).await.unwrap();
        }
        assert_eq!(cache.len(), 4);
        let keys = cache.recent_names(4);
        assert!(keys.contains(&"192.168.0.3/api.b.test".to_string()), "B's leaf evicted: {keys:?}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Attack (R81): before, leaves were cached per name for every sandbox, so sandbox B
    /// learned whether, and when, another sandbox had reached a name: B spent its mint budget,
    /// then a handshake for a name some other sandbox had reached still succeeded (a cached
    /// leaf costs nothing) while any other name was refused, and the leaf B got was the other
    /// sandbox's, its notBefore the moment that sandbox first reached the name. Now each
    /// sandbox has its own leaves: B pays for the name as for any other, and never gets A's.
    #[tokio::test]
    async fn a_sandbox_learns_nothing_from_another_sandboxs_leaves() {
        let d = tmp("ca-oracle");
        write_ca(&d, 365);
        let (a, b) = (Ipv4Addr::new(192, 168, 0, 2), Ipv4Addr::new(192, 168, 0, 3));
        let cache = CertCache::new(Arc::new(Ca::load(&d).unwrap()), 100, 0.001, 1, Metrics::new());
        cache.server_config(a, CertName::Dns("visited.test".into())).await.unwrap();
        // B spends its one token, then probes the name A reached and one nobody reached.
        cache.server_config(b, CertName::Dns("own.test".into())).await.unwrap();
        let visited = cache.server_config(b, CertName::Dns("visited.test".into())).await;
        let unvisited = cache.server_config(b, CertName::Dns("unvisited.test".into())).await;
        assert!(matches!(unvisited, Err(MintError::RateLimited)));
        assert!(
            matches!(visited, Err(MintError::RateLimited)),
            "a name another sandbox reached answers differently from one nobody reached"
        );
        // Within budget B gets a leaf of its own for the name, never A's.
        let cache = CertCache::new(Arc::new(Ca::load(&d).unwrap()), 100, 0.001, 5, Metrics::new());
        cache.server_config(a, CertName::Dns("visited.test".into())).await.unwrap();
        cache.server_config(b, CertName::Dns("visited.test".into())).await.unwrap();
        let leaves = cache.export_leaves(10);
        assert_eq!(leaves.len(), 2, "one leaf per sandbox");
        assert_ne!(leaves[0].cert, leaves[1].cert, "B was served A's leaf");
        // Keys of a predecessor before R81 (no sandbox) are not served to anyone.
        let old = LeafMaterial { name: "visited.test".into(), ..leaves[0].clone() };
        let fresh = CertCache::new(Arc::new(Ca::load(&d).unwrap()), 100, 0.001, 5, Metrics::new());
        assert_eq!(fresh.install_leaves(&[old]), 0);
        assert_eq!(fresh.premint(&["visited.test".into(), "ip:203.0.113.5".into()]).await, 0);
        assert_eq!(fresh.install_leaves(&leaves), 2, "this version's keys install");
        // A's policy deleted (Release): the address's next sandbox finds none of A's leaves.
        fresh.forget_sandbox(a);
        let left: Vec<String> = fresh.export_leaves(10).into_iter().map(|l| l.name).collect();
        assert_eq!(left, vec!["192.168.0.3/visited.test".to_string()]);
        // R86: a sandbox whose mint budget is spent leaves a full one to the address's next.
        let spent = CertCache::new(Arc::new(Ca::load(&d).unwrap()), 100, 0.001, 1, Metrics::new());
        spent.server_config(a, CertName::Dns("one.test".into())).await.unwrap();
        assert!(matches!(spent.server_config(a, CertName::Dns("two.test".into())).await, Err(MintError::RateLimited)));
        spent.forget_sandbox(a);
        spent.server_config(a, CertName::Dns("two.test".into())).await.expect("the next sandbox's first mint");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
