{{/* The prefix of every object's name: the release name, with the chart's name unless it already has it. */}}
{{- define "sluice.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The labels that select one component's pods; call with (list $ "replica"). */}}
{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ (index . 0).Chart.Name }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "sluice.labels" -}}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/version: {{ (index . 0).Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ (index . 0).Release.Service }}
helm.sh/chart: {{ printf "%s-%s" (index . 0).Chart.Name (index . 0).Chart.Version }}
{{- end -}}

{{- define "sluice.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* The Secret holding the API key, or nothing when there is none. */}}
{{- define "sluice.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret -}}
{{ .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.value -}}
{{ include "sluice.fullname" . }}-api-key
{{- end -}}
{{- end -}}

{{- define "sluice.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
{{- end -}}

{{- define "sluice.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "sluice.modelsVolume" -}}
- name: models
{{- if .Values.model.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: 20Gi
{{- end }}
{{- end -}}
