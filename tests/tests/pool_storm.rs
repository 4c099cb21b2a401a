//! The TAP pool under an Ensure → TAP fd → Release storm (found by the upgrade adversary):
//! 8 clients back to back, each keeping its 2 newest sandboxes and releasing the older ones,
//! as a busy cubelet does. Each released TAP waits in Cleaning for its free check; an Ensure
//! that finds no Ready TAP reclaims released ones itself (T2). Before T3 the clients' Ensures
//! all chose the same first two released TAPs, all but one failed to claim them and each
//! created a new TAP instead: the pool grew by ~1 TAP per 5 Ensures and a /24 ran out of
//! addresses within seconds (Ensure `RESOURCE_EXHAUSTED`).
//!
//! Property held: the pool stays bounded by what the clients hold (counted, not timed) and
//! no Ensure fails.

use std::{
    collections::VecDeque,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    require_root,
};

const CLIENTS: usize = 8;
/// Sandboxes each client keeps alive.
const KEEP: usize = 2;
const POOL: usize = 4;
/// Ensures the storm makes in all (before T3 the pool had grown past [`MAX_TAPS`] after ~350).
const ENSURES: u64 = 1_200;
/// What the clients can hold at once (kept + in flight + one being released each), the pool's
/// Ready TAPs and as many again Cleaning: any more is growth.
const MAX_TAPS: usize = 2 * (CLIENTS * (KEEP + 2) + POOL);

#[test]
fn an_ensure_release_storm_reuses_released_taps() {
    if !require_root("pool_storm") {
        return;
    }
    let mut a = AgentUnderTest::prepare("poolstorm", POOL, "");
    a.start();
    let stop = Arc::new(AtomicBool::new(false));
    let ensured = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|k| {
            let (ep, sock) = (a.grpc_endpoint(), a.tap_socket());
            let (stop, ensured, failed) = (stop.clone(), ensured.clone(), failed.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async move {
                    let mut c = network_agent::client::connect(&ep).await.unwrap();
                    let mut kept = VecDeque::new();
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) && ensured.load(Ordering::Relaxed) < ENSURES {
                        let id = format!("c{k}-{n}");
                        n += 1;
                        let req = pb::EnsureNetworkRequest { sandbox_id: id.clone(), ..Default::default() };
                        let r = match c.ensure_network(req).await {
                            Ok(r) => r.into_inner(),
                            Err(e) => {
                                eprintln!("Ensure {id}: {e}");
                                failed.fetch_add(1, Ordering::Relaxed);
                                return;
                            }
                        };
                        // The VMM takes the fd and is done with it before the Release.
                        let (reply, fd) = tap_fd(&sock, &r.interfaces[0].name, &id);
                        assert_eq!(reply["errCode"], "0", "{reply}");
                        drop(fd);
                        ensured.fetch_add(1, Ordering::Relaxed);
                        kept.push_back(id);
                        if kept.len() > KEEP {
                            let old = kept.pop_front().unwrap();
                            let req = pb::ReleaseNetworkRequest { sandbox_id: old.clone(), ..Default::default() };
                            if let Err(e) = c.release_network(req).await {
                                eprintln!("Release {old}: {e}");
                                failed.fetch_add(1, Ordering::Relaxed);
                                return;
                            }
                        }
                    }
                })
            })
        })
        .collect();

    let (t, mut most) = (Instant::now(), 0);
    while ensured.load(Ordering::Relaxed) < ENSURES && failed.load(Ordering::Relaxed) == 0 {
        assert!(t.elapsed() < Duration::from_secs(180), "storm stalled at {} Ensures", ensured.load(Ordering::Relaxed));
        let taps = a.http_json("/v1/network/taps")["taps"].as_array().map_or(0, Vec::len);
        most = most.max(taps);
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let taps = a.http_json("/v1/network/taps")["taps"].as_array().map_or(0, Vec::len);
    most = most.max(taps);
    eprintln!("{} Ensures in {:?}; most TAPs {most}, at the end {taps}", ensured.load(Ordering::Relaxed), t.elapsed());
    assert_eq!(failed.load(Ordering::Relaxed), 0, "calls failed during the storm (see above)");
    assert!(most <= MAX_TAPS, "the pool grew to {most} TAPs (bound {MAX_TAPS}) under the storm");
}
