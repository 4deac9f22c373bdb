{{/* Names and labels shared by every template. */}}

{{- define "kora.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kora.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kora.labels" -}}
{{ include "kora.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: kora
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kora.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kora.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kora.keySecretName" -}}
{{- default (printf "%s-key" (include "kora.fullname" .)) .Values.operatorKey.secretName -}}
{{- end -}}

{{/* k=v,k=v: the operator's pod labels as KORA_OPERATOR_POD_LABELS / KORA_KUBERAY_OPERATOR_POD_LABELS take them */}}
{{- define "kora.labelList" -}}
{{- $out := list -}}
{{- range $k, $v := . -}}
{{- $out = append $out (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{- define "kora.watchNamespace" -}}
{{- default .Release.Namespace .Values.watchNamespace -}}
{{- end -}}

{{/* The operator's rules, shared by the ClusterRole and the Role: nothing more than it uses. */}}
{{- define "kora.rules" -}}
# the jobs: watched; metadata patched by kopf (a retried handler's progress, a runtime-Ray job's finalizer); status
# written through /status
- apiGroups: ["kora.dev"]
  resources: ["loratrainingjobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kora.dev"]
  resources: ["loratrainingjobs/status"]
  verbs: ["get", "patch"]
# the children's and adapters' ownerReferences block their job's deletion (blockOwnerDeletion): where the
# OwnerReferencesPermissionEnforcement admission plugin runs, setting that needs update on the job's finalizers
- apiGroups: ["kora.dev"]
  resources: ["loratrainingjobs/finalizers"]
  verbs: ["update"]
# the adapters: watched; metadata patched (kopf's annotations, the owner reference to their job, our finalizer
# while their job's trainer holds them); status written through /status; never created or deleted
- apiGroups: ["kora.dev"]
  resources: ["loraadapters"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kora.dev"]
  resources: ["loraadapters/status"]
  verbs: ["get", "patch"]
# children: created, read back, lifecycle fields patched; the garbage collector deletes them
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create"]
# create only: the operator never reads a Secret back (a 409 tells it the token or engine key exists)
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
{{- if .Values.networkPolicy.enabled }}
# each KubeRay job's NetworkPolicy: created and read back like the ConfigMap; the garbage collector deletes it
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create"]
{{- end }}
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
