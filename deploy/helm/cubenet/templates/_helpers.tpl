{{/* Names. */}}
{{- define "cubenet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "cubenet.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "cubenet.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: cube-node
{{- end -}}

{{- define "cubenet.image" -}}
{{- printf "%s:%s" .repository (default $.root.Chart.AppVersion .tag) -}}
{{- end -}}

{{/* The dataplane namespace path as the agent's config and the egress containers see it:
     "" in overlay mode (the pod's own namespace). */}}
{{- define "cubenet.dataplaneNetns" -}}
{{- if eq .Values.mode "underlay" -}}{{ .Values.underlay.netnsPath }}{{- end -}}
{{- end -}}

{{/* CubeEgress's bootstrap URL: `auto` = the agent's policy dump where the gateway reaches
     it on its loopback: in underlay mode the agent's egress_dump_listen, which the agent
     binds inside the dataplane namespace (decision L9); in overlay mode the agent and the
     gateway share the pod's namespace and the dump is on health_listen. "" = none. */}}
{{- define "cubenet.egressBootstrapUrl" -}}
{{- if ne .Values.egress.bootstrapUrl "auto" -}}{{ .Values.egress.bootstrapUrl }}
{{- else if eq .Values.mode "underlay" -}}http://127.0.0.1:{{ int .Values.agent.egressDumpPort }}/v1/policies/dump
{{- else -}}http://127.0.0.1:{{ int .Values.agent.healthPort }}/v1/policies/dump
{{- end -}}
{{- end -}}

{{/* hostPID is needed when the dataplane is reached through /proc/1/ns/net. */}}
{{- define "cubenet.hostPID" -}}
{{- if and (eq .Values.mode "underlay") (hasPrefix "/proc/" .Values.underlay.netnsPath) -}}true{{- end -}}
{{- end -}}

{{/* A named dataplane namespace (/run/netns/NAME) needs /run/netns in the pod. */}}
{{- define "cubenet.runNetns" -}}
{{- if and (eq .Values.mode "underlay") (hasPrefix "/run/netns/" .Values.underlay.netnsPath) -}}true{{- end -}}
{{- end -}}

{{- define "cubenet.caSecretName" -}}
{{- if eq .Values.egress.ca.mode "existingSecret" -}}
{{- .Values.egress.ca.existingSecret -}}
{{- else -}}
{{- printf "%s-egress-ca" (include "cubenet.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Paths inside the containers (fixed; the host side comes from hostPaths.*). */}}
{{- define "cubenet.statePath" -}}/var/lib/cubenet/state{{- end -}}
{{- define "cubenet.configPath" -}}/etc/cubenet{{- end -}}

{{/* Environment shared by every container that acts in the dataplane namespace. */}}
{{- define "cubenet.dataplaneEnv" -}}
- name: CUBENET_DATAPLANE_NETNS
  value: {{ include "cubenet.dataplaneNetns" . | quote }}
- name: CUBE_SANDBOX_NETWORK_CIDR
  value: {{ .Values.cidr | quote }}
{{- end -}}

{{/* Exec probe of the gateway's health, in the dataplane namespace (busybox wget; its own -T
     crashes the bookworm static build, hence coreutils timeout). */}}
{{- define "cubenet.egressHealthProbe" -}}
exec:
  command:
    - /usr/local/bin/cubenet-netns-exec.sh
    - timeout
    - "3"
    - wget
    - -q
    - -O
    - /dev/null
    - {{ printf "http://127.0.0.1:%d/admin/v1/health" (int .Values.egress.adminPort) }}
{{- end -}}

{{/* Security context of the dataplane containers: privileged (netns entry, bpf(), TAPs,
     iptables, bpffs mount propagation). */}}
{{- define "cubenet.privileged" -}}
privileged: true
allowPrivilegeEscalation: true
{{- end -}}

{{/* Surge upgrades with live hand-over (K15): underlay mode with underlay.surge. */}}
{{- define "cubenet.surge" -}}
{{- if and (eq .Values.mode "underlay") .Values.underlay.surge -}}true{{- end -}}
{{- end -}}

{{/* Where the hand-over sockets and the claim file live in the containers (host side:
     hostPaths.handoverDir). */}}
{{- define "cubenet.handoverPath" -}}/run/cubenet-handover{{- end -}}

{{/* "true" unless the release's running DaemonSet has pods that cannot hand over (a chart
     before K15, or underlay.surge false): then this upgrade replaces them without surge (a
     surged pod would find no hand-over socket and refuse the live agent's sockets, H7, and
     the rollout would stall). Without a cluster (helm template) lookup is empty: "true". */}}
{{- define "cubenet.runningPodsHandOver" -}}
{{- $ds := lookup "apps/v1" "DaemonSet" .Release.Namespace (printf "%s-node" (include "cubenet.fullname" .)) -}}
{{- if not $ds -}}true
{{- else if eq (dig "spec" "template" "metadata" "annotations" "cubenet.io/handover" "" $ds) "true" -}}true
{{- end -}}
{{- end -}}
