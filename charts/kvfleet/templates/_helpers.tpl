{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "kvfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: release-chart unless the release already contains the chart name. */}}
{{- define "kvfleet.fullname" -}}
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

{{/* chart-version for the helm.sh/chart label. */}}
{{- define "kvfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels. */}}
{{- define "kvfleet.labels" -}}
helm.sh/chart: {{ include "kvfleet.chart" . }}
{{ include "kvfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvfleet
{{- end }}

{{/* Selector labels. */}}
{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* ServiceAccount of the operator. */}}
{{- define "kvfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvfleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Control-plane image (operator, gateway). */}}
{{- define "kvfleet.controlPlaneImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{/* Gateway image (the control-plane image, as the operator's, unless set). */}}
{{- define "kvfleet.gatewayImage" -}}
{{- printf "%s:%s" (default .Values.operator.image.repository .Values.gateway.image.repository) (default .Chart.AppVersion .Values.gateway.image.tag) }}
{{- end }}

{{/* The same, by its former name. */}}
{{- define "kvfleet.operatorImage" -}}
{{- include "kvfleet.controlPlaneImage" . }}
{{- end }}

{{/* Engine image of `engine.kind: kvfleet` replicas. */}}
{{- define "kvfleet.engineImage" -}}
{{- printf "%s:%s" .Values.engine.image.repository (default .Chart.AppVersion .Values.engine.image.tag) }}
{{- end }}

{{/* The restricted Pod Security Standard, for every container the chart runs (the pod sets the user and seccomp). */}}
{{- define "kvfleet.restrictedContainerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end }}

{{/* The restricted Pod Security Standard at pod level: a non-root user and the runtime's seccomp profile. */}}
{{- define "kvfleet.restrictedPodSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end }}
