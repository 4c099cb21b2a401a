//! FQDN allow by DNS learning (issue 11), under `BPF_PROG_TEST_RUN` with exact frames: a
//! guest query for an allowed name is tracked, the matching response's A records become
//! learned entries with exact keys and expiries, learned entries admit new flows, expire,
//! are reaped, and go on Release; spoofed, unsolicited, disallowed and truncated cases leave
//! exactly the map state and counters stated.

use std::net::Ipv4Addr;

use cubenet_tests::{
    dns::{self, Owner, a, cname},
    frames::{Tcp as T, tcp, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX, VERSION},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{
    EgressPolicy,
    policy::{FqdnAllow, FqdnPattern, LearnedEntry},
    reaper::monotonic_ns,
    testrun::{TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT},
};
use cubevs_common::{
    counter,
    dns::{QUERY_TIMEOUT_NS, TTL_FLOOR_S, name_hash, pattern_tag},
};

/// The resolver (the world's address: routed, and allowed by the policies below).
const RESOLVER: [u8; 4] = WORLD_IP;
/// Addresses the answers hand out (TEST-NET-3, denied by the policies below).
const ADDR1: [u8; 4] = [203, 0, 113, 10];
const ADDR2: [u8; 4] = [203, 0, 113, 11];
const S: u64 = 1_000_000_000;

fn fqdn(name: &str, ports: &[u32]) -> FqdnAllow {
    FqdnAllow { name: name.into(), ports: ports.to_vec() }
}

/// Internet off; the resolver allowed by CIDR; `api.example.com` (any port) and
/// `*.cdn.example` (443 only) allowed by name.
fn closed_policy() -> EgressPolicy {
    EgressPolicy {
        allow_internet_access: false,
        allow_out: vec![format!("{}/32", Ipv4Addr::from(RESOLVER))],
        allow_fqdn: vec![fqdn("api.example.com", &[]), fqdn("*.cdn.example", &[443])],
        ..Default::default()
    }
}

/// Sends a guest DNS query from `gport`; returns the SNAT port it left on.
fn send_query(r: &Rig, gport: u16, msg: &[u8]) -> u16 {
    let out = r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, RESOLVER, gport, 53, msg));
    assert_eq!(out.verdict, TC_ACT_REDIRECT, "query forwarded");
    let s = r.maps.sessions.list().unwrap();
    s.iter().find(|s| s.guest_port == gport && s.remote_port == 53).expect("dns session").snat_port
}

/// Delivers a response from `server`:`sport` to the SNAT port; returns the verdict and frame.
fn send_response(r: &Rig, server: [u8; 4], sport: u16, snat_port: u16, msg: &[u8]) -> (u32, Vec<u8>) {
    let out = r.world(udp(r.world_mac, r.up_mac, server, NODE_IP, sport, snat_port, msg));
    (out.verdict, out.data)
}

/// A guest SYN to `dst`:`dport` from `gport`: true when it left SNATed (allowed), false when
/// answered with a RST (denied).
fn syn_allowed(r: &Rig, gport: u16, dst: [u8; 4], dport: u16) -> bool {
    let syn = T { sport: gport, dport, seq: 1, syn: true, win: 1000, ..Default::default() };
    let out = r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, dst, syn, b""));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    // SNATed frames leave with the node address as source; a RST goes back to the guest.
    out.data[26..30] == NODE_IP
}

fn learned(r: &Rig) -> Vec<(Ipv4Addr, u16)> {
    r.maps.policy.learned(Some(SB_IFINDEX)).iter().map(|e| (e.ip, e.port)).collect()
}

