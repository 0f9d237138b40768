{{/* Chart name, truncated to a DNS label. */}}
{{- define "specmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object name prefix: the release name, plus the chart name unless the release name holds it. */}}
{{- define "specmesh.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<suffix>", within a DNS label. Call with (list $ "suffix"). */}}
{{- define "specmesh.componentName" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "specmesh.fullname" $root | trunc (int (sub 62 (len (index . 1))))) (index . 1) | trimSuffix "-" }}
{{- end }}

{{- define "specmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "specmesh.labels" -}}
helm.sh/chart: {{ include "specmesh.chart" . }}
{{ include "specmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specmesh
{{- end }}

{{- define "specmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component's objects. Call with (dict "root" $ "component" "router" "pool" "code"). */}}
{{- define "specmesh.componentLabels" -}}
{{ include "specmesh.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- if .pool }}
specmesh.io/pool: {{ .pool }}
{{- end }}
{{- end }}

{{/* Selector labels of one component's pods (same arguments). */}}
{{- define "specmesh.componentSelectorLabels" -}}
{{ include "specmesh.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- if .pool }}
specmesh.io/pool: {{ .pool }}
{{- end }}
{{- end }}

{{/* The image of a specmesh container. Call with (dict "root" $ "gpu" N). */}}
{{- define "specmesh.image" -}}
{{- $image := .root.Values.image }}
{{- $flavor := $image.flavor }}
{{- if eq $flavor "auto" }}
{{- $flavor = ternary "cuda" "cpu" (gt (int .gpu) 0) }}
{{- end }}
{{- if not (has $flavor (list "cpu" "cuda")) }}
{{- fail (printf "image.flavor must be auto, cpu or cuda, not %q" $flavor) }}
{{- end }}
{{- printf "%s:%s-%s" $image.repository (toString (default .root.Chart.AppVersion $image.tag)) $flavor }}
{{- end }}

{{- define "specmesh.routerServiceAccountName" -}}
{{- default (include "specmesh.componentName" (list . "router")) .Values.serviceAccount.routerName }}
{{- end }}

{{- define "specmesh.serviceAccountName" -}}
{{- default (include "specmesh.fullname" .) .Values.serviceAccount.name }}
{{- end }}

{{/* Redis: the Secret holding the password, and its key. */}}
{{- define "specmesh.redisSecretName" -}}
{{- default (include "specmesh.componentName" (list . "redis")) .Values.redis.auth.existingSecret }}
{{- end }}

{{/* Environment variables giving a service SPECMESH_REDIS_URL as its role's Redis user (REDIS_PASSWORD first: the
URL expands it). Call with (dict "root" $ "role" "router"). */}}
{{- define "specmesh.redisEnv" -}}
{{- $root := .root }}
{{- $redis := $root.Values.redis }}
{{- if $redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "specmesh.redisSecretName" $root }}
      key: {{ index $redis.auth (printf "%sSecretKey" .role) }}
- name: SPECMESH_REDIS_URL
  value: {{ printf "redis://specmesh-%s:$(REDIS_PASSWORD)@%s:%d/%d" .role (include "specmesh.componentName" (list $root "redis")) (int $redis.port) (int $redis.database) | quote }}
{{- else if $redis.externalUrlSecret.name }}
- name: SPECMESH_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $redis.externalUrlSecret.name }}
      key: {{ $redis.externalUrlSecret.key }}
{{- else if $redis.externalUrl }}
- name: SPECMESH_REDIS_URL
  value: {{ $redis.externalUrl | quote }}
{{- else }}
{{- fail "redis.enabled is false: set redis.externalUrl or redis.externalUrlSecret.name" }}
{{- end }}
{{- end }}

{{/* Environment shared by every specmesh container. Call with (dict "root" $ "threads" N "config" map "gpu" N "device" s "dtype" s);
     without threads (the router: one torch thread, no --threads flag) OpenMP gets one thread. */}}
{{- define "specmesh.commonEnv" -}}
{{- $root := .root }}
- name: SPECMESH_METRICS_ADDRESS
  value: {{ printf "%s:%d" $root.Values.bindAddress (int $root.Values.metrics.port) | quote }}
- name: SPECMESH_LOG_LEVEL
  value: {{ $root.Values.logLevel | quote }}
{{- if .threads }}
- name: SPECMESH_THREADS
  value: {{ .threads | quote }}
{{- end }}
- name: OMP_NUM_THREADS
  value: {{ .threads | default 1 | quote }}
- name: MKL_NUM_THREADS
  value: {{ .threads | default 1 | quote }}
{{- $device := .device }}
{{- if and (not $device) (gt (int .gpu) 0) }}
{{- $device = "cuda" }}
{{- end }}
{{- if $device }}
- name: SPECMESH_DEVICE
  value: {{ $device | quote }}
{{- end }}
{{- if .dtype }}
- name: SPECMESH_DTYPE
  value: {{ .dtype | quote }}
{{- end }}
{{- range $key, $value := .config }}
- name: {{ printf "SPECMESH_%s" (snakecase $key | upper) }}
  value: {{ toString $value | quote }}
{{- end }}
{{- range $key, $value := $root.Values.commonEnv }}
- name: {{ $key }}
  value: {{ toString $value | quote }}
{{- end }}
{{- end }}

{{/* Resources of a specmesh container, with the GPU added. Call with (dict "root" $ "resources" map "gpu" N). */}}
{{- define "specmesh.resources" -}}
{{- $resources := deepCopy (default dict .resources) }}
{{- if gt (int .gpu) 0 }}
{{- $limits := default dict $resources.limits }}
{{- $_ := set $limits .root.Values.gpuResource (int .gpu) }}
{{- $_ := set $resources "limits" $limits }}
{{- $requests := default dict $resources.requests }}
{{- $_ := set $requests .root.Values.gpuResource (int .gpu) }}
{{- $_ := set $resources "requests" $requests }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* gRPC health probes on a port. Call with (dict "port" N "probes" map). */}}
{{- define "specmesh.grpcProbes" -}}
{{- $check := dict "grpc" (dict "port" .port) }}
{{- if .tls }}{{/* the kubelet's gRPC probes speak plaintext: the service's own check over its TLS */}}
{{- $check = dict "exec" (dict "command" (list "python" "-m" "specmesh.cluster.health_probe")) }}
{{- end }}
startupProbe:
  {{- toYaml (merge (dict) $check .probes.startup) | nindent 2 }}
readinessProbe:
  {{- toYaml (merge (dict) $check .probes.readiness) | nindent 2 }}
livenessProbe:
  {{- toYaml (merge (dict) $check .probes.liveness) | nindent 2 }}
{{- end }}

{{/* TLS from the values' Secret: the variables, the volume mount and the volume of a specmesh pod. */}}
{{- define "specmesh.tlsEnv" -}}
{{- if .Values.tls.enabled }}
{{- if not .Values.tls.secretName }}{{ fail "tls.secretName: the Secret with tls.crt, tls.key and ca.crt" }}{{ end }}
- name: SPECMESH_TLS_CERT
  value: /etc/specmesh/tls/tls.crt
- name: SPECMESH_TLS_KEY
  value: /etc/specmesh/tls/tls.key
- name: SPECMESH_TLS_CA
  value: /etc/specmesh/tls/ca.crt
{{- end }}
{{- end }}
{{- define "specmesh.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/specmesh/tls
  readOnly: true
{{- end }}
{{- end }}
{{- define "specmesh.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- end }}

{{/* The writable volumes of a specmesh pod (the root filesystem is read-only). */}}
{{- define "specmesh.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scratch.tmpSizeLimit }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.scratch.cacheSizeLimit }}
{{- end }}

{{- define "specmesh.scratchVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/specmesh/.cache
{{- end }}

{{/* Ports of a specmesh container: its gRPC port and metrics. Call with (dict "root" $ "port" N). */}}
{{- define "specmesh.containerPorts" -}}
- name: grpc
  containerPort: {{ .port }}
  protocol: TCP
- name: metrics
  containerPort: {{ .root.Values.metrics.port }}
  protocol: TCP
{{- end }}

{{/* Ports of a specmesh Service (same arguments). */}}
{{- define "specmesh.servicePorts" -}}
- name: grpc
  port: {{ .port }}
  targetPort: grpc
  protocol: TCP
  appProtocol: grpc
- name: metrics
  port: {{ .root.Values.metrics.port }}
  targetPort: metrics
  protocol: TCP
  appProtocol: http
{{- end }}

{{/* The monitoring.coreos.com/v1 API is there, or the values say to render regardless. Call with (list $ settings). */}}
{{- define "specmesh.monitoringApi" -}}
{{- $root := index . 0 }}
{{- $settings := index . 1 }}
{{- if and $settings.enabled (or $settings.ignoreCapabilities ($root.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) }}true{{ end }}
{{- end }}

{{/* Prefer spreading a component's pods over nodes, unless the values give an affinity. Call with (dict "root" $ "component" c "pool" p "affinity" map). */}}
{{- define "specmesh.affinity" -}}
{{- if .affinity }}
{{- toYaml .affinity }}
{{- else }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "specmesh.componentSelectorLabels" . | nindent 12 }}
{{- end }}
{{- end }}

{{/* One drafter pool: the entry merged over the `drafter` defaults, as JSON. Call with (list $ entry). */}}
{{- define "specmesh.drafterPool" -}}
{{- $root := index . 0 }}
{{- $entry := index . 1 }}
{{- $pool := mergeOverwrite (deepCopy $root.Values.drafter) (deepCopy $entry) }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" (toString $pool.name)) }}
{{- fail (printf "drafterPools: name %q must be a DNS label (lower-case letters, digits, '-')" (toString $pool.name)) }}
{{- end }}
{{- if not $pool.drafter }}
{{- fail (printf "drafterPools: pool %q needs a drafter (ngram, history, code, math, writing, a directory or a model)" $pool.name) }}
{{- end }}
{{- toJson $pool }}
{{- end }}

{{/* The Service name of a drafter pool. Call with (list $ poolName). */}}
{{- define "specmesh.drafterName" -}}
{{- include "specmesh.componentName" (list (index . 0) (printf "drafter-%s" (index . 1))) }}
{{- end }}

{{/* SPECMESH_DRAFTERS: every pool's Service address, comma-separated. */}}
{{- define "specmesh.drafterAddresses" -}}
{{- $addresses := list }}
{{- $names := list }}
{{- range .Values.drafterPools }}
{{- $pool := fromJson (include "specmesh.drafterPool" (list $ .)) }}
{{- if has $pool.name $names }}
{{- fail (printf "drafterPools: the name %q is used twice" $pool.name) }}
{{- end }}
{{- $names = append $names $pool.name }}
{{- $addresses = append $addresses (printf "%s.%s.svc.%s:%d" (include "specmesh.drafterName" (list $ $pool.name)) $.Release.Namespace $.Values.clusterDomain (int $pool.port)) }}
{{- end }}
{{- join "," $addresses }}
{{- end }}

{{/* SPECMESH_DISCOVERY_SELECTOR: the drafter Services of this release. */}}
{{- define "specmesh.discoverySelector" -}}
{{- default (printf "app.kubernetes.io/instance=%s,specmesh.io/role=drafter" .Release.Name) .Values.router.discovery.selector }}
{{- end }}

{{/* The Secret holding the queue key (values queueKey). */}}
{{- define "specmesh.queueKeySecretName" -}}
{{- default (include "specmesh.componentName" (list . "queue-key")) .Values.queueKey.existingSecret }}
{{- end }}

{{/* The queue key as a file: the env variable, the volume mount and the volume of a router or verifier. */}}
{{- define "specmesh.queueKeyEnv" -}}
- name: SPECMESH_QUEUE_KEY_FILE
  value: {{ printf "/etc/specmesh/queue-key/%s" .Values.queueKey.secretKey | quote }}
{{- end }}
{{- define "specmesh.queueKeyVolumeMount" -}}
- name: queue-key
  mountPath: /etc/specmesh/queue-key
  readOnly: true
{{- end }}
{{- define "specmesh.queueKeyVolume" -}}
- name: queue-key
  secret:
    secretName: {{ include "specmesh.queueKeySecretName" . }}
{{- end }}

{{/* A NetworkPolicy ingress rule: /metrics from the monitoring namespace only. */}}
{{- define "specmesh.metricsPeer" -}}
- from:
    - namespaceSelector:
        matchLabels:
          kubernetes.io/metadata.name: {{ .Values.networkPolicy.monitoringNamespace }}
  ports:
    - port: metrics
      protocol: TCP
{{- end }}
