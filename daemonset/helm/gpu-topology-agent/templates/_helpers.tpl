{{/* Names, labels and the decisions several templates share. */}}

{{- define "gta.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<name>, or the release name alone when it already contains the name. */}}
{{- define "gta.fullname" -}}
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

{{- define "gta.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gta.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gta.labels" -}}
{{ include "gta.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: gpu-topology-agent
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gta.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The ConfigMap of named configs: the user's (config.name) or the chart's. */}}
{{- define "gta.configMapName" -}}
{{- if .Values.config.name }}{{ .Values.config.name }}{{ else }}{{ include "gta.fullname" . }}-configs{{ end }}
{{- end }}

{{/* The named configs the chart renders: config.map, or files/config.yaml as `default`. */}}
{{- define "gta.configMap" -}}
{{- if .Values.config.map }}
{{- toYaml .Values.config.map }}
{{- else }}
{{- toYaml (dict "default" (.Files.Get "files/config.yaml")) }}
{{- end }}
{{- end }}

{{/* The config a node without the label uses: config.default, else `default`, else the
only config (NVIDIA's "named" then "single" fallbacks). */}}
{{- define "gta.defaultConfig" -}}
{{- $map := include "gta.configMap" . | fromYaml }}
{{- if .Values.config.default }}{{ .Values.config.default }}
{{- else if or .Values.config.name (hasKey $map "default") }}default
{{- else if eq (len $map) 1 }}{{ keys $map | first }}
{{- end }}
{{- end }}

{{/* "true" when each node picks its config by its label: several configs to choose from. */}}
{{- define "gta.perNodeConfig" -}}
{{- $map := include "gta.configMap" . | fromYaml }}
{{- if or .Values.config.name (gt (len $map) 1) }}true{{ end }}
{{- end }}

{{/* health.nodeCondition as on, off or dry-run (YAML's unquoted on/off are booleans). */}}
{{- define "gta.nodeCondition" -}}
{{- $v := .Values.health.nodeCondition | toString }}
{{- if eq $v "true" }}on{{ else if eq $v "false" }}off{{ else }}{{ $v }}{{ end }}
{{- end }}

{{/* "true" when the agent calls the API server at all (it then gets a token). */}}
{{- define "gta.usesApi" -}}
{{- if or (eq .Values.mode "dra") (eq .Values.labels.sink "nodefeature") (include "gta.perNodeConfig" .) (eq (include "gta.nodeCondition" .) "on") }}true{{ end }}
{{- end }}

{{/* The DRA API version the cluster serves, newest first (DeviceClass is in all three);
resource.k8s.io/v1 where the cluster is not known (`helm template` without --api-versions). */}}
{{- define "gta.draApiVersion" -}}
{{- if .Capabilities.APIVersions.Has "resource.k8s.io/v1/DeviceClass" }}resource.k8s.io/v1
{{- else if .Capabilities.APIVersions.Has "resource.k8s.io/v1beta2/DeviceClass" }}resource.k8s.io/v1beta2
{{- else if .Capabilities.APIVersions.Has "resource.k8s.io/v1beta1/DeviceClass" }}resource.k8s.io/v1beta1
{{- else }}resource.k8s.io/v1
{{- end }}
{{- end }}

{{- define "gta.hasServiceMonitor" -}}
{{- if and .Values.metrics.serviceMonitor.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor") }}true{{ end }}
{{- end }}

{{- define "gta.hasPrometheusRule" -}}
{{- if and .Values.metrics.prometheusRule.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/PrometheusRule") }}true{{ end }}
{{- end }}

{{/* The service account name as RBAC subjects and admission policies spell it. */}}
{{- define "gta.serviceAccountUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "gta.fullname" . }}
{{- end }}

{{/* Paths inside the container. */}}
{{- define "gta.configDir" -}}/etc/gpu-topology-agent/configs{{- end }}
{{- define "gta.webConfigDir" -}}/etc/gpu-topology-agent/web{{- end }}
{{- define "gta.tlsDir" -}}/etc/gpu-topology-agent/tls{{- end }}

{{/* The exporter-toolkit web configuration (metrics.tls). */}}
{{- define "gta.webConfig" -}}
{{- $tls := .Values.metrics.tls }}
{{- $dir := include "gta.tlsDir" . }}
{{- $server := dict "cert_file" (printf "%s/tls.crt" $dir) "key_file" (printf "%s/tls.key" $dir) "client_auth_type" $tls.clientAuthType "min_version" $tls.minVersion }}
{{- if ne $tls.clientAuthType "NoClientCert" }}
{{- $_ := set $server "client_ca_file" (printf "%s/ca.crt" $dir) }}
{{- end }}
{{- $config := dict "tls_server_config" $server }}
{{- if $tls.basicAuthUsers }}
{{- $_ := set $config "basic_auth_users" $tls.basicAuthUsers }}
{{- end }}
{{- toYaml $config }}
{{- end }}