#[test]
fn allowed_name_is_learned_with_ttl_floor_admits_flows_expires_and_goes_on_release() {
    if !require_root("allowed_name_is_learned_with_ttl_floor_admits_flows_expires_and_goes_on_release") {
        return;
    }
    let r = Rig::with_policy(&closed_policy());
    assert!(!syn_allowed(&r, 41000, ADDR1, 443), "denied before learning");
    assert_eq!(r.counter(counter::CUBE_DENY), 1);

    // The query (mixed case: names match case-insensitively) is tracked with exact fields.
    let t0 = monotonic_ns();
    let snat = send_query(&r, 40000, &dns::query(0x1111, "API.Example.com"));
    let t1 = monotonic_ns();
    assert_eq!(r.counter(counter::DNS_QUERY_TRACKED), 1);
    let q = r.maps.policy.dns_queries(Some(SB_IFINDEX));
    assert_eq!(q.len(), 1);
    let (k, v) = q[0];
    assert_eq!(
        (k.ifindex, k.server_ip, k.guest_port, k.id, k.version),
        (SB_IFINDEX, u32::from_ne_bytes(RESOLVER), 40000u16.to_be(), 0x1111, VERSION)
    );
    assert_eq!(v.name_hash, name_hash("api.example.com"));
    assert_eq!(v.allow.port_count, 0, "any port");
    assert!((t0 + QUERY_TIMEOUT_NS..=t1 + QUERY_TIMEOUT_NS).contains(&v.expires_ns));

    // The response (TTL 0) is learned with the floor, consumed, and still delivered.
    let resp = dns::response(0x1111, "api.example.com", &[a(Owner::Question, ADDR1, 0)]);
    let t0 = monotonic_ns();
    let (verdict, frame) = send_response(&r, RESOLVER, 53, snat, &resp);
    let t1 = monotonic_ns();
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(&frame[42..], &resp[..], "payload untouched");
    let l = r.maps.policy.learned(Some(SB_IFINDEX));
    assert_eq!(l.len(), 1, "{l:?}");
    let e: LearnedEntry = l[0];
    assert_eq!((e.ifindex, e.ip, e.port, e.version), (SB_IFINDEX, Ipv4Addr::from(ADDR1), 0, VERSION));
    // The matched pattern's tag (N8): what the agent names the entry by; never 0.
    let api = FqdnPattern { name: "api.example.com".into(), subdomains: false, ports: vec![] };
    assert_eq!(e.tag, pattern_tag(name_hash("api.example.com"), false));
    assert!(e.tag != 0 && e.tag == api.tag());
    assert_eq!(v.allow.tag, e.tag, "the tracked query carried the tag");
    let floor = TTL_FLOOR_S as u64 * S;
    assert!((t0 + floor..=t1 + floor).contains(&e.expires_ns), "TTL 0 floored to {TTL_FLOOR_S} s");
    assert!(r.maps.policy.dns_queries(None).is_empty(), "one response per query");
    assert_eq!(r.counter(counter::DNS_RESP_LEARNED), 1);

    // A new flow to the learned address is allowed on any port; others stay denied.
    assert!(syn_allowed(&r, 41001, ADDR1, 443));
    assert!(syn_allowed(&r, 41002, ADDR1, 8080));
    assert!(!syn_allowed(&r, 41003, ADDR2, 443));
    assert_eq!(r.counter(counter::DNS_LEARNED_FLOW), 2);

    // A second identical response is unsolicited: nothing changes.
    let (verdict, _) = send_response(&r, RESOLVER, 53, snat, &resp);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(r.counter(counter::DNS_RESP_UNSOLICITED), 1);
    assert_eq!(r.maps.policy.learned(None), l);

    // Expiry: the reaper keeps it until its expiry, then deletes it; new flows are denied
    // again (the sessions already open keep their verdict).
    assert_eq!(r.maps.policy.reap_dns(e.expires_ns - 1).unwrap().learned, 0);
    assert_eq!(r.maps.policy.reap_dns(e.expires_ns).unwrap().learned, 1);
    assert!(learned(&r).is_empty());
    assert!(!syn_allowed(&r, 41004, ADDR1, 443));

    // Learn again, then Release (the agent resets the interface to the default deny):
    // the learned entries go with the patterns. `remove` does the same.
    let snat = send_query(&r, 40001, &dns::query(0x1112, "api.example.com"));
    send_response(&r, RESOLVER, 53, snat, &dns::response(0x1112, "api.example.com", &[a(Owner::Question, ADDR1, 60)]));
    assert_eq!(learned(&r), [(Ipv4Addr::from(ADDR1), 0)]);
    r.maps.policy.install_default_deny(SB_IFINDEX).unwrap();
    assert!(learned(&r).is_empty(), "Release removes learned entries");
    r.maps.policy.replace(SB_IFINDEX, &closed_policy()).unwrap();
    let snat = send_query(&r, 40002, &dns::query(0x1113, "api.example.com"));
    send_response(&r, RESOLVER, 53, snat, &dns::response(0x1113, "api.example.com", &[a(Owner::Question, ADDR1, 60)]));
    assert_eq!(learned(&r).len(), 1);
    // An unrelated replace with the same patterns keeps them; changing the patterns drops them.
    let mut same = closed_policy();
    same.allow_out.push("192.0.2.0/24".into());
    r.maps.policy.replace(SB_IFINDEX, &same).unwrap();
    assert_eq!(learned(&r).len(), 1, "same FQDN patterns: kept");
    r.maps.policy.remove(SB_IFINDEX).unwrap();
    assert!(learned(&r).is_empty());
}

