{{/* The release's full name, at most 63 characters. */}}
{{- define "meshtrain.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "meshtrain.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "meshtrain.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "meshtrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "meshtrain.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Fails the install when a monitoring resource is enabled on a cluster without the
     Prometheus Operator's CRDs: $.kind names what needs them, $.value the value that asked. */}}
{{- define "meshtrain.requireMonitoringCRDs" -}}
{{- if not (.root.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" .kind)) -}}
{{- fail (printf "%s is true, but this cluster has no monitoring.coreos.com/v1 %s: install the Prometheus Operator (for example kube-prometheus-stack) first, or set %s=false" .value .kind .value) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the operator's launcher key: launcherKey.existingSecret, or the chart's own. */}}
{{- define "meshtrain.launcherKeySecret" -}}
{{- .Values.operator.launcherKey.existingSecret | default (printf "%s-launcher-key" (include "meshtrain.fullname" .)) -}}
{{- end -}}
