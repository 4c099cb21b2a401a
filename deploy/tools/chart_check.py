#!/usr/bin/env python3
"""Offline checks and local-run conversion of the cubenet Helm chart (deploy/helm/cubenet).

No cluster exists here, so the chart is rendered with Helm's SDK (PyPI helm-python-sdk 0.2.2,
Helm v4 as a C library) and checked in three layers:

1. `helm lint` and render, for every mode x CA-mode variant (plus values that must be refused);
2. `kubernetes-validate --strict` (bundled OpenAPI schemas) on every rendered object;
3. our asserts for what schemas miss: probe handlers, hostPath types, mount propagation
   values, no maxSurge with hostPort, volumes <-> mounts, the seed's mounts, config keys the
   binaries really read, the CIDR passed to every consumer, upstream's chart defects;
4. every value of values.yaml documented with its default in the chart's README.

Usage:
  chart_check.py check OUT_DIR            all variants; writes OUT_DIR/<variant>/*.yaml and the
                                          rendered config.toml per variant; exit 1 on a failure
  chart_check.py pod OUT_DIR VALUES_JSON [POD_NAME]
                                          render with VALUES_JSON (a JSON object merged over the
                                          defaults) and write OUT_DIR/pod.yaml: the DaemonSet's
                                          template as a Pod for `podman kube play` (podman 4.3
                                          takes no DaemonSet), ConfigMap and Secret volumes
                                          materialised as host directories under OUT_DIR, ports
                                          dropped (a pod on `--network none` maps none),
                                          init containers of podman's type "always", emptyDirs
                                          host directories under OUT_DIR (one per pod), the
                                          downward API's metadata.uid a fresh uuid, the Pod
                                          named POD_NAME (default: the DaemonSet's name).
"""

import base64
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHART = os.path.join(ROOT, "deploy", "helm", "cubenet")
KUBE_VERSION = "1.32.0"

