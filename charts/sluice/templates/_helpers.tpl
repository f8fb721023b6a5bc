{{/* Names: <release>-sluice (or <release> when it already contains "sluice"), ≤ 63 chars. */}}
{{- define "sluice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sluice.fullname" -}}
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

{{- define "sluice.operator.fullname" -}}
{{- printf "%s-operator" (include "sluice.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sluice.router.fullname" -}}
{{- printf "%s-router" (include "sluice.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret holding the router's API key file: router.apiKeys.existingSecret, or the chart's own. */}}
{{- define "sluice.router.apiKeysSecret" -}}
{{- .Values.router.apiKeys.existingSecret | default (printf "%s-api-keys" (include "sluice.router.fullname" .) | trunc 63 | trimSuffix "-") }}
{{- end }}

{{/* Labels. Call with (dict "ctx" $ "component" "operator"). */}}
{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "sluice.labels" -}}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/part-of: sluice
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{- end }}

{{/* "repository:tag", the tag defaulting to the chart's appVersion. Call with (dict "ctx" $ "image" .Values.x.image). */}}
{{- define "sluice.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* The namespaces the operator serves: watchNamespaces, or the release namespace. */}}
{{- define "sluice.operator.namespaces" -}}
{{- if .Values.operator.watchNamespaces }}
{{- join "," (uniq .Values.operator.watchNamespaces) }}
{{- else }}
{{- .Release.Namespace }}
{{- end }}
{{- end }}

{{/* worker.modelCache → the operator's --model-cache value (emptyDir | image | hostPath:/p | pvc:claim). */}}
{{- define "sluice.worker.modelCache" -}}
{{- $c := .Values.worker.modelCache }}
{{- if eq $c.type "hostPath" }}
{{- if not (hasPrefix "/" $c.path) }}{{ fail "worker.modelCache.path must be an absolute path when type is hostPath" }}{{ end }}
{{- printf "hostPath:%s" $c.path }}
{{- else if eq $c.type "pvc" }}
{{- if not $c.claimName }}{{ fail "worker.modelCache.claimName is required when type is pvc" }}{{ end }}
{{- printf "pvc:%s" $c.claimName }}
{{- else if has $c.type (list "emptyDir" "image") }}
{{- $c.type }}
{{- else }}
{{- fail (printf "worker.modelCache.type %q: expected emptyDir, image, hostPath or pvc" $c.type) }}
{{- end }}
{{- end }}

{{/* Pod and container security: non-root (the image's uid 1000), read-only root filesystem, no capabilities. */}}
{{- define "sluice.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "sluice.containerSecurityContext" -}}
runAsNonRoot: true
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end }}

{{/*
The operator's permissions: exactly the calls sluice/operator makes (kube.py) plus what kopf
itself needs (watching, patching its progress annotations, posting events). Listed in the
chart README. Cluster-wide only with operator.watchAllNamespaces. */}}
{{- define "sluice.operator.rules" -}}
- apiGroups: ["serving.sluice.dev"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.sluice.dev"]
  resources: ["inferenceservices/status"]
  verbs: ["get", "patch"]
- apiGroups: ["serving.sluice.dev"]
  resources: ["inferenceservices/finalizers"]
  verbs: ["update"]
- apiGroups: ["serving.sluice.dev"]
  resources: ["inferenceservices/scale"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["endpoints"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/* The router pods the operator's autoscaler reads (/autoscale/demand): this chart's router labels, any release, so router-only installs in other watched namespaces count too. */}}
{{- define "sluice.router.podSelector" -}}
{{- printf "app.kubernetes.io/name=%s,app.kubernetes.io/component=router" (include "sluice.name" .) }}
{{- end }}
