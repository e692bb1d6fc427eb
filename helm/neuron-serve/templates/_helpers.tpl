{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "neuron-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name. Truncated to 47 characters: KubeRay refuses longer RayService
names, since the RayCluster and Service names it derives from them must fit in 63.
*/}}
{{- define "neuron-serve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "neuron-serve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "neuron-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "neuron-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "neuron-serve.labels" -}}
helm.sh/chart: {{ include "neuron-serve.chart" . }}
{{ include "neuron-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels of the pods that serve requests: the Deployment's pods, or the RayService's
head and workers (the Serve proxy runs on every Ray node). The Service, the PDB and the
ServiceMonitor select by these.
*/}}
{{- define "neuron-serve.servingLabels" -}}
{{ include "neuron-serve.selectorLabels" . }}
app.kubernetes.io/component: server
{{- end }}

{{- define "neuron-serve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "neuron-serve.configMapName" -}}
{{- default (printf "%s-model" (include "neuron-serve.fullname" .)) .Values.modelConfig.existingConfigMap }}
{{- end }}

{{- define "neuron-serve.claimName" -}}
{{- default (printf "%s-compile-cache" (include "neuron-serve.fullname" .)) .Values.compileCache.existingClaim }}
{{- end }}

{{/* The inline model.yaml as text, whichever form the values give it in. */}}
{{- define "neuron-serve.modelYaml" -}}
{{- $inline := .Values.modelConfig.inline }}
{{- if kindIs "string" $inline }}
{{- $inline }}
{{- else }}
{{- toYaml $inline }}
{{- end }}
{{- end }}

{{- define "neuron-serve.modelName" -}}
{{- $name := .Values.ray.modelName }}
{{- if and (not $name) (not .Values.modelConfig.existingConfigMap) }}
{{- $name = (include "neuron-serve.modelYaml" . | fromYaml).name }}
{{- end }}
{{- if not $name }}
{{- fail "ray.modelName: set it to the name in the model.yaml of modelConfig.existingConfigMap." }}
{{- end }}
{{- $name }}
{{- end }}

{{- define "neuron-serve.configPath" -}}
/etc/neuron-serve/model.yaml
{{- end }}

{{/* The serving container's resources with the NeuronCore request added. */}}
{{- define "neuron-serve.neuronResources" -}}
{{- $resources := deepCopy .Values.resources }}
{{- $cores := int .Values.neuron.cores }}
{{- $_ := set $resources "limits" (merge (dict "aws.amazon.com/neuroncore" $cores) (default dict $resources.limits)) }}
{{- /* Extended resources cannot be overcommitted: a request must equal the limit. */}}
{{- $_ := set $resources "requests" (merge (dict "aws.amazon.com/neuroncore" $cores) (default dict $resources.requests)) }}
{{- toYaml $resources }}
{{- end }}

{{- define "neuron-serve.env" -}}
{{- /* Library caches (torch hub, pip, ...) default to $HOME, which is read-only here. */ -}}
- name: XDG_CACHE_HOME
  value: /tmp/.cache
{{- with .Values.server.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Environment of containers that compile, where the compile cache is mounted. */}}
{{- define "neuron-serve.compileEnv" -}}
- name: NEURON_SERVE_CACHE_DIR
  value: {{ .Values.compileCache.mountPath | quote }}
{{- /* neuronx-cc caches NEFFs under /var/tmp by default, which is read-only here. */}}
- name: NEURON_COMPILE_CACHE_URL
  value: {{ printf "%s/neuronx-cc" .Values.compileCache.mountPath | quote }}
{{ include "neuron-serve.env" . }}
{{- end }}

{{/*
Volumes come in pieces because pods differ: the Ray head neither compiles nor gets
/dev/shm from the chart (KubeRay adds one sized to the container's memory).
*/}}
{{- define "neuron-serve.configVolume" -}}
- name: model-config
  configMap:
    name: {{ include "neuron-serve.configMapName" . }}
    items:
      - key: {{ ternary .Values.modelConfig.existingConfigMapKey "model.yaml" (ne .Values.modelConfig.existingConfigMap "") }}
        path: model.yaml
{{- end }}

{{- define "neuron-serve.configMount" -}}
- name: model-config
  mountPath: /etc/neuron-serve
  readOnly: true
{{- end }}

{{- define "neuron-serve.cacheVolume" -}}
- name: compile-cache
{{- if .Values.compileCache.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "neuron-serve.claimName" . }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "neuron-serve.cacheMount" -}}
- name: compile-cache
  mountPath: {{ .Values.compileCache.mountPath }}
{{- end }}

{{/* The root filesystem is read-only; this is the scratch space. */}}
{{- define "neuron-serve.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}

{{- define "neuron-serve.tmpMount" -}}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* The container runtime's default /dev/shm (64 MiB) is too small for Ray's object store. */}}
{{- define "neuron-serve.shmVolume" -}}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSizeLimit }}
{{- end }}