#[test]
fn cname_chain_several_answers_compression_pointers_and_ports() {
    if !require_root("cname_chain_several_answers_compression_pointers_and_ports") {
        return;
    }
    let r = Rig::with_policy(&closed_policy());
    // `*.cdn.example` allows `www.cdn.example` (443 only) but not the apex.
    let snat = send_query(&r, 40000, &dns::query(0x2001, "www.cdn.example"));
    let resp = dns::response(
        0x2001,
        "www.cdn.example",
        &[
            cname(Owner::Question, "edge.other-cdn.net", 30),
            a(Owner::PrevTarget, ADDR1, 3600),
            a(Owner::Name("edge.other-cdn.net".into()), ADDR2, 7200),
        ],
    );
    let t0 = monotonic_ns();
    assert_eq!(send_response(&r, RESOLVER, 53, snat, &resp).0, TC_ACT_REDIRECT);
    let t1 = monotonic_ns();
    let l = r.maps.policy.learned(Some(SB_IFINDEX));
    let got: Vec<_> = l.iter().map(|e| (e.ip, e.port)).collect();
    assert_eq!(got, [(Ipv4Addr::from(ADDR1), 443), (Ipv4Addr::from(ADDR2), 443)]);
    assert!((t0 + 3600 * S..=t1 + 3600 * S).contains(&l[0].expires_ns), "TTL kept above the floor");
    assert!((t0 + 7200 * S..=t1 + 7200 * S).contains(&l[1].expires_ns));
    assert_eq!(r.counter(counter::DNS_RESP_LEARNED), 2);
    assert!(syn_allowed(&r, 41000, ADDR2, 443));
    assert!(!syn_allowed(&r, 41001, ADDR2, 80), "only the pattern's port");

    // The apex is not covered by `*.`; a sibling suffix is not either.
    send_query(&r, 40001, &dns::query(0x2002, "cdn.example"));
    send_query(&r, 40002, &dns::query(0x2003, "wwwcdn.example"));
    assert_eq!(r.counter(counter::DNS_QUERY_NOT_ALLOWED), 2);
    assert_eq!(r.counter(counter::DNS_QUERY_TRACKED), 1);
}

