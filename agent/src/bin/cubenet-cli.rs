//! `cubenet-cli`: operator CLI for the network-agent. Networks via gRPC; TAPs, per-sandbox counters and datapath
//! dumps via the loopback HTTP endpoints; tables by default, `--json` for JSON.

#[path = "cubenet-cli/bundle.rs"]
mod bundle;
#[path = "cubenet-cli/datapath.rs"]
mod datapath;

use std::{collections::HashMap, path::PathBuf};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use cubenet_proto::v1 as pb;
use network_agent::client::{connect, http_get};

#[derive(Parser, Debug)]
#[command(name = "cubenet-cli", version, about = "Operate a CubeNet network-agent")]
struct Cli {
    /// gRPC endpoint of the agent.
    #[arg(long, env = "CUBENET_GRPC", default_value = "unix:///tmp/cube/network-agent-grpc.sock")]
    grpc: String,
    /// Health/HTTP address of the agent.
    #[arg(long, env = "CUBENET_HTTP", default_value = "127.0.0.1:19090")]
    http: String,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Ensure a sandbox network.
    Ensure {
        /// Sandbox id.
        sandbox_id: String,
        /// Port mapping `[tcp|udp/]GUEST[:HOST]` (HOST 0 or absent = assign); repeatable.
        #[arg(short, long = "port")]
        ports: Vec<String>,
        /// Deny internet access.
        #[arg(long)]
        no_internet: bool,
        /// Allowed CIDR; repeatable.
        #[arg(long)]
        allow_out: Vec<String>,
        /// Denied CIDR; repeatable.
        #[arg(long)]
        deny_out: Vec<String>,
        /// Allowed DNS name `NAME[:PORT[,PORT…]]` (`*.suffix` for subdomains); repeatable.
        #[arg(long)]
        allow_fqdn: Vec<String>,
    },
    /// Release a sandbox network.
    Release {
        /// Sandbox id.
        sandbox_id: String,
    },
    /// Show one sandbox network.
    Get {
        /// Sandbox id.
        sandbox_id: String,
    },
    /// List sandbox networks.
    List,
    /// List TAPs with their pool state.
    Taps {
        /// Only this state (Ready, Active, Cleaning).
        #[arg(long)]
        state: Option<String>,
    },
    /// Datapath counters of one sandbox: packets and bytes each way (out = sent by the guest),
    /// drops by reason; its allow_fqdn patterns and the addresses learned for them
    Sandbox {
        /// Sandbox id.
        sandbox_id: String,
    },
    /// Dump datapath sessions (flows: protocol, sandbox and remote address, SNAT address, state).
    Sessions {
        /// Only the sessions of this sandbox (its TAP's ifindex and current version).
        #[arg(long)]
        sandbox: Option<String>,
    },
    /// Dump the datapath's sandbox registry.
    Sandboxes,
    /// Dump datapath port mappings.
    Portmaps,
    /// Dump per-TAP egress policies.
    Policies,
    /// Collect a debug bundle (health, readiness, metrics, TAPs, networks, datapath registry,
    /// counters, port maps, policies, FQDN view, datapath slots; never credentials) into a new directory.
    Bundle(bundle::BundleArgs),
    /// Active/standby CubeVS datapath: status, load into standby, switch, rollback (works on
    /// the pins directly, under the node's update lock).
    Datapath {
        /// bpffs pin directory of the datapath (the agent's `bpffs_dir`).
        #[arg(long, env = "CUBENET_BPFFS_DIR", default_value = "/sys/fs/bpf/cubevs")]
        bpffs_dir: PathBuf,
        #[command(subcommand)]
        cmd: datapath::DatapathCmd,
    },
}

/// `NAME[:PORT[,PORT…]]` → an FQDN allow entry (the agent validates the name and ports).
fn parse_fqdn(s: &str) -> anyhow::Result<pb::FqdnAllow> {
    let (name, ports) = s.split_once(':').unwrap_or((s, ""));
    let ports = ports
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|p| p.parse().with_context(|| format!("port {p:?} in {s:?}")))
        .collect::<anyhow::Result<_>>()?;
    Ok(pb::FqdnAllow { name: name.to_string(), ports })
}

fn parse_port(s: &str) -> anyhow::Result<pb::PortMapping> {
    let (proto, rest) = match s.split_once('/') {
        Some((p, r)) => (p.to_string(), r),
        None => ("tcp".to_string(), s),
    };
    let (g, h) = rest.split_once(':').unwrap_or((rest, "0"));
    Ok(pb::PortMapping {
        protocol: proto,
        container_port: g.parse().with_context(|| format!("guest port in {s:?}"))?,
        host_port: h.parse().with_context(|| format!("host port in {s:?}"))?,
        host_ip: String::new(),
    })
}