{{- define "neuron-serve.shmMount" -}}
- name: shm
  mountPath: /dev/shm
{{- end }}

{{- define "neuron-serve.podScheduling" -}}
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
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "neuron-serve.podMetadata" -}}
{{- $annotations := deepCopy .Values.podAnnotations }}
{{- if not .Values.modelConfig.existingConfigMap }}
{{- /* Roll the pods when the inline model.yaml changes. */}}
{{- $_ := set $annotations "checksum/model-config" (include "neuron-serve.modelYaml" . | sha256sum) }}
{{- end -}}
labels:
  {{- include "neuron-serve.servingLabels" . | nindent 2 }}
  {{- with .Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "neuron-serve.validate" -}}
{{- if and (eq .Values.mode "rayservice") .Values.server.grpc.enabled }}
{{- fail "server.grpc.enabled is for mode=deployment (a RayService's server replica may run on any Ray node); set server.grpc.enabled=false." }}
{{- end }}
{{- if and (eq .Values.probes.protocol "grpc") (not .Values.server.grpc.enabled) }}
{{- fail "probes.protocol=grpc needs server.grpc.enabled=true; or use probes.protocol=http." }}
{{- end }}
{{- if and (eq .Values.mode "rayservice") .Values.autoscaling.enabled }}
{{- fail "autoscaling.enabled is for mode=deployment; scale a RayService with ray.worker.replicas." }}
{{- end }}
{{- /* The schema cannot look inside a model.yaml given as text; check its shape here. */}}
{{- if not .Values.modelConfig.existingConfigMap }}
{{- $model := include "neuron-serve.modelYaml" . | fromYaml }}
{{- if hasKey $model "Error" }}
{{- fail (printf "modelConfig.inline is not a YAML mapping: %s" $model.Error) }}
{{- end }}
{{- /* A task: generate model takes text, so it names no inputs. */}}
{{- $required := ternary (list "name" "model") (list "name" "model" "inputs") (eq ($model.task | default "infer") "generate") }}
{{- range $required }}
{{- if not (hasKey $model .) }}
{{- fail (printf "modelConfig.inline: the model.yaml has no '%s'; add it (see neuron-serve's model.yaml schema)." .) }}
{{- end }}
{{- end }}
{{- /* Replicas that find no free NeuronCore would wait until the startup probe gives up. */}}
{{- $replicas := $model.replicas | default 1 }}
{{- if $model.autoscaling }}
{{- $replicas = $model.autoscaling.max_replicas | default 1 }}
{{- end }}
{{- $needed := mul ($model.cores_per_replica | default 1) $replicas }}
{{- $granted := mul .Values.neuron.cores (ternary .Values.ray.worker.replicas 1 (eq .Values.mode "rayservice")) }}
{{- if gt (int ($model.cores_per_replica | default 1)) (int .Values.neuron.cores) }}
{{- fail (printf "the model.yaml's cores_per_replica (%d) exceeds neuron.cores (%d), the NeuronCores of one pod." (int $model.cores_per_replica) (int .Values.neuron.cores)) }}
{{- end }}
{{- if gt (int $needed) (int $granted) }}
{{- fail (printf "the model.yaml needs %d NeuronCores (cores_per_replica x replicas) but the chart grants %d; raise neuron.cores%s." (int $needed) (int $granted) (ternary " or ray.worker.replicas" "" (eq .Values.mode "rayservice"))) }}
{{- end }}
{{- end }}
{{- end }}
