#!/usr/bin/env bash
# Shared by scripts/build-images.sh, scripts/k8s-pod-run.sh and the k8s tests: a private
# podman/buildah configuration so nothing touches the machine's containers defaults.
#
#   k8s_podman_env ROOT   writes ROOT/target/k8s/containers/{containers.conf,storage.conf} (once)
#                         and exports CONTAINERS_CONF / CONTAINERS_STORAGE_CONF pointing at them.
#
# Settings (measured on this machine, ../shared/reference/packaging.md §1-2):
#   runtime runc      crun fails on this host's hybrid cgroups;
#   explicit ulimits  podman's default nofile=1048576 is refused here (hard limit 20000);
#   netns "none"      otherwise podman's default bridge adds podman0 + iptables rules to the
#                     root netns;
#   storage           native overlay under target/k8s/containers (graphroot) and runroot.

k8s_podman_env() {
  local root=$1 dir
  dir="$root/target/k8s/containers"
  mkdir -p "$dir/graph" "$dir/run" "$dir/tmp"
  local conf="$dir/containers.conf" storage="$dir/storage.conf"
  local want_conf want_storage
  want_conf=$(cat <<EOF
# Written by scripts/k8s-lib.sh; private to this checkout.
[containers]
netns = "none"
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "$dir/tmp"
volume_path = "$dir/volumes"
EOF
)
  want_storage=$(cat <<EOF
# Written by scripts/k8s-lib.sh; private to this checkout.
[storage]
driver = "overlay"
graphroot = "$dir/graph"
runroot = "$dir/run"
EOF
)
  [[ -f "$conf" && "$(cat "$conf")" == "$want_conf" ]] || printf '%s\n' "$want_conf" >"$conf"
  [[ -f "$storage" && "$(cat "$storage")" == "$want_storage" ]] || printf '%s\n' "$want_storage" >"$storage"
  export CONTAINERS_CONF="$conf" CONTAINERS_STORAGE_CONF="$storage"
  # The registries list stays the system's; nothing here pulls (every build is FROM scratch).
}