fn ports_str(p: &[pb::PortMapping]) -> String {
    p.iter().map(|m| format!("{}/{}->{}", m.protocol, m.container_port, m.host_port)).collect::<Vec<_>>().join(",")
}

fn table(header: &[&str], rows: Vec<Vec<String>>) {
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        cells.iter().enumerate().map(|(i, c)| format!("{c:<width$}", width = w[i])).collect::<Vec<_>>().join("  ")
    };
    println!("{}", line(header.iter().map(|s| s.to_string()).collect()));
    for r in rows {
        println!("{}", line(r));
    }
}

fn network_json(
    sandbox_id: &str,
    ifs: &[pb::Interface],
    ports: &[pb::PortMapping],
    meta: &HashMap<String, String>,
) -> serde_json::Value {
    serde_json::json!({
        "sandboxID": sandbox_id,
        "interfaces": ifs.iter().map(|i| serde_json::json!({
            "name": i.name, "mac": i.mac_address, "ips": i.ip_cidrs, "gateway": i.gateway, "mtu": i.mtu})).collect::<Vec<_>>(),
        "portMappings": ports.iter().map(|p| serde_json::json!({
            "protocol": p.protocol, "containerPort": p.container_port, "hostPort": p.host_port})).collect::<Vec<_>>(),
        "persistMetadata": meta,
    })
}

fn http_json(addr: &str, path: &str) -> anyhow::Result<serde_json::Value> {
    let (code, body) = http_get(addr, path).with_context(|| format!("GET http://{addr}{path}"))?;
    if code != 200 {
        bail!("GET {path}: HTTP {code}: {body}");
    }
    Ok(serde_json::from_str(&body)?)
}

