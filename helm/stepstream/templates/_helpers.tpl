{{/*
Names, labels and the pieces the workers and the topic Job share (image, Kafka
environment, checks of values that cannot work together).
*/}}

{{- define "stepstream.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<chart>, or the release name alone when it already holds the chart name. */}}
{{- define "stepstream.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The governing (headless) Service: it gives each worker a stable DNS name. */}}
{{- define "stepstream.headlessName" -}}
{{- printf "%s-workers" (include "stepstream.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "stepstream.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "stepstream.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "stepstream.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stepstream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Selects the worker pods (the only pods that serve the API). */}}
{{- define "stepstream.workerSelectorLabels" -}}
{{ include "stepstream.selectorLabels" . }}
app.kubernetes.io/component: worker
{{- end -}}

{{- define "stepstream.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "stepstream.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "stepstream.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "stepstream.apiScheme" -}}
{{- if .Values.api.tls.existingSecret }}https{{ else }}http{{ end -}}
{{- end -}}

{{/* The Secret and key of the API token ("" when api.insecure and no token). */}}
{{- define "stepstream.apiTokenSecret" -}}
{{- if .Values.api.existingSecret -}}
{{- .Values.api.existingSecret -}}
{{- else if or .Values.api.token (not .Values.api.insecure) -}}
{{- printf "%s-api" (include "stepstream.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "stepstream.apiTokenKey" -}}
{{- if .Values.api.existingSecret }}{{ .Values.api.existingSecretKey }}{{ else }}token{{ end -}}
{{- end -}}

{{- define "stepstream.saslEnabled" -}}
{{- if hasPrefix "SASL_" .Values.kafka.securityProtocol }}true{{ end -}}
{{- end -}}

{{- define "stepstream.kafkaTls" -}}
{{- if has .Values.kafka.securityProtocol (list "SSL" "SASL_SSL") }}true{{ end -}}
{{- end -}}

{{/* KEDA's name of the SASL mechanism. */}}
{{- define "stepstream.kedaSasl" -}}
{{- get (dict "PLAIN" "plaintext" "SCRAM-SHA-256" "scram_sha256" "SCRAM-SHA-512" "scram_sha512") .Values.kafka.sasl.mechanism -}}
{{- end -}}

{{/*
The TriggerAuthentication of KEDA's kafka trigger: the operator's, or the chart's when
the Kafka values hold credentials or certificates ("" when Kafka needs none).
*/}}
{{- define "stepstream.kedaKafkaAuth" -}}
{{- if .Values.keda.kafka.authenticationRef -}}
{{- .Values.keda.kafka.authenticationRef -}}
{{- else if or (include "stepstream.saslEnabled" .) (and (include "stepstream.kafkaTls" .) .Values.kafka.tls.existingSecret) -}}
{{- printf "%s-keda-kafka" (include "stepstream.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the SASL password: the user's, or the one the chart writes. */}}
{{- define "stepstream.kafkaSecret" -}}
{{- default (printf "%s-kafka" (include "stepstream.fullname" .)) .Values.kafka.sasl.existingSecret -}}
{{- end -}}

{{- define "stepstream.kafkaPasswordKey" -}}
{{- if .Values.kafka.sasl.existingSecret }}{{ .Values.kafka.sasl.passwordKey }}{{ else }}sasl-password{{ end -}}
{{- end -}}

{{/*
The Kafka client environment of the workers and the topic Job. Call with a dict:
  root: the chart context; secret: the Secret holding the SASL password.
The Job passes its own copy of a chart-written Secret, as a pre-install hook runs
before the release's Secrets exist.
*/}}
{{- define "stepstream.kafkaEnv" -}}
{{- $root := .root -}}
{{- $kafka := $root.Values.kafka -}}
- name: STEPSTREAM_KAFKA_BOOTSTRAP_SERVERS
  value: {{ $kafka.bootstrapServers | quote }}
- name: STEPSTREAM_PREFIX
  value: {{ $kafka.prefix | quote }}
- name: STEPSTREAM_KAFKA_SECURITY_PROTOCOL
  value: {{ $kafka.securityProtocol | quote }}
{{- if include "stepstream.saslEnabled" $root }}
- name: STEPSTREAM_KAFKA_SASL_MECHANISM
  value: {{ $kafka.sasl.mechanism | quote }}
{{- if and $kafka.sasl.existingSecret $kafka.sasl.usernameKey }}
- name: STEPSTREAM_KAFKA_SASL_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ $kafka.sasl.existingSecret }}
      key: {{ $kafka.sasl.usernameKey }}
{{- else }}
- name: STEPSTREAM_KAFKA_SASL_USERNAME
  value: {{ $kafka.sasl.username | quote }}
{{- end }}
- name: STEPSTREAM_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .secret }}
      key: {{ include "stepstream.kafkaPasswordKey" $root }}
{{- end }}
{{- if $kafka.tls.existingSecret }}
- name: STEPSTREAM_KAFKA_SSL_CA_LOCATION
  value: /etc/stepstream/kafka-tls/{{ $kafka.tls.caKey }}
{{- if $kafka.tls.certKey }}
- name: STEPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION
  value: /etc/stepstream/kafka-tls/{{ $kafka.tls.certKey }}
- name: STEPSTREAM_KAFKA_SSL_KEY_LOCATION
  value: /etc/stepstream/kafka-tls/{{ $kafka.tls.keyKey }}
{{- end }}
{{- end }}
{{- if $kafka.configSecret.name }}
- name: STEPSTREAM_KAFKA_CONFIG
  value: /etc/stepstream/kafka-config/{{ $kafka.configSecret.key }}
{{- end }}
{{- range $key, $value := $kafka.config }}
- name: STEPSTREAM_KAFKA_{{ $key | upper | replace "." "_" }}
  {{- /* Values files are read as floats: toString would write 10000000 as 1e+07, which
  librdkafka reads as 1. JSON writes a number in full, and true as true. */}}
  value: {{ if kindIs "string" $value }}{{ $value | quote }}{{ else }}{{ $value | toJson | quote }}{{ end }}
{{- end }}
{{- end -}}

{{/* The Kafka certificates and properties file, mounted from the operator's Secrets. */}}
{{- define "stepstream.kafkaVolumes" -}}
{{- if .Values.kafka.tls.existingSecret }}
- name: kafka-tls
  secret:
    secretName: {{ .Values.kafka.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- if .Values.kafka.configSecret.name }}
- name: kafka-config
  secret:
    secretName: {{ .Values.kafka.configSecret.name }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "stepstream.kafkaMounts" -}}
{{- if .Values.kafka.tls.existingSecret }}
- name: kafka-tls
  mountPath: /etc/stepstream/kafka-tls
  readOnly: true
{{- end }}
{{- if .Values.kafka.configSecret.name }}
- name: kafka-config
  mountPath: /etc/stepstream/kafka-config
  readOnly: true
{{- end }}
{{- end -}}

{{/*
Combinations values.schema.json cannot express. Each message says what to change.
*/}}
{{- define "stepstream.validate" -}}
{{- $w := .Values.workers -}}
{{- if le (int $w.terminationGracePeriodSeconds) (add (int $w.drainTimeoutSeconds) 9 | int) -}}
{{- fail (printf "workers.terminationGracePeriodSeconds (%d) must exceed workers.drainTimeoutSeconds (%d) by 10 s or more: Kubernetes kills a worker still draining, and the step attempts it was finishing come back as AttemptLost. Raise terminationGracePeriodSeconds or lower drainTimeoutSeconds." (int $w.terminationGracePeriodSeconds) (int $w.drainTimeoutSeconds)) -}}
{{- end -}}
{{- if and (include "stepstream.saslEnabled" .) (not .Values.kafka.sasl.existingSecret) (not .Values.kafka.sasl.password) -}}
{{- fail (printf "kafka.securityProtocol is %s but no SASL password is given: set kafka.sasl.existingSecret (a Secret with key %q) or kafka.sasl.password." .Values.kafka.securityProtocol .Values.kafka.sasl.passwordKey) -}}
{{- end -}}
{{- if and (include "stepstream.saslEnabled" .) (not .Values.kafka.sasl.username) (not (and .Values.kafka.sasl.existingSecret .Values.kafka.sasl.usernameKey)) -}}
{{- fail "kafka.securityProtocol uses SASL but no user name is given: set kafka.sasl.username, or kafka.sasl.usernameKey with kafka.sasl.existingSecret." -}}
{{- end -}}
{{- if and .Values.kafka.tls.certKey (not .Values.kafka.tls.keyKey) -}}
{{- fail "kafka.tls.certKey is set without kafka.tls.keyKey: a client certificate needs its private key (both keys of kafka.tls.existingSecret)." -}}
{{- end -}}
{{- if and (or .Values.kafka.tls.certKey .Values.kafka.tls.keyKey) (not .Values.kafka.tls.existingSecret) -}}
{{- fail "kafka.tls.certKey/keyKey name keys of kafka.tls.existingSecret, which is empty: set it to the Secret holding the CA and client certificate." -}}
{{- end -}}
{{- if and .Values.api.tls.caKey (not .Values.api.tls.existingSecret) -}}
{{- fail "api.tls.caKey names a key of api.tls.existingSecret, which is empty: set it to the kubernetes.io/tls Secret the workers serve https with." -}}
{{- end -}}
{{- if and .Values.ingress.enabled (not .Values.ingress.hosts) -}}
{{- fail "ingress.enabled needs ingress.hosts: the host names the Ingress serves the UI and API at, e.g. [{host: workflows.example.com}]." -}}
{{- end -}}
{{- if .Values.keda.enabled -}}
{{- if and (eq .Values.keda.trigger "prometheus") (not .Values.keda.prometheus.serverAddress) -}}
{{- fail "keda.trigger prometheus needs keda.prometheus.serverAddress: the Prometheus URL KEDA reads stepstream_consumer_lag_records from (e.g. http://prometheus-operated.monitoring:9090); or use keda.trigger kafka, which reads the lag from Kafka." -}}
{{- end -}}
{{- if gt (int .Values.keda.maxReplicaCount) (int .Values.topics.partitions) -}}
{{- fail (printf "keda.maxReplicaCount (%d) exceeds topics.partitions (%d): workers beyond the partition count own nothing. Lower keda.maxReplicaCount." (int .Values.keda.maxReplicaCount) (int .Values.topics.partitions)) -}}
{{- end -}}
{{- if gt (int .Values.keda.minReplicaCount) (int .Values.keda.maxReplicaCount) -}}
{{- fail (printf "keda.minReplicaCount (%d) exceeds keda.maxReplicaCount (%d)." (int .Values.keda.minReplicaCount) (int .Values.keda.maxReplicaCount)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
