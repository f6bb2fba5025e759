{{/* Labels every object carries. */}}
{{- define "prizepool.labels" -}}
app.kubernetes.io/name: prizepool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* Selector labels of one part: call with (dict "root" $ "part" "draw-worker"). */}}
{{- define "prizepool.selector" -}}
app.kubernetes.io/name: prizepool
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .part }}
{{- end }}

{{- define "prizepool.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}

{{- define "prizepool.secretName" -}}
{{- if .Values.secrets.create -}}
{{ .Release.Name }}-secrets
{{- else -}}
{{ required "secrets.existingSecret must name a Secret when secrets.create is false" .Values.secrets.existingSecret }}
{{- end -}}
{{- end }}

{{- define "prizepool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ default (printf "%s-workers" .Release.Name) .Values.serviceAccount.name }}
{{- else -}}
{{ default "default" .Values.serviceAccount.name }}
{{- end -}}
{{- end }}

{{/*
Refuses a credential URL (or a comma-separated list of them) without a
password or with a well-known default one.
Call with (dict "name" "AMQP_URL" "value" .Values.secrets.amqpUrl).
*/}}
{{- define "prizepool.checkUrl" -}}
{{- $weak := list "guest" "password" "postgres" "redis" "admin" "root" "secret" "changeme" "change-me" "prizepool" "test" "123456" -}}
{{- range $url := splitList "," .value -}}
{{- $url = trim $url -}}
{{- if $url -}}
{{- $parsed := urlParse $url -}}
{{- $userinfo := get $parsed "userinfo" -}}
{{- $query := get $parsed "query" -}}
{{- $password := "" -}}
{{- if contains ":" $userinfo -}}
{{- $password = regexReplaceAll "^[^:]*:" $userinfo "" -}}
{{- else if regexMatch "(^|&)password=" $query -}}
{{- $password = regexReplaceAll "^(.*&)?password=([^&]*).*$" $query "${2}" -}}
{{- end -}}
{{- if and (eq $password "") (not (regexMatch "(^|&)sslcert=" $query)) -}}
{{- fail (printf "secrets: %s has a URL without a password" $.name) -}}
{{- end -}}
{{- if has (lower $password) $weak -}}
{{- fail (printf "secrets: %s uses a well-known default password" $.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* Environment shared by the workers and the migration Job. */}}
{{- define "prizepool.env" -}}
- name: METRICS_ADDR
  value: {{ printf "0.0.0.0:%v" .Values.metricsPort | quote }}
{{- range $name, $value := .Values.config }}
{{- if ne (toString $value) "" }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- if .Values.tls.secretName }}
- name: TLS_CA_FILE
  value: /etc/prizepool/tls/ca.crt
{{- if .Values.tls.clientCertificate }}
- name: TLS_CERT_FILE
  value: /etc/prizepool/tls/tls.crt
- name: TLS_KEY_FILE
  value: /etc/prizepool/tls/tls.key
{{- end }}
{{- end }}
{{- range $key := list "AMQP_URL" "REDIS_URL" "DATABASE_URL" "LEDGER_SEAL_KEY" }}
- name: {{ $key }}
  valueFrom:
    secretKeyRef:
      name: {{ include "prizepool.secretName" $ }}
      key: {{ $key }}
{{- end }}
{{- end }}

{{/* Volumes: a small writable /tmp (the root filesystem is read-only) and the TLS files. */}}
{{- define "prizepool.volumes" -}}
- name: tmp
  emptyDir:
    medium: Memory
    sizeLimit: 16Mi
{{- if .Values.tls.secretName }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "prizepool.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.secretName }}
- name: tls
  mountPath: /etc/prizepool/tls
  readOnly: true
{{- end }}
{{- end }}

{{/*
Pod-level settings every prizepool pod shares. Call with
(dict "root" $ "hook" false); a hook's pod (the migration Job runs before
the release's own objects exist) uses the namespace's default account.
*/}}
{{- define "prizepool.podSpec" -}}
{{- $hook := .hook -}}
{{- with .root -}}
{{- if not $hook }}
serviceAccountName: {{ include "prizepool.serviceAccountName" . }}
{{- end }}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  {{- include "prizepool.volumes" . | nindent 2 }}
{{- end }}
{{- end }}
