//! The demo's flow with one guest, through the same driver code as `scripts/demo.sh`: the
//! agent started by its script, Ensure over gRPC, the TAP fd over the fd socket, a real Linux
//! guest under QEMU configured from the Ensure response, its checks (HTTP and DNS from world,
//! private range refused, cube-dev refused), what world saw, Release and full cleanup.

use cubenet_tests::{netns::leftover_namespaces, require_root, vm::GuestImage};

#[test]
fn demo_flow_with_one_guest() {
    if !require_root("demo_flow_with_one_guest") {
        return;
    }
    if GuestImage::for_test("demo_flow_with_one_guest").is_none() {
        return;
    }
    let opts = cubenet_demo::Options { guests: 1, profile: "debug".into(), keep: false, verbose: true };
    let report = cubenet_demo::run(&opts).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("{}", report.table());
    assert!(report.passed(), "{}", report.table());
    // One sandbox: Ensure, boot, 6 guest checks, 3 world-side checks, cube-dev, Release.
    assert_eq!(report.rows.len(), 13, "{}", report.table());
    assert!(
        report.rows.iter().any(|r| r.check.starts_with("DNS ") && r.detail == "198.51.100.1"),
        "{}",
        report.table()
    );
    assert!(leftover_namespaces().is_empty(), "{:?}", leftover_namespaces());
}
