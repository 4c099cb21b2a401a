//! `cubenet-cli datapath status | load OBJECT | switch | rollback`: operates on the pinned
//! CubeVS state directly (bpffs pin directory) under the update lock, so it works while
//! the agent is down. Alternative rejected: an agent admin call (an upgrade would then
//! depend on the process being upgraded).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Subcommand;
use cubevs::{
    layout::SelfTestState,
    slots::{self, SLOT_NAMES},
};

/// Datapath operations.
#[derive(Subcommand, Debug)]
pub enum DatapathCmd {
    /// Show layout version, slots (object sha256, version, self-test) and attach points.
    Status,
    /// Load OBJECT into the standby slot (reusing the pinned maps) and self-test it.
    Load {
        /// eBPF object file.
        object: PathBuf,
    },
    /// Make the loaded standby slot active on every hook.
    Switch,
    /// Make the other slot active again.
    Rollback,
}

fn slot_name(s: Option<usize>) -> &'static str {
    s.map_or("-", |s| SLOT_NAMES[s])
}

/// `datapath status --json`'s object (also the debug bundle's `datapath-status.json`).
pub fn status_json(st: &slots::Status) -> serde_json::Value {
    let m = &st.meta;
    serde_json::json!({
        "layoutVersion": m.layout,
        "active": m.active.map(|s| SLOT_NAMES[s]),
        "pending": m.pending.map(|s| SLOT_NAMES[s]),
        "slots": (0..2).map(|s| serde_json::json!({
            "slot": SLOT_NAMES[s],
            "sha256": if m.slots[s].selftest == SelfTestState::None { String::new() } else { slots::hex(&m.slots[s].sha256) },
            "version": m.slots[s].version,
            "object": m.slots[s].object,
            "loadedAt": m.slots[s].loaded_at,
            "selfTest": m.slots[s].selftest.as_str(),
            "programs": st.slot_programs[s].iter().map(|(n, id, tag)| serde_json::json!({
                "name": n, "id": id, "tag": format!("{tag:016x}")})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "attachPoints": st.attach.iter().map(|a| serde_json::json!({
            "hook": a.program, "ifindex": a.ifindex, "ifname": a.ifname, "linkId": a.link_id,
            "programId": a.program_id, "tag": format!("{:016x}", a.tag), "slot": a.slot.map(|s| SLOT_NAMES[s]),
        })).collect::<Vec<_>>(),
    })
}

fn print_status(st: &slots::Status) {
    let m = &st.meta;
    println!(
        "layout version {}   active slot {}   pending slot {}",
        m.layout,
        slot_name(m.active),
        slot_name(m.pending)
    );
    let rows = (0..2)
        .map(|s| {
            let r = &m.slots[s];
            let sha = if r.selftest == SelfTestState::None { "-".to_string() } else { slots::hex(&r.sha256) };
            vec![SLOT_NAMES[s].to_string(), sha, r.version.clone(), r.selftest.as_str().to_string(), r.object.clone()]
        })
        .collect();
    super::table(&["SLOT", "OBJECT SHA256", "VERSION", "SELF-TEST", "OBJECT"], rows);
    println!();
    let rows = st
        .attach
        .iter()
        .map(|a| {
            vec![
                a.program.to_string(),
                a.ifname.clone().unwrap_or_else(|| "?".into()),
                a.ifindex.to_string(),
                a.link_id.to_string(),
                a.program_id.to_string(),
                format!("{:016x}", a.tag),
                slot_name(a.slot).to_string(),
            ]
        })
        .collect();
    super::table(&["HOOK", "IFNAME", "IFINDEX", "LINK", "PROG ID", "TAG", "SLOT"], rows);
}

/// Runs one datapath command against the pins under `pin_dir`.
pub fn run(pin_dir: &Path, cmd: DatapathCmd, json: bool) -> anyhow::Result<()> {
    match cmd {
        DatapathCmd::Status => {
            let st = slots::status(pin_dir).context("datapath status")?;
            if json {
                println!("{}", status_json(&st));
            } else {
                print_status(&st);
            }
        }
        DatapathCmd::Load { object } => {
            let l = slots::load_standby(pin_dir, &object).context("datapath load")?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"slot": SLOT_NAMES[l.slot], "selfTest": "passed",
                        "checks": l.selftest.checks.iter().map(|c| c.name).collect::<Vec<_>>()})
                );
            } else {
                println!(
                    "loaded {} into slot {} (self-test passed: {} checks); `datapath switch` activates it",
                    object.display(),
                    SLOT_NAMES[l.slot],
                    l.selftest.checks.len()
                );
            }
        }
        DatapathCmd::Switch | DatapathCmd::Rollback => {
            let rollback = matches!(cmd, DatapathCmd::Rollback);
            let s = if rollback { slots::rollback(pin_dir) } else { slots::switch(pin_dir) }
                .with_context(|| if rollback { "datapath rollback" } else { "datapath switch" })?;
            if json {
                println!("{}", serde_json::json!({"active": SLOT_NAMES[s]}));
            } else {
                println!("slot {} is active on every hook", SLOT_NAMES[s]);
            }
        }
    }
    Ok(())
}