#[test]
fn truncated_response_learns_its_complete_records() {
    if !require_root("truncated_response_learns_its_complete_records") {
        return;
    }
    let r = Rig::with_policy(&closed_policy());
    let snat = send_query(&r, 40000, &dns::query(0x3001, "api.example.com"));
    let mut resp = dns::message(
        0x3001,
        dns::RESPONSE_FLAGS | dns::TC,
        "api.example.com",
        dns::A,
        &[a(Owner::Question, ADDR1, 600), a(Owner::Question, ADDR2, 600)],
    );
    // Cut inside the second record, as a truncating server may.
    resp.truncate(resp.len() - 2);
    assert_eq!(send_response(&r, RESOLVER, 53, snat, &resp).0, TC_ACT_REDIRECT);
    assert_eq!(learned(&r), [(Ipv4Addr::from(ADDR1), 0)]);
    assert_eq!(r.counter(counter::DNS_RESP_TRUNCATED), 1);
    assert_eq!(r.counter(counter::DNS_NOT_WALKED), 1);
}

#[test]
fn unsolicited_spoofed_and_disallowed_responses_learn_nothing() {
    if !require_root("unsolicited_spoofed_and_disallowed_responses_learn_nothing") {
        return;
    }
    let r = Rig::with_policy(&closed_policy());
    let evil = |id| dns::response(id, "evil.test", &[a(Owner::Question, ADDR2, 600)]);

    // A name no pattern allows: forwarded, not tracked; its answer is not learned.
    let snat_evil = send_query(&r, 40000, &dns::query(0x4001, "evil.test"));
    assert_eq!(r.counter(counter::DNS_QUERY_NOT_ALLOWED), 1);
    assert!(r.maps.policy.dns_queries(None).is_empty());
    assert_eq!(send_response(&r, RESOLVER, 53, snat_evil, &evil(0x4001)).0, TC_ACT_REDIRECT);
    assert_eq!(r.counter(counter::DNS_RESP_UNSOLICITED), 1);

    // AAAA and malformed queries are forwarded untracked.
    let aaaa = dns::message(0x4002, dns::QUERY_FLAGS, "api.example.com", dns::AAAA, &[]);
    send_query(&r, 40001, &aaaa);
    send_query(&r, 40002, &[0x12, 0x34, 0x01]);
    assert_eq!(r.counter(counter::DNS_QUERY_UNPARSED), 2);

    // A tracked query; then the spoofs.
    let snat = send_query(&r, 40003, &dns::query(0x4003, "api.example.com"));
    let good = dns::response(0x4003, "api.example.com", &[a(Owner::Question, ADDR1, 600)]);
    // Wrong id.
    let wrong_id = dns::response(0x4004, "api.example.com", &[a(Owner::Question, ADDR2, 600)]);
    assert_eq!(send_response(&r, RESOLVER, 53, snat, &wrong_id).0, TC_ACT_REDIRECT);
    assert_eq!(r.counter(counter::DNS_RESP_UNSOLICITED), 2);
    // Right id, another question: mismatch, the query stays tracked.
    assert_eq!(send_response(&r, RESOLVER, 53, snat, &evil(0x4003)).0, TC_ACT_REDIRECT);
    assert_eq!(r.counter(counter::DNS_RESP_MISMATCH), 1);
    assert_eq!(r.maps.policy.dns_queries(None).len(), 1);
    // Another server, or another source port: no session matches, passed to the host,
    // never parsed.
    let pass0 = r.counter(counter::WORLD_PASS);
    assert_eq!(send_response(&r, [198, 51, 100, 9], 53, snat, &good).0, TC_ACT_OK);
    assert_eq!(send_response(&r, RESOLVER, 5353, snat, &good).0, TC_ACT_OK);
    assert_eq!(r.counter(counter::WORLD_PASS), pass0 + 2);
    assert!(learned(&r).is_empty(), "nothing learned from spoofs");

    // An error answer consumes the query and learns nothing.
    let nx = dns::message(0x4003, dns::RESPONSE_FLAGS | dns::NXDOMAIN, "api.example.com", dns::A, &[]);
    assert_eq!(send_response(&r, RESOLVER, 53, snat, &nx).0, TC_ACT_REDIRECT);
    assert_eq!(r.counter(counter::DNS_RESP_RCODE), 1);
    assert!(r.maps.policy.dns_queries(None).is_empty());
    // ... so the genuine answer arriving late is unsolicited.
    send_response(&r, RESOLVER, 53, snat, &good);
    assert_eq!(r.counter(counter::DNS_RESP_UNSOLICITED), 3);
    assert!(learned(&r).is_empty());
    assert_eq!(r.counter(counter::DNS_RESP_LEARNED), 0);

    // The genuine exchange still works afterwards.
    let snat = send_query(&r, 40004, &dns::query(0x4005, "api.example.com"));
    send_response(&r, RESOLVER, 53, snat, &dns::response(0x4005, "api.example.com", &[a(Owner::Question, ADDR1, 600)]));
    assert_eq!(learned(&r), [(Ipv4Addr::from(ADDR1), 0)]);
}

