//! SIGHUP: re-reads the configuration file and applies its `always_denied_cidrs` to the running
//! datapath (decision R51). Every other key is read at start only: a changed one is logged as
//! needing a restart and nothing else changes; a file that does not parse or validate is logged
//! and the list in force stays.

use std::sync::Arc;

use crate::{
    config::{Config, Validated},
    cubevs_dp::CubeVsDataplane,
    handover::{Entry, MutationGate},
    metrics::Metrics,
};

/// Keys whose value differs between `old` and `new`, sorted, `always_denied_cidrs` excluded
/// (the one key a reload applies). Compared through their JSON form, key by key.
pub fn restart_keys(old: &Config, new: &Config) -> Vec<String> {
    let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) =
        (serde_json::to_value(old), serde_json::to_value(new))
    else {
        return Vec::new();
    };
    let mut keys: Vec<String> = a
        .iter()
        .filter(|(k, v)| *k != "always_denied_cidrs" && b.get(*k) != Some(*v))
        .map(|(k, _)| k.clone())
        .collect();
    keys.sort();
    keys
}

/// What one SIGHUP did.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// The agent runs without a configuration file: nothing to re-read.
    NoFile,
    /// The file does not read, parse or validate: nothing changed (the message names the key).
    Invalid(String),
    /// The state was handed to a successor: the node's list is the successor's to write.
    HandedOver,
    /// `always_denied_cidrs` was written (whether or not it changed); `sessions_deleted`
    /// sessions toward newly listed entries were cut; `restart_keys` changed but are not applied.
    Applied {
        /// The list now in `node_deny`, as written in the file.
        list: Vec<String>,
        /// Sessions deleted toward listed destinations.
        sessions_deleted: usize,
        /// Other keys that changed: they take effect at the next start.
        restart_keys: Vec<String>,
    },
    /// Writing the map failed; the map may hold the old entries plus some new ones (the
    /// replace inserts before it deletes).
    Failed(String),
}

/// Re-reads the configuration on each SIGHUP and applies `always_denied_cidrs`.
pub struct Reloader {
    /// Reads the file and layers the command-line flags over it, as at start; `None` = no file.
    pub load: Option<Box<dyn Fn() -> Result<Config, String> + Send + Sync>>,
    /// The configuration the agent started with (the keys a reload does not apply).
    pub running: Arc<Validated>,
    /// The datapath whose `node_deny` map and sessions the list governs.
    pub dp: Arc<CubeVsDataplane>,
    /// Entered for the write, as every mutation: never while a hand-over is out.
    pub gate: Arc<MutationGate>,
    /// `cubenet_config_reloads_total{result}`.
    pub metrics: Metrics,
}

impl Reloader {
    /// One reload: load, validate, diff, then (under the mutation gate, on a blocking thread)
    /// [`CubeVsDataplane::update_always_denied`]: insert the new entries, delete the old ones,
    /// delete sessions toward the newly listed entries. Logs and counts the outcome.
    pub async fn reload(&self) -> Outcome {
        let out = self.reload_inner().await;
        let result = match &out {
            Outcome::NoFile => {
                tracing::warn!("SIGHUP: the agent runs without --config, nothing to reload");
                "no_file"
            }
            Outcome::Invalid(e) => {
                tracing::error!(error = %e, "SIGHUP: configuration invalid; always_denied_cidrs unchanged");
                "invalid"
            }
            Outcome::HandedOver => {
                tracing::info!("SIGHUP: handed over; the successor owns the always-denied list");
                "handed_over"
            }
            Outcome::Failed(e) => {
                tracing::error!(error = %e, "SIGHUP: writing always_denied_cidrs failed");
                "failed"
            }
            Outcome::Applied { list, sessions_deleted, restart_keys } => {
                for k in restart_keys {
                    tracing::warn!(key = %k, "SIGHUP: config key changed, needs a restart (not applied)");
                }
                tracing::info!(always_denied = ?list, sessions_deleted, "SIGHUP: node always-denied list reloaded");
                "applied"
            }
        };
        self.metrics.config_reloads.with_label_values(&[result]).inc();
        out
    }

    async fn reload_inner(&self) -> Outcome {
        let Some(load) = &self.load else { return Outcome::NoFile };
        let new = match load().and_then(|c| c.validate().map_err(|e| e.to_string())) {
            Ok(v) => v,
            Err(e) => return Outcome::Invalid(e),
        };
        let restart_keys = restart_keys(&self.running.raw, &new.raw);
        let _guard = match self.gate.enter().await {
            Entry::Here(g) => g,
            _ => return Outcome::HandedOver,
        };
        let (dp, list) = (self.dp.clone(), new.always_denied.clone());
        match tokio::task::spawn_blocking(move || dp.update_always_denied(&list)).await {
            Ok(Ok(sessions_deleted)) => {
                Outcome::Applied { list: new.raw.always_denied_cidrs, sessions_deleted, restart_keys }
            }
            Ok(Err(e)) => Outcome::Failed(e.to_string()),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_other_changed_keys_need_a_restart() {
        let old = Config::default();
        let mut new = Config::default();
        assert!(restart_keys(&old, &new).is_empty());
        new.always_denied_cidrs = vec!["10.0.0.0/8".into()];
        assert!(restart_keys(&old, &new).is_empty(), "the list is applied, not a restart key");
        new.tap_init_num = 7;
        new.allowed_peer_uids = vec![1001];
        assert_eq!(restart_keys(&old, &new), ["allowed_peer_uids", "tap_init_num"]);
    }
}