/// Errors go to stderr as one line, `cubenet-cli: …` (a gRPC error as `gRPC <code>: <message>`,
/// e.g. `gRPC InvalidArgument: invalid cubevs_context.allow_out[0]: …`), with exit status 1 and
/// no backtrace whatever `RUST_BACKTRACE` says.
#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            match e.downcast_ref::<tonic::Status>() {
                Some(st) => eprintln!("cubenet-cli: gRPC {:?}: {}", st.code(), st.message()),
                None => eprintln!("cubenet-cli: {e:#}"),
            }
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Datapath { bpffs_dir, cmd } => datapath::run(&bpffs_dir, cmd, cli.json)?,
        Cmd::Bundle(args) => {
            bundle::run(&cli.grpc, &cli.http, args).await?;
        }
        Cmd::Ensure { sandbox_id, ports, no_internet, allow_out, deny_out, allow_fqdn } => {
            let mut c = connect(&cli.grpc).await?;
            let r = c
                .ensure_network(pb::EnsureNetworkRequest {
                    sandbox_id,
                    port_mappings: ports.iter().map(|p| parse_port(p)).collect::<anyhow::Result<_>>()?,
                    cubevs_context: Some(pb::CubeVsContext {
                        allow_internet_access: Some(!no_internet),
                        allow_out,
                        deny_out,
                        allow_fqdn: allow_fqdn.iter().map(|f| parse_fqdn(f)).collect::<anyhow::Result<_>>()?,
                        rules: Vec::new(),
                    }),
                    ..Default::default()
                })
                .await?
                .into_inner();
            let j = network_json(&r.sandbox_id, &r.interfaces, &r.port_mappings, &r.persist_metadata);
            print_network(cli.json, j, &r.interfaces, &r.port_mappings, &r.persist_metadata, &r.sandbox_id);
        }
        Cmd::Release { sandbox_id } => {
            let mut c = connect(&cli.grpc).await?;
            let r = c
                .release_network(pb::ReleaseNetworkRequest { sandbox_id: sandbox_id.clone(), ..Default::default() })
                .await?
                .into_inner();
            if cli.json {
                println!("{}", serde_json::json!({"sandboxID": sandbox_id, "released": r.released}));
            } else {
                println!("{sandbox_id}: released={}", r.released);
            }
        }
        Cmd::Get { sandbox_id } => {
            let mut c = connect(&cli.grpc).await?;
            let r = c.get_network(pb::GetNetworkRequest { sandbox_id, ..Default::default() }).await?.into_inner();
            let j = network_json(&r.sandbox_id, &r.interfaces, &r.port_mappings, &r.persist_metadata);
            print_network(cli.json, j, &r.interfaces, &r.port_mappings, &r.persist_metadata, &r.sandbox_id);
        }
        Cmd::List => {
            let mut c = connect(&cli.grpc).await?;
            let r = c.list_networks(pb::ListNetworksRequest {}).await?.into_inner();
            if cli.json {
                let v: Vec<_> = r
                    .networks
                    .iter()
                    .map(|n| {
                        serde_json::json!({"sandboxID": n.sandbox_id, "tapName": n.tap_name,
                        "tapIfIndex": n.tap_ifindex, "sandboxIP": n.sandbox_ip, "ports": ports_str(&n.port_mappings)})
                    })
                    .collect();
                println!("{}", serde_json::json!({"networks": v}));
            } else {
                table(
                    &["SANDBOX", "TAP", "IFINDEX", "IP", "PORTS"],
                    r.networks
                        .iter()
                        .map(|n| {
                            vec![
                                n.sandbox_id.clone(),
                                n.tap_name.clone(),
                                n.tap_ifindex.to_string(),
                                n.sandbox_ip.clone(),
                                ports_str(&n.port_mappings),
                            ]
                        })
                        .collect(),
                );
            }
        }
        Cmd::Taps { state } => {
            let mut j = http_json(&cli.http, "/v1/network/taps")?;
            if let Some(s) = &state
                && let Some(arr) = j.get_mut("taps").and_then(|t| t.as_array_mut())
            {
                arr.retain(|t| t["state"].as_str().is_some_and(|x| x.eq_ignore_ascii_case(s)));
            }
            if cli.json {
                println!("{j}");
            } else {
                let rows = j["taps"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|t| {
                                [
                                    "tapName",
                                    "tapIfIndex",
                                    "sandboxIP",
                                    "state",
                                    "ownerSandboxID",
                                    "retryCount",
                                    "lastError",
                                ]
                                .iter()
                                .map(|k| match &t[*k] {
                                    serde_json::Value::String(s) => s.clone(),
                                    v => v.to_string(),
                                })
                                .collect()
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                table(&["TAP", "IFINDEX", "IP", "STATE", "OWNER", "RETRIES", "LAST_ERROR"], rows);
                println!("{}", j["stateCounts"]);
            }
        }
        Cmd::Sandbox { sandbox_id } => {
            let j = http_json(&cli.http, "/v1/dataplane/counters")?;
            let Some(sb) =
                j["sandboxes"].as_array().and_then(|a| a.iter().find(|s| s["sandboxID"] == sandbox_id.as_str()))
            else {
                bail!("sandbox {sandbox_id:?} is not registered in the datapath");
            };
            // Patterns and learned addresses (O18); an agent before O18 has no such path.
            let fqdn = http_json(&cli.http, "/v1/dataplane/fqdn").ok().and_then(|j| {
                j["sandboxes"]
                    .as_array()
                    .and_then(|a| a.iter().find(|s| s["sandboxID"] == sandbox_id.as_str()).cloned())
            });
            if cli.json {
                let mut sb = sb.clone();
                if let Some(f) = &fqdn {
                    sb["allowFqdn"] = f["allowFqdn"].clone();
                    sb["learned"] = f["learned"].clone();
                    sb["learnedEntries"] = f["learnedEntries"].clone();
                    sb["queryWindow"] = f["queryWindow"].clone();
                    sb["learnedDay"] = f["learnedDay"].clone();
                }
                println!("{sb}");
            } else {
                print_counters(sb);
                if let Some(f) = fqdn {
                    print_fqdn(&f);
                }
            }
        }
        Cmd::Sessions { .. } | Cmd::Sandboxes | Cmd::Portmaps | Cmd::Policies => {
            let (path, key) = match cli.cmd {
                Cmd::Sessions { .. } => ("/v1/dataplane/sessions", "sessions"),
                Cmd::Sandboxes => ("/v1/dataplane/sandboxes", "sandboxes"),
                Cmd::Portmaps => ("/v1/dataplane/portmaps", "portMappings"),
                _ => ("/v1/dataplane/policies", "policies"),
            };
            let mut j = http_json(&cli.http, path)?;
            if let Cmd::Sessions { sandbox: Some(id) } = &cli.cmd {
                j = sessions_of(&cli.http, j, id)?;
            }
            if cli.json {
                println!("{j}");
            } else {
                let items = j[key].as_array().cloned().unwrap_or_default();
                if items.is_empty() {
                    // A table needs a first row for its columns; say so rather than print nothing.
                    println!("no {key}");
                    return Ok(());
                }
                let mut header: Vec<String> = Vec::new();
                if let Some(serde_json::Value::Object(m)) = items.first() {
                    header = m.keys().cloned().collect();
                }
                let rows = items
                    .iter()
                    .map(|it| {
                        header
                            .iter()
                            .map(|k| match &it[k] {
                                serde_json::Value::String(s) => s.clone(),
                                v => v.to_string(),
                            })
                            .collect()
                    })
                    .collect();
                let h: Vec<String> = header.iter().map(|s| s.to_uppercase()).collect();
                table(&h.iter().map(String::as_str).collect::<Vec<_>>(), rows);
            }
        }
    }
    Ok(())
}