#[test]
fn dns_to_a_denied_resolver_stays_denied() {
    if !require_root("dns_to_a_denied_resolver_stays_denied") {
        return;
    }
    // The name is allowed, the resolver is not: the query is dropped by the CIDR policy and
    // never tracked.
    let p = EgressPolicy {
        allow_internet_access: false,
        allow_fqdn: vec![fqdn("api.example.com", &[])],
        ..Default::default()
    };
    let r = Rig::with_policy(&p);
    let out =
        r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, RESOLVER, 40000, 53, &dns::query(0x5001, "api.example.com")));
    assert_eq!(out.verdict, TC_ACT_SHOT);
    assert_eq!(r.counter(counter::CUBE_DENY), 1);
    assert_eq!(r.counter(counter::DNS_QUERY_TRACKED), 0);
    assert!(r.maps.policy.dns_queries(None).is_empty());
    assert!(r.maps.sessions.list().unwrap().is_empty());
}

/// L7 steering: an FQDN entry that an L7 rule names (`match.host`) makes its learned
/// addresses L7. A new TCP flow to such an address on 443/80 leaves unchanged but for the
/// source (the sandbox IP, which the gateway keys on) with upstream's mark under its mask,
/// into cube-dev; its session records the class (no SNAT: identity address and port) and
/// keeps it for the flow's life, even after the learned entry is gone. Other ports take the
/// plain SNAT path. CubeEgress's replies through `from_envoy` advance the session's state.
#[test]
fn l7_names_are_steered_with_the_mark_and_keep_their_class() {
    if !require_root("l7_names_are_steered_with_the_mark_and_keep_their_class") {
        return;
    }
    use cubenet_tests::rig::SB_IP;
    use cubevs::prog;
    use cubevs_common::l7;
    let rule: egress_policy::RuleSpec = serde_json::from_value(serde_json::json!({
        "id": "api", "match": {"host": "API.example.com."}, "action": {"allow": true}
    }))
    .unwrap();
    let mut p = closed_policy();
    p.rules = vec![rule];
    let r = Rig::with_policy(&p);
    let snat = send_query(&r, 40000, &dns::query(0x6001, "api.example.com"));
    send_response(&r, RESOLVER, 53, snat, &dns::response(0x6001, "api.example.com", &[a(Owner::Question, ADDR1, 600)]));
    let l = r.maps.policy.learned(Some(SB_IFINDEX));
    assert_eq!(l.len(), 1);
    assert!(l[0].l7, "learned under an L7 pattern");
    // `*.cdn.example` is not named by a rule: plain.
    let snat = send_query(&r, 40001, &dns::query(0x6002, "x.cdn.example"));
    send_response(&r, RESOLVER, 53, snat, &dns::response(0x6002, "x.cdn.example", &[a(Owner::Question, ADDR2, 600)]));
    let cdn = r.maps.policy.learned(Some(SB_IFINDEX)).into_iter().find(|e| e.ip == Ipv4Addr::from(ADDR2)).unwrap();
    assert!(!cdn.l7);
    // Tagged with the wildcard pattern, not the queried name.
    assert_eq!(cdn.tag, FqdnPattern { name: "cdn.example".into(), subdomains: true, ports: vec![443] }.tag());
    assert_ne!(cdn.tag, l[0].tag);

    let seg =
        |dst, dport, t: T| tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, dst, T { sport: 41000, dport, win: 1000, ..t }, b"");
    let steered =
        |dst, dport, t: T| tcp(GUEST_MAC, GATEWAY_MAC, SB_IP, dst, T { sport: 41000, dport, win: 1000, ..t }, b"");
    let syn = T { seq: 1, syn: true, ..Default::default() };

    // HTTPS: marked 0xCE02xxxx, source = sandbox IP, nothing else changed, to cube-dev.
    let out = r.cube(seg(ADDR1, 443, syn));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(out.data, steered(ADDR1, 443, syn));
    assert_eq!(out.mark, l7::MARK_HTTPS);
    assert_eq!(r.counter(counter::CUBE_L7_NEW), 1);
    let s = r.maps.sessions.list().unwrap();
    let s = s.iter().find(|s| s.remote_port == 443).unwrap();
    assert_eq!(
        (s.state, s.snat_ip, s.snat_port, s.remote_ip),
        ("syn_sent", Ipv4Addr::from(SB_IP), 41000, Ipv4Addr::from(ADDR1)),
        "identity, no SNAT"
    );

    // CubeEgress answers (IP_TRANSPARENT: source = the original destination) through
    // from_envoy: delivered to the guest, session state advanced.
    let synack = T { seq: 900, ack: Some(2), syn: true, ..Default::default() };
    let reply = tcp(r.world_mac, r.up_mac, ADDR1, SB_IP, T { sport: 443, dport: 41000, win: 1000, ..synack }, b"");
    let out = r.run(prog::FROM_ENVOY, reply, 0);
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(r.counter(counter::ENVOY_L7_REPLY), 1);
    let state = |r: &Rig| r.maps.sessions.list().unwrap().iter().find(|s| s.remote_port == 443).unwrap().state;
    assert_eq!(state(&r), "syn_recv");

    // The flow keeps its class after the learned entry is gone.
    r.maps.policy.purge_learned(SB_IFINDEX).unwrap();
    let ack = T { seq: 2, ack: Some(901), ..Default::default() };
    let out = r.cube(seg(ADDR1, 443, ack));
    assert_eq!((out.verdict, out.mark), (TC_ACT_REDIRECT, l7::MARK_HTTPS));
    assert_eq!(out.data, steered(ADDR1, 443, ack));
    assert_eq!(state(&r), "established");

    // Learn again: HTTP gets the HTTP mark; another port of the same address goes out SNATed.
    let snat = send_query(&r, 40002, &dns::query(0x6003, "api.example.com"));
    send_response(&r, RESOLVER, 53, snat, &dns::response(0x6003, "api.example.com", &[a(Owner::Question, ADDR1, 600)]));
    let out = r.cube(seg(ADDR1, 80, syn));
    assert_eq!((out.verdict, out.mark), (TC_ACT_REDIRECT, l7::MARK_HTTP));
    let out = r.cube(seg(ADDR1, 8080, syn));
    assert_eq!((out.verdict, out.mark), (TC_ACT_REDIRECT, 0));
    assert_eq!(out.data[26..30], NODE_IP, "plain SNAT");
    // A plain (non-L7) learned address is SNATed on 443.
    let snat = send_query(&r, 40003, &dns::query(0x6004, "x.cdn.example"));
    send_response(&r, RESOLVER, 53, snat, &dns::response(0x6004, "x.cdn.example", &[a(Owner::Question, ADDR2, 600)]));
    let out = r.cube(seg(ADDR2, 443, syn));
    assert_eq!((out.verdict, out.mark), (TC_ACT_REDIRECT, 0));
    assert_eq!(out.data[26..30], NODE_IP);
    assert_eq!(r.counter(counter::CUBE_L7_NEW), 2);
}
