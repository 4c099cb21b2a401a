//! `cubenet-cli bundle`: one directory with what a bug report about a node needs — health,
//! readiness, metrics, the TAP pool, the gRPC view of every network, the datapath registry,
//! counters, port maps, policies, FQDN patterns with what was learned, the datapath slots and, on request, sessions and files such
//! as the agent's config and log. Every item is collected on its own, so a half-broken agent
//! still yields everything that answers; `MANIFEST.txt` says what failed and why.
//!
//! Never collected: `/v1/policies/dump` (it carries the L7 credentials). `/v1/dataplane/policies`
//! holds only the CIDR entries. The directory is created 0700 (it names every sandbox).

use std::{
    io::{Read, Seek, SeekFrom},
    os::unix::fs::DirBuilderExt,
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};
use cubenet_proto::v1 as pb;
use network_agent::client::{connect, http_get};

/// Bytes kept from the end of a copied file (`--file`): logs can be large.
pub const FILE_TAIL_BYTES: u64 = 16 << 20;

/// `bundle` options.
#[derive(clap::Args, Debug)]
pub struct BundleArgs {
    /// Directory to create (must not exist); default `cubenet-bundle-<unix seconds>` here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also dump every datapath session (large on a busy node: one JSON object per flow).
    #[arg(long)]
    sessions: bool,
    /// A file to include, e.g. the agent's config or `NETWORK_AGENT_LOG_FILE` (its last 16 MiB);
    /// repeatable.
    #[arg(long = "file")]
    files: Vec<PathBuf>,
    /// bpffs pin directory for the datapath slot status (the agent's `bpffs_dir`).
    #[arg(long, env = "CUBENET_BPFFS_DIR", default_value = "/sys/fs/bpf/cubevs")]
    bpffs_dir: PathBuf,
}

/// One line of `MANIFEST.txt`.
struct Item {
    file: String,
    result: Result<usize, String>,
}

/// `GET path`: the body of a 200; for the probes (`.txt`) any answer, as `HTTP <code>\n<body>`
/// (readiness answers 503 with its reason: that answer is the point).
fn http_item(addr: &str, file: &str, path: &str) -> Result<Vec<u8>, String> {
    match http_get(addr, path) {
        Ok((code, body)) if file.ends_with("z.txt") => Ok(format!("HTTP {code}\n{body}").into_bytes()),
        Ok((200, body)) => Ok(body.into_bytes()),
        Ok((code, body)) => Err(format!("GET http://{addr}{path}: HTTP {code}: {}", body.trim())),
        Err(e) => Err(format!("GET http://{addr}{path}: {e}")),
    }
}

async fn networks_item(grpc: &str) -> Result<Vec<u8>, String> {
    let mut c = connect(grpc).await.map_err(|e| format!("connect {grpc}: {e:#}"))?;
    let r = c.list_networks(pb::ListNetworksRequest {}).await.map_err(|s| format!("ListNetworks: {s}"))?.into_inner();
    let v: Vec<_> = r
        .networks
        .iter()
        .map(|n| {
            serde_json::json!({"sandboxID": n.sandbox_id, "tapName": n.tap_name, "tapIfIndex": n.tap_ifindex,
                "sandboxIP": n.sandbox_ip, "ports": super::ports_str(&n.port_mappings)})
        })
        .collect();
    serde_json::to_vec_pretty(&serde_json::json!({ "networks": v })).map_err(|e| e.to_string())
}

/// The last [`FILE_TAIL_BYTES`] of `path`.
fn file_tail(path: &Path) -> Result<Vec<u8>, String> {
    let mut f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let len = f.metadata().map_err(|e| format!("{}: {e}", path.display()))?.len();
    if len > FILE_TAIL_BYTES {
        f.seek(SeekFrom::Start(len - FILE_TAIL_BYTES)).map_err(|e| e.to_string())?;
    }
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(buf)
}

/// Collects the bundle into `args.out`; returns the directory. Fails only when the directory
/// cannot be made; failed items are listed in `MANIFEST.txt` and counted on stdout.
pub async fn run(grpc: &str, http: &str, args: BundleArgs) -> anyhow::Result<PathBuf> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
    let dir = args.out.unwrap_or_else(|| PathBuf::from(format!("cubenet-bundle-{now}")));
    if dir.exists() {
        bail!("{} already exists: name a new directory with --out", dir.display());
    }
    std::fs::DirBuilder::new().mode(0o700).create(&dir).with_context(|| format!("create {}", dir.display()))?;

    let mut items: Vec<(String, Result<Vec<u8>, String>)> = vec![(
        "version.txt".into(),
        Ok(format!(
            "cubenet-cli {}\nkernel {}\ncollected at unix {now}\ngrpc {grpc}\nhttp {http}\n",
            env!("CARGO_PKG_VERSION"),
            std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim()
        )
        .into_bytes()),
    )];
    let mut paths = vec![
        ("healthz.txt", "/healthz"),
        ("readyz.txt", "/readyz"),
        ("metrics.txt", "/metrics"),
        ("taps.json", "/v1/network/taps"),
        ("sandboxes.json", "/v1/dataplane/sandboxes"),
        ("counters.json", "/v1/dataplane/counters"),
        ("portmaps.json", "/v1/dataplane/portmaps"),
        ("policies.json", "/v1/dataplane/policies"),
        ("fqdn.json", "/v1/dataplane/fqdn"),
    ];
    if args.sessions {
        paths.push(("sessions.json", "/v1/dataplane/sessions"));
    }
    for (file, path) in paths {
        items.push((file.into(), http_item(http, file, path)));
    }
    items.push(("networks.json".into(), networks_item(grpc).await));
    items.push((
        "datapath-status.json".into(),
        cubevs::slots::status(&args.bpffs_dir)
            .map_err(|e| format!("datapath status of {}: {e:#}", args.bpffs_dir.display()))
            .and_then(|st| serde_json::to_vec_pretty(&super::datapath::status_json(&st)).map_err(|e| e.to_string())),
    ));
    for (i, f) in args.files.iter().enumerate() {
        let base = f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "file".into());
        items.push((format!("files/{i}-{base}"), file_tail(f)));
    }

    let mut manifest = Vec::new();
    for (file, body) in items {
        let result = match body {
            Ok(bytes) => {
                let p = dir.join(&file);
                if let Some(parent) = p.parent() {
                    std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
                }
                std::fs::write(&p, &bytes).map(|_| bytes.len()).map_err(|e| format!("write {}: {e}", p.display()))
            }
            Err(e) => Err(e),
        };
        manifest.push(Item { file, result });
    }
    let failed = manifest.iter().filter(|i| i.result.is_err()).count();
    let text: String = manifest
        .iter()
        .map(|i| match &i.result {
            Ok(n) => format!("ok     {}  ({n} bytes)\n", i.file),
            Err(e) => format!("FAILED {}: {e}\n", i.file),
        })
        .collect();
    std::fs::write(dir.join("MANIFEST.txt"), text).with_context(|| format!("write {}/MANIFEST.txt", dir.display()))?;
    println!("{}: {} items, {failed} failed (see MANIFEST.txt)", dir.display(), manifest.len());
    Ok(dir)
}