HOSTPATH_TYPES = {"", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"}
PROPAGATION = {"None", "HostToContainer", "Bidirectional"}
PROBE_HANDLERS = ("exec", "httpGet", "tcpSocket", "grpc")
# The seed's network-agent mounts (container paths), DESIGN.md / upstream.md §5.
SEED_AGENT_MOUNTS = {"/tmp/cube", "/dev/net/tun", "/sys/fs/bpf", "/var/lib/cubenet/state", "/data/log/network-agent", "/etc/cubenet"}

# Fields of monitoring.coreos.com/v1 PodMonitor the chart may use (prometheus-operator API).
PODMONITOR_SPEC = {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels", "sampleLimit"}
PODMONITOR_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels", "relabelings", "metricRelabelings"}

VARIANTS = {
    "underlay-selfsigned": {"mode": "underlay"},
    "overlay-selfsigned": {"mode": "overlay", "allowedPeerUids": [1001, 65534]},
    "underlay-existing-secret": {"mode": "underlay", "egress": {"ca": {"mode": "existingSecret", "existingSecret": "my-ca"}}},
    "overlay-existing-secret": {"mode": "overlay", "egress": {"ca": {"mode": "existingSecret", "existingSecret": "my-ca"}},
                                "agent": {"healthPort": 19190}, "hostPaths": {"bpffsSubdir": "cubevs-b"}},
    "underlay-named-netns-no-egress": {"mode": "underlay", "underlay": {"netnsPath": "/run/netns/node0"}, "egress": {"enabled": False},
                                       "metrics": {"podMonitor": {"enabled": True}}},
    # The scrape target (O26) with a gateway admin port of its own.
    "underlay-podmonitor": {"mode": "underlay", "egress": {"adminPort": 9191},
                            "metrics": {"podMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kube-prometheus"}}}},
    # The pre-K15 rollout: no surge, no hand-over, the health hostPort.
    "underlay-no-surge-hostport": {"mode": "underlay", "underlay": {"surge": False, "healthHostPort": 19090}},
}
# Values the chart must refuse, with a fragment of the expected message.
REFUSED = {
    "bad-mode": ({"mode": "bridge"}, "mode must be underlay or overlay"),
    "no-cube-role": ({"nodeSelector": {"cube-role": None, "kubernetes.io/os": "linux"}}, "cube-role"),
    "bad-cidr": ({"cidr": "192.168.0.0/8"}, "/16../24"),
    "max-surge-without-handover": ({"underlay": {"surge": False}, "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}}, "maxSurge must be 0 without underlay.surge"),
    "max-surge-overlay": ({"mode": "overlay", "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}}, "maxSurge must be 0 in overlay mode"),
    "surge-with-hostport": ({"underlay": {"healthHostPort": 19090}}, "underlay.surge needs underlay.healthHostPort: null"),
    "surge-not-boolean": ({"underlay": {"surge": "yes"}}, "surge"),
    "existing-secret-unnamed": ({"egress": {"ca": {"mode": "existingSecret"}}}, "existingSecret"),
    "drain-vs-grace": ({"egress": {"drainTimeoutSecs": 40}}, "drainTimeoutSecs"),
    "agent-log-format": ({"agent": {"logFormat": "xml"}}, "agent.logFormat must be json or text"),
    "egress-log-format": ({"egress": {"logFormat": "logfmt"}}, "egress.logFormat must be json or text"),
    "peer-uid-name": ({"allowedPeerUids": ["cubelet"]}, "allowedPeerUids must hold numeric uids"),
    # What the agent and CubeEgress would refuse at start, refused at render (O22).
    "always-denied-bad-prefix": ({"alwaysDeniedCidrs": ["100.100.100.200/32", "10.0.0.5/33"]}, "alwaysDeniedCidrs entry \"10.0.0.5/33\""),
    "always-denied-name": ({"alwaysDeniedCidrs": ["metadata.internal"]}, "must be an IPv4 address or CIDR"),
    "always-denied-not-a-list": ({"alwaysDeniedCidrs": "10.0.0.5"}, "/alwaysDeniedCidrs': got string, want array"),
    # The agent's O16 port checks, at render time (the rendered config would crash-loop).
    "host-ports-in-snat-range": ({"agent": {"hostPortRange": "20000-40000"}}, "must end below 30000"),
    "ephemeral-over-host-ports": ({"agent": {"ipLocalPortRange": "20000 25000"}}, "agent.ipLocalPortRange \"20000 25000\" overlaps"),
    "ephemeral-in-snat-range": ({"agent": {"ipLocalPortRange": "32768 60999"}}, "or the SNAT ports 30000-65535"),
    # values.schema.json: a typo'd value is refused, not silently ignored (O13).
    "typo-value": ({"agent": {"tapInitNm": 5}}, "additional properties 'tapInitNm' not allowed"),
    "podmonitor-interval": ({"metrics": {"podMonitor": {"enabled": True, "interval": "30"}}}, "interval"),
    "typo-top-level": ({"alwaysDeniedCidr": ["10.0.0.5"]}, "additional properties 'alwaysDeniedCidr' not allowed"),
}


def _ds(objs):
    return next(o for o in objs if o["kind"] == "DaemonSet")


def _agent(objs):
    return next(c for c in _ds(objs)["spec"]["template"]["spec"]["containers"] if c["name"] == "network-agent")


def _podmonitor(objs):
    return next(o for o in objs if o["kind"] == "PodMonitor")


def _cm(objs):
    return next(o for o in objs if o["kind"] == "ConfigMap")


# Defects the asserts must catch (each applied to a good rendering, of the variant named third
# or underlay-selfsigned; proves the asserts bite).
MUTATIONS = {
    "probe without handler": (lambda o: _agent(o)["readinessProbe"].pop("httpGet"), "has handlers []"),
    "probe on an undeclared port": (lambda o: _agent(o)["livenessProbe"]["httpGet"].update(port="metrics"), "does not declare"),
    "hostPath type typo": (lambda o: _ds(o)["spec"]["template"]["spec"]["volumes"][1]["hostPath"].update(type="CharDev"), "hostPath type"),
    "mountPropagation typo": (lambda o: _agent(o)["volumeMounts"][2].update(mountPropagation="Sideways"), "mountPropagation"),
    "maxSurge with hostPort": (lambda o: _agent(o)["ports"][0].update(hostPort=19090), "maxSurge 1 with hostPorts"),
    "mount without volume": (lambda o: _agent(o)["volumeMounts"].append({"name": "ghost", "mountPath": "/ghost"}), "undefined volume ghost"),
    "seed mount missing": (lambda o: _agent(o).update(volumeMounts=[m for m in _agent(o)["volumeMounts"] if m["mountPath"] != "/dev/net/tun"]), "seed mount /dev/net/tun"),
    "unknown config key": (lambda o: _cm(o)["data"].update({"config.toml": _cm(o)["data"]["config.toml"] + 'log_level = "x"\n'}), "does not read: ['log_level']"),
    "health on loopback": (lambda o: _cm(o)["data"].update({"config.toml": _cm(o)["data"]["config.toml"].replace("0.0.0.0:", "127.0.0.1:")}), "could never pass"),
    "hostPID + shareProcessNamespace": (lambda o: _ds(o)["spec"]["template"]["spec"].update(shareProcessNamespace=True), "hostPID and shareProcessNamespace"),
    "allowed_peer_uids dropped": (lambda o: _cm(o)["data"].update({"config.toml": _cm(o)["data"]["config.toml"].replace("allowed_peer_uids = []", "")}), "allowed_peer_uids None"),
    "cli endpoint not wired": (lambda o: _agent(o).update(env=[e for e in _agent(o)["env"] if e["name"] != "CUBENET_HTTP"]), "CUBENET_HTTP is None"),
    "surge without the agent's hand-over socket": (lambda o: _cm(o)["data"].update({"config.toml": re.sub(r"(?m)^handover_socket = .*$", "", _cm(o)["data"]["config.toml"])}), "maxSurge 1 without the agent's handover_socket"),
    "claim marker on a host path": (lambda o: [v.update(hostPath={"path": "/run/x", "type": "DirectoryOrCreate"}, emptyDir=None) or v.pop("emptyDir") for v in _ds(o)["spec"]["template"]["spec"]["volumes"] if v["name"] == "pod-run"], "must be an emptyDir"),
    "gateway hand-off socket not shared": (lambda o: [c.update(env=[dict(e, value="/run/cube-egress/egress.sock") if e["name"] == "CUBE_EGRESS_HANDOFF_SOCKET" else e for e in c["env"]]) for c in _ds(o)["spec"]["template"]["spec"]["containers"] if c["name"] == "cube-egress"], "not on the shared hand-over volume"),
    "admin url off the gateway's port": (lambda o: _cm(o)["data"].update({"config.toml": _cm(o)["data"]["config.toml"].replace("127.0.0.1:9091", "127.0.0.1:9092")}), "!= the gateway's admin address"),
    "podmonitor on an undeclared port": (lambda o: _podmonitor(o)["spec"]["podMetricsEndpoints"][1].update(port="metrics"), "the agent does not declare", "underlay-podmonitor"),
    "podmonitor endpoints share a job": (lambda o: _podmonitor(o)["spec"]["podMetricsEndpoints"][1].pop("relabelings"), "need a job each", "underlay-podmonitor"),
    "egress log format dropped": (lambda o: [c.update(env=[e for e in c["env"] if e["name"] != "CUBE_EGRESS_LOG_FORMAT"]) for c in _ds(o)["spec"]["template"]["spec"]["containers"] if c["name"] == "cube-egress-standby"], "CUBE_EGRESS_LOG_FORMAT is None"),
}


def merge(a, b):
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def render(values):
    """Renders the chart; returns (list of objects, dict path -> text)."""
    from helm_python import chart  # imported late: `pod` and `check` both need it, --help not

    files = chart.Chart.load(CHART).render(values, name="cubenet", namespace="cube-system", is_install=True)
    objs = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objs.append(doc)
    return objs, files


def struct_fields(rust_file):
    """Field names of `pub struct Config` in a Rust source (the TOML keys, deny_unknown_fields)."""
    src = open(os.path.join(ROOT, rust_file)).read()
    body = src[src.index("pub struct Config {"):]
    body = body[: body.index("\n}\n")]
    return set(re.findall(r"^\s*pub (\w+):", body, re.M))


class Checker:
    def __init__(self, variant):
        self.variant = variant
        self.errors = []

    def fail(self, msg):
        self.errors.append(f"{self.variant}: {msg}")

    def check(self, objs, values):
        by_kind = {}
        for o in objs:
            by_kind.setdefault(o["kind"], []).append(o)
        ds = by_kind.get("DaemonSet", [])
        if len(ds) != 1:
            self.fail(f"expected one DaemonSet, got {len(ds)}")
            return
        ds = ds[0]
        spec = ds["spec"]
        pod = spec["template"]["spec"]
        cms = {c["metadata"]["name"]: c for c in by_kind.get("ConfigMap", [])}
        secrets = {s["metadata"]["name"]: s for s in by_kind.get("Secret", [])}
        containers = pod.get("initContainers", []) + pod["containers"]
        names = {c["name"] for c in pod["containers"]}

        if "cube-role" not in pod.get("nodeSelector", {}):
            self.fail("nodeSelector has no cube-role")
        if pod.get("hostPID") and pod.get("shareProcessNamespace"):
            self.fail("hostPID and shareProcessNamespace together (the API server refuses it)")
        if not pod.get("hostPID") and not pod.get("shareProcessNamespace"):
            self.fail("containers do not share a PID namespace")

        # Probes have exactly one handler; named ports exist.
        for c in containers:
            ports = {p.get("name") for p in c.get("ports", [])}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(kind)
                if p is None:
                    continue
                handlers = [h for h in PROBE_HANDLERS if h in p]
                if len(handlers) != 1:
                    self.fail(f"{c['name']}.{kind} has handlers {handlers}")
                for h in ("httpGet", "tcpSocket"):
                    port = p.get(h, {}).get("port")
                    if isinstance(port, str) and port not in ports:
                        self.fail(f"{c['name']}.{kind} names port {port!r} the container does not declare")
                if "exec" in p and not p["exec"].get("command"):
                    self.fail(f"{c['name']}.{kind} exec without a command")
            for h in ("preStop", "postStart"):
                hook = c.get("lifecycle", {}).get(h)
                if hook is not None and len([k for k in ("exec", "httpGet", "tcpSocket", "sleep") if k in hook]) != 1:
                    self.fail(f"{c['name']}.lifecycle.{h} has no single handler")
        # Log formats reach the binaries (JSON lines for collectors, the chart's default).
        want_fmt = {"network-agent": ("NETWORK_AGENT_LOG_FORMAT", values["agent"]["logFormat"])}
        if values["egress"]["enabled"]:
            for slot in ("cube-egress", "cube-egress-standby")[: 2 if values["egress"]["standby"] else 1]:
                want_fmt[slot] = ("CUBE_EGRESS_LOG_FORMAT", values["egress"]["logFormat"])
        for c in pod["containers"]:
            if c["name"] in want_fmt:
                var, fmt = want_fmt[c["name"]]
                got = {e["name"]: e.get("value") for e in c.get("env", [])}.get(var)
                if got != fmt:
                    self.fail(f"{c['name']}: {var} is {got!r}, values say {fmt!r}")
        for c in pod["containers"]:
            if c["name"] != "cube-egress-net" and "readinessProbe" not in c:
                self.fail(f"{c['name']} has no readinessProbe")

        # Volumes <-> mounts, hostPath types, propagation.
        vols = {v["name"]: v for v in pod.get("volumes", [])}
        used = set()
        for c in containers:
            privileged = c.get("securityContext", {}).get("privileged", False)
            for m in c.get("volumeMounts", []):
                used.add(m["name"])
                if m["name"] not in vols:
                    self.fail(f"{c['name']} mounts undefined volume {m['name']}")
                prop = m.get("mountPropagation")
                if prop is not None and prop not in PROPAGATION:
                    self.fail(f"{c['name']}:{m['mountPath']} mountPropagation {prop!r} invalid")
                if prop == "Bidirectional" and not privileged:
                    self.fail(f"{c['name']}:{m['mountPath']} Bidirectional needs a privileged container")
        for n, v in vols.items():
            if n not in used:
                self.fail(f"volume {n} is mounted by no container")
            hp = v.get("hostPath")
            if hp is not None:
                if hp.get("type", "") not in HOSTPATH_TYPES:
                    self.fail(f"volume {n} hostPath type {hp.get('type')!r} invalid")
                if not hp.get("path", "").startswith("/"):
                    self.fail(f"volume {n} hostPath path {hp.get('path')!r} not absolute")
            for ref in ("configMap", "secret"):
                if ref in v:
                    target = v[ref].get("name") or v[ref].get("secretName")
                    if ref == "configMap":
                        if target not in cms:
                            self.fail(f"volume {n} references missing ConfigMap {target}")
                        else:
                            for it in v[ref].get("items", []):
                                if it["key"] not in cms[target]["data"]:
                                    self.fail(f"volume {n}: ConfigMap {target} has no key {it['key']}")
                    elif values["egress"]["ca"]["mode"] == "selfSigned":
                        if target not in secrets:
                            self.fail(f"volume {n} references Secret {target} the chart does not render")
                        else:
                            for it in v[ref].get("items", []):
                                if it["key"] not in secrets[target]["data"]:
                                    self.fail(f"volume {n}: Secret {target} has no key {it['key']}")
                    elif target in secrets:
                        self.fail(f"existingSecret mode renders Secret {target}")

        # Rollout: no maxSurge with hostPort; maxSurge/maxUnavailable not both 0.
        strat = spec.get("updateStrategy", {})
        host_ports = [p["hostPort"] for c in containers for p in c.get("ports", []) if p.get("hostPort")]
        ru = strat.get("rollingUpdate") or {}
        if strat.get("type", "RollingUpdate") == "RollingUpdate":
            surge, unavail = str(ru.get("maxSurge", 0)), str(ru.get("maxUnavailable", 1))
            if surge not in ("0", "0%") and host_ports:
                self.fail(f"maxSurge {surge} with hostPorts {host_ports}")
            if surge in ("0", "0%") and unavail in ("0", "0%"):
                self.fail("maxSurge and maxUnavailable both 0")
        if values["mode"] == "overlay" and not values.get("updateStrategy") and strat.get("type") != "OnDelete":
            self.fail("overlay mode must default to OnDelete (a new pod is a new netns)")
        surged = strat.get("type", "RollingUpdate") == "RollingUpdate" and str(ru.get("maxSurge", 0)) not in ("0", "0%")
        if values["mode"] == "underlay" and not values.get("updateStrategy"):
            want = ("1", "0") if values["underlay"]["surge"] else ("0", "1")
            if (str(ru.get("maxSurge")), str(ru.get("maxUnavailable"))) != want:
                self.fail(f"underlay surge={values['underlay']['surge']}: rollingUpdate {ru}, want maxSurge/maxUnavailable {want}")

        # The agent: seed mounts, config keys, health port, CIDR.
        agent = next((c for c in pod["containers"] if c["name"] == "network-agent"), None)
        if agent is None:
            self.fail("no network-agent container")
            return
        mounts = {m["mountPath"] for m in agent.get("volumeMounts", [])}
        for m in sorted(SEED_AGENT_MOUNTS - mounts):
            self.fail(f"network-agent lacks the seed mount {m}")
        env = {e["name"]: e.get("value") for e in agent.get("env", [])}
        cfg_path = env.get("NETWORK_AGENT_CONFIG", "")
        cm = next(iter(c for n, c in cms.items() if n.endswith("-config")), None)
        if cm is None or not cfg_path.endswith("/config.toml"):
            self.fail("agent config not wired (NETWORK_AGENT_CONFIG / ConfigMap)")
            return
        cfg = tomllib.loads(cm["data"]["config.toml"])
        unknown = set(cfg) - struct_fields("agent/src/config.rs")
        if unknown:
            self.fail(f"config.toml keys the agent does not read: {sorted(unknown)}")
        if cfg["cidr"] != values["cidr"]:
            self.fail(f"agent cidr {cfg['cidr']} != values cidr {values['cidr']}")
        want_uids = [int(u) for u in values.get("allowedPeerUids") or []]
        if cfg.get("allowed_peer_uids") != want_uids:
            self.fail(f"agent allowed_peer_uids {cfg.get('allowed_peer_uids')} != values allowedPeerUids {want_uids}")
        port = int(cfg["health_listen"].rsplit(":", 1)[1])
        if not cfg["health_listen"].startswith("0.0.0.0:"):
            self.fail("health_listen on loopback: kubelet's httpGet probes (pod IP) could never pass")
        if port not in [p["containerPort"] for p in agent.get("ports", [])]:
            self.fail(f"health port {port} not declared")
        want_ns = "" if values["mode"] == "overlay" else values["underlay"]["netnsPath"]
        if cfg["dataplane_netns"] != want_ns:
            self.fail(f"dataplane_netns {cfg['dataplane_netns']!r} != {want_ns!r}")
        if not cfg["bpffs_dir"].startswith("/sys/fs/bpf/"):
            self.fail("bpffs_dir not on the bpffs mount")
        if cfg["state_dir"] not in mounts:
            self.fail(f"state_dir {cfg['state_dir']} is not a mounted volume (state would die with the container)")
        # `kubectl exec -c network-agent -- cubenet-cli …` must reach this agent and its pins.
        want_cli = {
            "CUBENET_GRPC": cfg["grpc_listen"],
            "CUBENET_HTTP": f"127.0.0.1:{port}",
            "CUBENET_BPFFS_DIR": cfg["bpffs_dir"],
        }
        for var, want in want_cli.items():
            if env.get(var) != want:
                self.fail(f"network-agent: {var} is {env.get(var)!r}, cubenet-cli needs {want!r}")
        if "preStop" not in agent.get("lifecycle", {}):
            self.fail("network-agent has no preStop")
        if want_ns.startswith("/proc/") and not pod.get("hostPID"):
            self.fail(f"dataplane {want_ns} without hostPID")
        # Surge (K15): two pods of a node run side by side only if the new one takes the agent
        # and the gateway over through sockets on a host path both pods mount, and each pod
        # tells its own first start from a restart with a per-pod (emptyDir) marker.
        if surged:
            vols = {v["name"]: v for v in pod.get("volumes", [])}
            ho = cfg.get("handover_socket", "")
            if not ho:
                self.fail("maxSurge 1 without the agent's handover_socket: two agents would program one datapath")
            else:
                ho_dir = os.path.dirname(ho)
                mount = next((m for m in agent["volumeMounts"] if m["mountPath"] == ho_dir), None)
                if mount is None or "hostPath" not in vols.get(mount["name"], {}):
                    self.fail(f"handover_socket {ho} is not on a host path both pods mount")
                if env.get("CUBENET_HANDOVER_DIR") != ho_dir:
                    self.fail(f"CUBENET_HANDOVER_DIR {env.get('CUBENET_HANDOVER_DIR')!r} != {ho_dir!r}")
                for c in containers:
                    if c["name"] in ("cube-egress", "cube-egress-standby"):
                        e = {x["name"]: x.get("value") for x in c.get("env", [])}
                        hs = e.get("CUBE_EGRESS_HANDOFF_SOCKET") or ""
                        cm_ = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
                        if mount is None or os.path.dirname(hs) != ho_dir or cm_.get(ho_dir) != mount["name"]:
                            self.fail(f"{c['name']}: CUBE_EGRESS_HANDOFF_SOCKET {hs!r} not on the shared hand-over volume")
            uid = next((e for e in agent.get("env", []) if e["name"] == "CUBENET_POD_UID"), {})
            if uid.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "metadata.uid":
                self.fail("CUBENET_POD_UID must come from the downward API (metadata.uid)")
            run = next((m for m in agent["volumeMounts"] if m["mountPath"] == env.get("CUBENET_POD_RUN")), None)
            if run is None or "emptyDir" not in vols.get(run["name"], {}):
                self.fail("CUBENET_POD_RUN must be an emptyDir (the claim marker lives as long as the pod)")

        # The agent reaches the gateway's admin API (pushes, the /metrics relay; O26) at the
        # address egress.toml gives it, and only when CubeEgress runs.
        want_admin = ""
        if values["egress"]["enabled"]:
            want_admin = "http://" + tomllib.loads(cm["data"]["egress.toml"])["admin_addr"]
        if cfg.get("cube_egress_admin_url") != want_admin:
            self.fail(f"agent cube_egress_admin_url {cfg.get('cube_egress_admin_url')!r} != the gateway's admin address {want_admin!r}")
        self.check_pod_monitor(by_kind.get("PodMonitor", []), values, spec["template"], agent)

        # CubeEgress: config keys, CIDR everywhere, marks file mounted, CA mounted, probes.
        if values["egress"]["enabled"]:
            for n in ("cube-egress", "cube-egress-net"):
                if n not in names:
                    self.fail(f"no {n} container")
            ecfg = tomllib.loads(cm["data"]["egress.toml"])
            unknown = set(ecfg) - struct_fields("egress/src/config.rs")
            if unknown:
                self.fail(f"egress.toml keys cube-egress does not read: {sorted(unknown)}")
            if ecfg["sandbox_cidr"] != values["cidr"]:
                self.fail("egress sandbox_cidr differs from cidr")
            if ecfg.get("allowed_peer_uids") != cfg.get("allowed_peer_uids"):
                self.fail(f"egress allowed_peer_uids {ecfg.get('allowed_peer_uids')} != the agent's {cfg.get('allowed_peer_uids')}")
            for c in containers:
                if c["name"].startswith("cube-egress") or c["name"] == "preflight":
                    e = {x["name"]: x.get("value") for x in c.get("env", [])}
                    if e.get("CUBE_SANDBOX_NETWORK_CIDR") != values["cidr"]:
                        self.fail(f"{c['name']} does not get CUBE_SANDBOX_NETWORK_CIDR={values['cidr']}")
                    if e.get("CUBENET_DATAPLANE_NETNS") != want_ns:
                        self.fail(f"{c['name']} CUBENET_DATAPLANE_NETNS {e.get('CUBENET_DATAPLANE_NETNS')!r} != {want_ns!r}")
                if c["name"].startswith("cube-egress") and c["name"] != "cube-egress-net":
                    if "/etc/cube/ca" not in {m["mountPath"] for m in c.get("volumeMounts", [])}:
                        self.fail(f"{c['name']} lacks the CA at /etc/cube/ca")
            net = next(c for c in pod["containers"] if c["name"] == "cube-egress-net")
            e = {x["name"]: x.get("value") for x in net.get("env", [])}
            marks = e.get("CUBE_EGRESS_MARKS_CONF", "/etc/cubeegress/l7-marks.conf")
            if os.path.dirname(marks) not in {m["mountPath"] for m in net.get("volumeMounts", [])}:
                self.fail(f"marks file {marks} not mounted in cube-egress-net")
            cmd = net.get("readinessProbe", {}).get("exec", {}).get("command", [])
            if "status" not in cmd or not any(x.endswith("cube-egress-net.sh") for x in cmd):
                self.fail(f"cube-egress-net readiness must be the script's own `status`, not {cmd}")
        if values["preflight"]["enabled"]:
            pf = next((c for c in pod.get("initContainers", []) if c["name"] == "preflight"), None)
            e = {x["name"]: x.get("value") for x in (pf or {}).get("env", [])}
            if e.get("CUBENET_CIDR") != values["cidr"]:
                self.fail("preflight does not get the CIDR")


    def check_pod_monitor(self, monitors, values, template, agent):
        """The PodMonitor (O26): rendered only when enabled; it selects the DaemonSet's pods,
        scrapes named ports of the agent container on the paths the agent serves (the relayed
        CubeEgress one only with CubeEgress), each endpoint under its own `job`, and uses only
        fields of monitoring.coreos.com/v1 (no schema for a CRD in kubernetes-validate)."""
        pm = values["metrics"]["podMonitor"]
        if len(monitors) != (1 if pm["enabled"] else 0):
            self.fail(f"{len(monitors)} PodMonitors rendered with metrics.podMonitor.enabled={pm['enabled']}")
        for m in monitors:
            if m.get("apiVersion") != "monitoring.coreos.com/v1":
                self.fail(f"PodMonitor apiVersion {m.get('apiVersion')}")
            extra = set(m["spec"]) - PODMONITOR_SPEC
            if extra:
                self.fail(f"PodMonitor spec fields unknown to monitoring.coreos.com/v1: {sorted(extra)}")
            for k, v in (pm.get("labels") or {}).items():
                if m["metadata"].get("labels", {}).get(k) != v:
                    self.fail(f"PodMonitor lacks the label {k}={v}")
            sel = m["spec"].get("selector", {}).get("matchLabels", {})
            pod_labels = template["metadata"].get("labels", {})
            if not sel or any(pod_labels.get(k) != v for k, v in sel.items()):
                self.fail(f"PodMonitor selector {sel} does not select the pods ({pod_labels})")
            ports = {p.get("name") for p in agent.get("ports", [])}
            want = ["/metrics"] + (["/metrics/cube-egress"] if values["egress"]["enabled"] else [])
            eps = m["spec"].get("podMetricsEndpoints", [])
            if [e.get("path") for e in eps] != want:
                self.fail(f"PodMonitor paths {[e.get('path') for e in eps]}, want {want}")
            jobs = []
            for e in eps:
                extra = set(e) - PODMONITOR_ENDPOINT
                if extra:
                    self.fail(f"PodMonitor endpoint fields unknown to monitoring.coreos.com/v1: {sorted(extra)}")
                if e.get("port") not in ports:
                    self.fail(f"PodMonitor endpoint {e.get('path')} names port {e.get('port')!r} the agent does not declare")
                if e.get("interval") != pm["interval"]:
                    self.fail(f"PodMonitor endpoint {e.get('path')} interval {e.get('interval')} != {pm['interval']}")
                jobs += [r.get("replacement") for r in e.get("relabelings", []) if r.get("targetLabel") == "job"]
            if len(jobs) != len(eps) or len(set(jobs)) != len(jobs):
                self.fail(f"PodMonitor endpoints need a job each (their `up` series would clash): {jobs}")


def kube_validate(objs, variant):
    import kubernetes_validate

    errs = []
    for o in objs:
        if o["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no bundled schema; Checker.check_pod_monitor checks it
        try:
            kubernetes_validate.validate(o, KUBE_VERSION, True)
        except kubernetes_validate.ValidationError as e:
            errs.append(f"{variant}: {o['kind']}/{o['metadata']['name']}: {e.message} at {list(e.path)}")
    return errs


def ca_checks(objs, variant, tmp):
    errs = []
    for s in (o for o in objs if o["kind"] == "Secret"):
        crt = os.path.join(tmp, f"{variant}.crt")
        key = os.path.join(tmp, f"{variant}.key")
        open(crt, "wb").write(base64.b64decode(s["data"]["cube-root-ca.crt"]))
        open(key, "wb").write(base64.b64decode(s["data"]["cube-root-ca.key"]))
        text = subprocess.run(["openssl", "x509", "-in", crt, "-noout", "-text"], capture_output=True, text=True).stdout
        if "CA:TRUE" not in text:
            errs.append(f"{variant}: generated CA certificate is not a CA")
        a = subprocess.run(["openssl", "x509", "-in", crt, "-noout", "-pubkey"], capture_output=True).stdout
        b = subprocess.run(["openssl", "pkey", "-in", key, "-pubout"], capture_output=True).stdout
        if not a or a != b:
            errs.append(f"{variant}: CA key does not match the certificate")
    return errs


def _flatten(v, prefix=""):
    """Leaf paths of a values tree: scalars, lists and empty mappings, as dotted keys."""
    if isinstance(v, dict) and v:
        out = {}
        for k, sub in v.items():
            out.update(_flatten(sub, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: v}


def _fmt_default(v):
    """A default as the README writes it inside backticks."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v if v else '""'
    if isinstance(v, (dict, list)):
        return yaml.safe_dump(v, default_flow_style=True, width=1000).strip()
    return str(v)


def readme_values_check(defaults, readme):
    """Every value of values.yaml is in the README's "## Values" table with its default.

    A row documents a key, or several (`a` / `b`, or `x.y.a` / `.b` relative to the first
    key's parent), or a mapping (then every scalar under it must appear in the default cell,
    e.g. `agent.resources` "requests 100m/64Mi, limit 512Mi"). A row's backticked defaults
    must equal the values' (`""` for empty, `null`); a README key absent from values.yaml is
    stale. Returns the failures."""
    errors = []
    section = readme.split("\n## Values", 1)[1].split("\n## ", 1)[0] if "\n## Values" in readme else ""
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        keys = re.findall(r"`([^`]+)`", cells[0])
        full = []
        for k in keys:
            if k.startswith(".") and full:
                k = full[0].rsplit(".", 1)[0] + k
            full.append(k)
        defaults_cell = re.findall(r"`([^`]*)`", cells[1])
        for i, k in enumerate(full):
            rows[k] = (defaults_cell[i] if len(defaults_cell) == len(full) else None, cells[1])
    leaves = _flatten(defaults)
    for path, value in leaves.items():
        doc = [k for k in rows if k == path or path.startswith(k + ".")]
        if not doc:
            errors.append(f"values: {path} (default {_fmt_default(value)}) is not documented in README.md's Values table")
            continue
        key = max(doc, key=len)
        want, cell = rows[key]
        if key == path:
            if want is None:
                errors.append(f"values: README row of {path} gives no backticked default")
            elif want != _fmt_default(value):
                errors.append(f"values: README default of {path} is `{want}`, values.yaml has `{_fmt_default(value)}`")
        elif not isinstance(value, (dict, list)) and str(value) not in cell:
            errors.append(f"values: README row of {key} does not mention {path} = {value}")
    for k in rows:
        if not any(p == k or p.startswith(k + ".") for p in leaves):
            errors.append(f"values: README documents {k}, which values.yaml does not have")
    return errors


def cmd_check(out):
    from helm_python import chart

    defaults = yaml.safe_load(open(os.path.join(CHART, "values.yaml")))
    errors = []
    lint = chart.lint(CHART, None, strict=True, quiet=False, kube_version=KUBE_VERSION)
    for m in lint.get("messages", []):
        if str(m.get("severity", "")).upper() not in ("INFO", "1"):
            errors.append(f"lint: {m}")
    errors += [f"lint: {e}" for e in lint.get("errors", [])]
    readme = open(os.path.join(CHART, "README.md")).read()
    errors += readme_values_check(defaults, readme)
    # The README check bites: an undocumented value, a wrong default, a stale row.
    for name, (vals, text, fragment) in {
        "undocumented": (merge(defaults, {"agent": {"newKnob": 1}}), readme, "agent.newKnob"),
        "wrong-default": (merge(defaults, {"agent": {"mtu": 9000}}), readme, "README default of agent.mtu"),
        "stale-row": (defaults, readme.replace("| `terminationGracePeriodSeconds`", "| `gone` | `1` | |\n| `terminationGracePeriodSeconds`"), "documents gone"),
        "mapping-scalar": (merge(defaults, {"agent": {"resources": {"limits": {"memory": "777Mi"}}}}), readme, "777Mi"),
    }.items():
        got = readme_values_check(vals, text)
        if not any(fragment in e for e in got):
            errors.append(f"readme-mutation/{name}: not caught (want {fragment!r}; got {got})")
        else:
            print(f"readme-mutation/{name}: caught")
    tmp = tempfile.mkdtemp(prefix="cubenet-chart-")
    for variant, over in VARIANTS.items():
        values = merge(defaults, over)
        try:
            objs, files = render(over)
        except Exception as e:  # noqa: BLE001 - report every variant
            errors.append(f"{variant}: render failed: {e}")
            continue
        d = os.path.join(out, variant)
        os.makedirs(d, exist_ok=True)
        for path, text in files.items():
            open(os.path.join(d, os.path.basename(path)), "w").write(text)
        cm = next(o for o in objs if o["kind"] == "ConfigMap")
        open(os.path.join(d, "config.toml"), "w").write(cm["data"]["config.toml"])
        errors += kube_validate(objs, variant)
        c = Checker(variant)
        c.check(objs, values)
        errors += c.errors
        errors += ca_checks(objs, variant, tmp)
        print(f"{variant}: {len(objs)} objects ({', '.join(sorted(o['kind'] for o in objs))}) checked")
    for name, (mutate, fragment, *variant) in MUTATIONS.items():
        base = VARIANTS[variant[0] if variant else "underlay-selfsigned"]
        objs, _ = render(base)
        mutate(objs)
        c = Checker("mutation")
        c.check(objs, merge(defaults, base))
        if not any(fragment in e for e in c.errors):
            errors.append(f"mutation/{name}: not caught (want {fragment!r}; got {c.errors})")
        else:
            print(f"mutation/{name}: caught")
    for name, (over, fragment) in REFUSED.items():
        try:
            render(over)
            errors.append(f"refused/{name}: rendered, but the chart must refuse {over}")
        except Exception as e:  # noqa: BLE001
            if fragment not in str(e):
                errors.append(f"refused/{name}: failed with {e!r}, expected a message containing {fragment!r}")
            else:
                print(f"refused/{name}: ok ({fragment})")
    for e in errors:
        print("FAIL", e)
    print(f"{len(VARIANTS)} variants, {len(MUTATIONS)} mutations, {len(REFUSED)} refusals, {len(errors)} failures")
    return 1 if errors else 0


def cmd_pod(out, values_json, pod_name=None):
    over = json.loads(values_json)
    objs, _ = render(over)
    ds = next(o for o in objs if o["kind"] == "DaemonSet")
    cms = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    tmpl = ds["spec"]["template"]
    spec = copy.deepcopy(tmpl["spec"])
    # What the kubelet would provide from the API server, as host directories.
    for v in spec.get("volumes", []):
        for ref, data_of in (("configMap", lambda n: cms[n]["data"]), ("secret", lambda n: secrets[n]["data"])):
            if ref not in v:
                continue
            src = v.pop(ref)
            name = src.get("name") or src.get("secretName")
            data = data_of(name)
            d = os.path.join(out, "volumes", v["name"])
            os.makedirs(d, exist_ok=True)
            for it in src.get("items", [{"key": k, "path": k} for k in data]):
                raw = data[it["key"]]
                body = base64.b64decode(raw) if ref == "secret" else raw.encode()
                p = os.path.join(d, it["path"])
                open(p, "wb").write(body)
                os.chmod(p, 0o400 if ref == "secret" else 0o444)
            v["hostPath"] = {"path": d, "type": "Directory"}
    # podman 4.3 makes an emptyDir a named volume of the same name, shared by every pod that
    # names it and kept after the pod: a host directory of this rendering instead, fresh per
    # pod as the kubelet's emptyDir is (the surge drill runs two pods side by side, K15).
    for v in spec.get("volumes", []):
        if "emptyDir" in v:
            v.pop("emptyDir")
            d = os.path.join(out, "volumes", v["name"])
            os.makedirs(d, exist_ok=True)
            v["hostPath"] = {"path": d, "type": "Directory"}
    # podman 4.3 turns any declared port into a port mapping, which `--network none` refuses:
    # drop the ports and give the probes their numbers instead of names.
    for c in spec.get("initContainers", []) + spec["containers"]:
        named = {p["name"]: p["containerPort"] for p in c.pop("ports", []) if p.get("name")}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            h = c.get(kind, {}).get("httpGet")
            if h and isinstance(h.get("port"), str):
                h["port"] = named[h["port"]]
    # The downward API's metadata.uid, as the kubelet fills it in (a new uid per pod).
    import uuid

    uid = str(uuid.uuid4())
    for c in spec.get("initContainers", []) + spec["containers"]:
        for e in c.get("env", []):
            if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.uid":
                e.pop("valueFrom")
                e["value"] = uid
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod_name or ds["metadata"]["name"], "labels": tmpl["metadata"].get("labels", {}),
                     "annotations": tmpl["metadata"].get("annotations", {})},
        "spec": spec,
    }
    # podman's default ("once") removes the init container right after it exits and races
    # runc under load ("cannot remove container ... as it is running"); "always" keeps it
    # (and reruns it on a pod restart, as the kubelet does for a new pod).
    pod["metadata"]["annotations"]["io.podman.annotations.init.container.type"] = "always"
    pod["spec"].pop("nodeSelector", None)
    pod["spec"].pop("tolerations", None)
    pod["spec"].pop("priorityClassName", None)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "pod.yaml"), "w") as f:
        yaml.safe_dump(pod, f, sort_keys=False)
    print(os.path.join(out, "pod.yaml"))
    return 0


def main(argv):
    if len(argv) >= 2 and argv[0] == "check":
        return cmd_check(argv[1])
    if len(argv) >= 3 and argv[0] == "pod":
        return cmd_pod(argv[1], argv[2], argv[3] if len(argv) >= 4 else None)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