/// `{"sessions": […]}` reduced to the sessions of sandbox `id`: those keyed by its TAP's
/// ifindex and its current version (a previous owner's leftovers on the TAP are not its own).
fn sessions_of(http: &str, mut j: serde_json::Value, id: &str) -> anyhow::Result<serde_json::Value> {
    let reg = http_json(http, "/v1/dataplane/sandboxes")?;
    let Some(sb) = reg["sandboxes"].as_array().and_then(|a| a.iter().find(|s| s["id"] == id)) else {
        bail!("sandbox {id:?} is not registered in the datapath");
    };
    let (ifindex, version) = (sb["ifindex"].clone(), sb["version"].clone());
    if let Some(a) = j["sessions"].as_array_mut() {
        a.retain(|s| s["ifindex"] == ifindex && s["version"] == version);
    }
    Ok(j)
}

fn print_network(
    json: bool,
    j: serde_json::Value,
    ifs: &[pb::Interface],
    ports: &[pb::PortMapping],
    meta: &HashMap<String, String>,
    id: &str,
) {
    if json {
        println!("{j}");
        return;
    }
    let i = ifs.first().cloned().unwrap_or_default();
    table(
        &["SANDBOX", "TAP", "MAC", "IP", "GATEWAY", "MTU", "SANDBOX_IP", "PORTS"],
        vec![vec![
            id.to_string(),
            i.name,
            i.mac_address,
            i.ip_cidrs.join(","),
            i.gateway,
            i.mtu.to_string(),
            meta.get("sandbox_ip").cloned().unwrap_or_default(),
            ports_str(ports),
        ]],
    );
}

/// `cubenet-cli sandbox ID` as tables: identity, traffic each way, drops by reason.
/// The `allow_fqdn` patterns of one sandbox with the addresses learned for each (O18).
fn print_fqdn(f: &serde_json::Value) {
    let patterns: Vec<&str> =
        f["allowFqdn"].as_array().map(|a| a.iter().filter_map(|v| v.as_str()).collect()).unwrap_or_default();
    if patterns.is_empty() {
        return;
    }
    println!();
    let rows = patterns
        .iter()
        .map(|p| {
            let name = p.split_once(':').map_or(*p, |(n, _)| n);
            let ips: Vec<&str> = f["learned"][name]
                .as_array()
                .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
                .unwrap_or_default();
            vec![p.to_string(), if ips.is_empty() { "-".into() } else { ips.join(",") }]
        })
        .collect();
    table(&["ALLOW_FQDN", "LEARNED (unexpired)"], rows);
    println!("learned entries of this sandbox: {}", f["learnedEntries"]);
    // The datapath's windows (O20): over a cap, queries go untracked / answers unlearned.
    for (what, key) in
        [("tracked DNS queries (10 s window)", "queryWindow"), ("new learned entries (day window)", "learnedDay")]
    {
        let w = &f[key];
        if w.is_object() {
            match w["resets_in_secs"].as_u64() {
                Some(0) | None => println!("{what}: {} of {}, no window open", w["used"], w["cap"]),
                Some(r) => println!("{what}: {} of {}, window resets in {r} s", w["used"], w["cap"]),
            }
        }
    }
}

fn print_counters(sb: &serde_json::Value) {
    let s = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        v => v.to_string(),
    };
    table(
        &["SANDBOX", "IFINDEX", "IP", "VERSION"],
        vec![vec![s(&sb["sandboxID"]), s(&sb["ifindex"]), s(&sb["ip"]), s(&sb["version"])]],
    );
    println!();
    table(
        &["DIRECTION", "PACKETS", "BYTES"],
        ["out", "in"].iter().map(|d| vec![d.to_string(), s(&sb[d]["packets"]), s(&sb[d]["bytes"])]).collect(),
    );
    println!();
    // An agent before this view has no `sessions`.
    if sb["sessions"].is_object() {
        println!("live sessions: {} of {}", s(&sb["sessions"]["live"]), s(&sb["sessions"]["budget"]));
        println!();
    }
    let drops =
        sb["drops"].as_object().map(|m| m.iter().map(|(k, v)| vec![k.clone(), s(v)]).collect()).unwrap_or_default();
    table(&["DROP_REASON", "PACKETS"], drops);
}
