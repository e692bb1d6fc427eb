"""Every Prometheus metric neuron-serve exports, with its labels, in one place.

Replicas are separate processes (Ray actors), so metrics use prometheus-client's
multiprocess mode: each process writes its samples under PROMETHEUS_MULTIPROC_DIR and
the scrape endpoint (``/metrics`` on the HTTP port) merges every process's files. The
directory must be set before prometheus_client is first imported in a process;
:func:`multiproc_dir` picks it and the Ray deployments pass it to every replica.
"""

from __future__ import annotations

import os
import tempfile

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiproc_dir() -> str:
    """The shared metrics directory of this machine's neuron-serve processes."""
    if MULTIPROC_ENV not in os.environ:
        path = os.path.join(tempfile.gettempdir(), "neuron-serve-metrics")
        os.makedirs(path, exist_ok=True)
        os.environ[MULTIPROC_ENV] = path
    return os.environ[MULTIPROC_ENV]


multiproc_dir()

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402
from prometheus_client import multiprocess  # noqa: E402

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

REQUEST_LATENCY = Histogram(
    "neuron_serve_request_latency_seconds", "End-to-end latency of an infer request inside the replica",
    ["model", "replica"], buckets=LATENCY_BUCKETS,
)
QUEUE_TIME = Histogram(
    "neuron_serve_queue_time_seconds", "Time a request waited in the batcher before its batch started",
    ["model", "replica"], buckets=LATENCY_BUCKETS,
)
BATCH_SIZE = Histogram(
    "neuron_serve_batch_size_rows", "Rows per batch formed by the request batcher",
    ["model", "replica"], buckets=BATCH_BUCKETS,
)
PARTITION_TIME = Histogram(
    "neuron_serve_partition_seconds", "Time of one partition (subgraph) run, by device kind and core",
    ["model", "replica", "partition", "device", "core"], buckets=LATENCY_BUCKETS,
)
CORE_BATCHES = Counter(
    "neuron_serve_core_chunks_total", "Chunks (compiled-size calls of the whole model) run per core",
    ["model", "replica", "core"],
)
# Pipelined models (placement mode pipeline): what each stage holds on its core and what crosses into it.
STAGE_MEMORY = Gauge(
    "neuron_serve_stage_memory_bytes",
    "Memory of one pipeline stage on its core (weights plus activations, as the partitioner sized it)",
    ["model", "replica", "bucket", "batch_size", "partition", "core"], multiprocess_mode="max",
)
STAGE_INPUT_BYTES = Counter(
    "neuron_serve_stage_input_bytes_total",
    "Activation bytes handed to a pipeline stage on its core (from the previous stage's core or the request)",
    ["model", "replica", "partition", "core"],
)
SIZE_CHUNKS = Counter(
    "neuron_serve_batch_size_chunks_total", "Chunks run per compiled batch size",
    ["model", "replica", "batch_size"],
)
BATCH_PADDING = Histogram(
    "neuron_serve_batch_padding_rows", "Padded rows per batch (dynamic-batch remainder, per shape bucket)",
    ["model", "replica"], buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
)
REQUESTS = Counter(
    "neuron_serve_requests_total", "Infer requests by outcome (HTTP status code)",
    ["model", "replica", "code"],
)
# A gRPC call for a model another replica received (Triton's and KServe's clients name the
# model in the message): ``via`` "relay" went straight to a replica of ``model``'s private
# port, "serve" through the Serve handle (no replica of it registered).
GRPC_FORWARDED = Counter(
    "neuron_serve_grpc_forwarded_total", "gRPC calls for another model, passed to its replicas (via relay or serve)",
    ["model", "via"],
)
PADDING_ROWS = Counter(
    "neuron_serve_padding_rows_total", "Rows added to fill compiled batch or bucket shapes (wasted work)",
    ["model", "replica"],
)
COMPILE_TIME = Histogram(
    "neuron_serve_build_seconds", "Time to build (capture, partition, compile, load) a model on a replica",
    ["model", "replica"], buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
)
BUILD_COMPILES = Counter(
    "neuron_serve_build_compiles_total",
    "Subgraph executables the model's build compiled on a replica (a trace compiles each accelerator subgraph at "
    "each compiled size; loading an artifact compiles them again in emulation; swapping in 'weights' compiles none)",
    ["model", "replica"],
)
# A replica's compile queue (assembly/queue.py): how each compiled model went, and where the
# model's compiles stand (a replica is ready on its first compiled models and compiles the
# rest in the background, model.yaml's background_compile). ``bucket`` names the compiled
# model as its progress line does ("batch 16", "bucket 2 batch 4"; the model's name alone
# when it has one compiled model).
COMPILE_SECONDS = Gauge(
    "neuron_serve_compile_seconds", "Seconds one compiled model (a shape bucket at a batch size) took to compile",
    ["model", "replica", "bucket"], multiprocess_mode="max",
)
# Host memory a model's process holds (assembly/host_memory.report), by kind: resident (the whole process), weights
# (the copy of record on the host), weights_on_cores and kv_cache (every core's; host memory on emulated cores),
# compiled_models (what the compiled models kept: code and bookkeeping).
HOST_MEMORY = Gauge(
    "neuron_serve_host_memory_bytes", "Host memory a model's process holds, by kind: resident, weights, "
    "weights_on_cores, kv_cache, compiled_models", ["model", "replica", "kind"], multiprocess_mode="livemax",
)
COMPILED_MODELS = Gauge(
    "neuron_serve_compiled_models",
    "A replica's compiled models by state: compiled, pending (queued or compiling) or failed",
    ["model", "replica", "state"], multiprocess_mode="livemax",
)
# Padding (buckets/usage.py): the real units a bucket's calls computed and the units they padded (a generate
# model's prompt tokens, decode rows, chunk tokens), so padded / (real + padded) is the work done for nothing.
BUCKET_WORK = Counter(
    "neuron_serve_bucket_work",
    "Units (tokens or rows) a compiled bucket's calls ran, by kind: real (the requests') or padded (up to the bucket)",
    ["model", "replica", "family", "bucket", "kind"],
)
BUCKET_SWITCHES = Counter(
    "neuron_serve_bucket_switches",
    "Times a running replica changed a family's compiled buckets for those its traffic pads least (buckets: auto), "
    "by outcome: switched, or abandoned (a compile of the new buckets failed; the old ones serve on)",
    ["model", "replica", "family", "outcome"],
)
CACHE_HITS = Counter(
    "neuron_serve_compile_cache_hits_total", "Operator-support and compile cache hits",
    ["model", "replica", "cache"],
)

# Triton's statistics extension (GET /v2/models/{name}/stats) is computed from these, so
# it sums every replica on the node. ``stat`` is one of Triton's duration statistics:
# success, fail, queue, compute_input, compute_infer, compute_output.
INFER_STAT_COUNT = Counter(
    "neuron_serve_inference_stat_count", "Requests counted in each of Triton's inference statistics",
    ["model", "replica", "stat"],
)
INFER_STAT_SECONDS = Counter(
    "neuron_serve_inference_stat_seconds", "Cumulative seconds of each of Triton's inference statistics",
    ["model", "replica", "stat"],
)
EXECUTIONS = Counter(
    "neuron_serve_executions", "Batches that ran and gave at least one request its result (Triton's execution_count)",
    ["model", "replica"],
)
INFERENCES = Counter(
    "neuron_serve_inferences", "Rows of successful requests (Triton's inference_count)",
    ["model", "replica"],
)
SIZE_COST = Gauge(
    "neuron_serve_batch_size_cost_seconds",
    "Seconds per call of each compiled batch size, timed on a core when the model loaded (what sizes are chosen by)",
    ["model", "replica", "bucket", "batch_size"], multiprocess_mode="max",
)
LAST_INFERENCE = Gauge(
    "neuron_serve_last_inference_timestamp_seconds", "Unix time of the last successful request",
    ["model", "replica"], multiprocess_mode="max",
)

# NeuronCore metrics under the names (and core/runtime labels) of neuron-monitor's
# Prometheus exporter (neuron-monitor-prometheus.py), so Neuron dashboards and the
# CloudWatch agent read them; ``runtime_tag`` is the replica's process id, as
# neuron-monitor tags runtimes, and ``emulated`` says whether the cores are XLA:CPU.
# Sampled by neuron_serve.serve.infer.neuron_monitor every NEURON_MONITOR_PERIOD_S seconds.
NEURON_LABELS = ["model", "replica", "runtime_tag", "emulated"]
NEURONCORE_UTILIZATION = Gauge(
    "neuroncore_utilization_ratio", "NeuronCore utilization ratio (busy time over wall time in the last period)",
    [*NEURON_LABELS, "neuroncore"], multiprocess_mode="max",
)
EXECUTION_STATUS = Counter(
    "execution_status", "Execution status total (one execution: one compiled subgraph run on a core)",
    [*NEURON_LABELS, "status_type"],
)
EXECUTION_ERRORS = Counter(
    "execution_errors", "Execution errors total", [*NEURON_LABELS, "error_type"],
)
EXECUTION_LATENCY = Gauge(
    "execution_latency_seconds", "Execution latency in seconds, percentiles over the last period with executions",
    [*NEURON_LABELS, "percentile"], multiprocess_mode="max",
)


# Generation (task: generate), named and labelled as vLLM's metrics are (``vllm:`` ->
# ``neuron_serve_``, the model in ``model_name``), so a vLLM dashboard reads them with a
# prefix change; ``replica`` is added, as every metric here has it.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                         0.75, 1.0, 2.5)
GEN_LABELS = ["model_name", "replica"]
TIME_TO_FIRST_TOKEN = Histogram(
    "neuron_serve_time_to_first_token_seconds", "Time from a generate request's arrival to its first token",
    GEN_LABELS, buckets=LATENCY_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "neuron_serve_time_per_output_token_seconds", "Time between two tokens of one sequence",
    GEN_LABELS, buckets=TOKEN_LATENCY_BUCKETS,
)
# vLLM v1's name for the time between two tokens of a stream (its time_per_output_token, renamed): what chunked
# prefill is for, a stream's stall while a long prompt is prefilled shows in its tail.
INTER_TOKEN_LATENCY = Histogram(
    "neuron_serve_inter_token_latency_seconds", "Time between two tokens of one sequence (vLLM v1's name)",
    GEN_LABELS, buckets=TOKEN_LATENCY_BUCKETS,
)
# vLLM's iteration_tokens_total, by kind: a step's prompt tokens (whole prefills and a chunk) and decode rows.
ITERATION_TOKENS = Histogram(
    "neuron_serve_iteration_tokens", "Tokens of one engine step, by kind (prompt: prefilled; decode: rows decoded)",
    [*GEN_LABELS, "kind"], buckets=(0, 1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
)
CHUNKED_STEPS = Counter("neuron_serve_chunked_prefill_steps", "Engine steps whose call carried a prompt's chunk "
                                                               "beside the decode rows (chunked prefill)", GEN_LABELS)
E2E_REQUEST_LATENCY = Histogram(
    "neuron_serve_e2e_request_latency_seconds", "Time from a generate request's arrival to its last token",
    GEN_LABELS, buckets=LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter("neuron_serve_prompt_tokens", "Prompt tokens prefilled (task: generate) or pooled (embed, score, "
                                                       "classify)", GEN_LABELS)
GENERATION_TOKENS = Counter("neuron_serve_generation_tokens", "Tokens generated", GEN_LABELS)
# vLLM's prefix_cache_queries / prefix_cache_hits, in tokens: with generation.enable_prefix_caching.
PREFIX_CACHE_QUERIES = Counter("neuron_serve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                               GEN_LABELS)
# vLLM's spec_decode_* counters, with generation.speculative_config.
SPEC_DRAFTS = Counter("neuron_serve_spec_decode_num_drafts", "Speculative rounds with proposals, per sequence",
                      GEN_LABELS)
SPEC_DRAFT_TOKENS = Counter("neuron_serve_spec_decode_num_draft_tokens", "Tokens proposed", GEN_LABELS)
SPEC_ACCEPTED_TOKENS = Counter("neuron_serve_spec_decode_num_accepted_tokens", "Proposed tokens the model accepted",
                               GEN_LABELS)
SPEC_ACCEPTED_PER_POSITION = Counter("neuron_serve_spec_decode_num_accepted_tokens_per_pos",
                                     "Proposed tokens accepted, by their position in the round",
                                     [*GEN_LABELS, "position"])
PREFIX_CACHE_HITS = Counter("neuron_serve_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)",
                            GEN_LABELS)
REQUESTS_RUNNING = Gauge(
    "neuron_serve_num_requests_running", "Sequences holding a KV-cache slot", GEN_LABELS, multiprocess_mode="livesum",
)
REQUESTS_WAITING = Gauge(
    "neuron_serve_num_requests_waiting", "Generate requests waiting for a slot", GEN_LABELS,
    multiprocess_mode="livesum",
)
KV_SLOTS_USAGE = Gauge(
    "neuron_serve_kv_cache_usage_perc", "Fraction of KV-cache slots in use (1 = every slot)", GEN_LABELS,
    multiprocess_mode="livemax",
)
REQUEST_SUCCESS = Counter(
    "neuron_serve_request_success", "Finished generate requests by finish reason (stop, length, abort)",
    [*GEN_LABELS, "finished_reason"],
)
PREEMPTIONS = Counter("neuron_serve_num_preemptions", "Sequences preempted (a slot taken back before they ended)",
                      GEN_LABELS)
CORE_MEMORY = Gauge(
    "neuron_serve_core_memory_bytes",
    "Bytes one core of a generate model's engine holds, by kind (weights, kv_cache, and lora: the LoRA adapter "
    "buffers): its share under tensor parallelism", [*GEN_LABELS, "kind"], multiprocess_mode="livemax",
)
# vLLM's lora_requests_info: its value the time of the last change, its labels the adapters of the running and of
# the waiting requests (comma-separated) and max_lora; with generation.lora.
LORA_REQUESTS_INFO = Gauge(
    "neuron_serve_lora_requests_info", "LoRA adapters of the running and the waiting requests",
    [*GEN_LABELS, "max_lora", "running_lora_adapters", "waiting_lora_adapters"], multiprocess_mode="livemax",
)
ADAPTER_LOAD_SECONDS = Histogram(
    "neuron_serve_lora_adapter_load_seconds", "Time to read, check and hand a LoRA adapter to the engines of a "
    "replica (its buffers are written when a request first runs on it)", ["model", "replica"],
    buckets=LATENCY_BUCKETS,
)
STEP_TIME = Histogram(
    "neuron_serve_generation_step_seconds", "Time of one compiled prefill or decode call, by bucket",
    [*GEN_LABELS, "bucket"], buckets=LATENCY_BUCKETS,
)
# An engine step's time in two parts: waiting for the core's outputs, and the rest (the host's own work: the plan,
# the calls' inputs, the host's choices, the requests' updates, the events), which the core does not overlap.
STEP_CORE_WAIT = Histogram(
    "neuron_serve_generation_step_core_wait_seconds",
    "Time of one engine step spent waiting for its compiled calls' outputs", GEN_LABELS, buckets=LATENCY_BUCKETS,
)
STEP_HOST = Histogram(
    "neuron_serve_generation_step_host_seconds",
    "Time of one engine step not spent waiting for the core: scheduling, inputs, host choices, request updates, "
    "events", GEN_LABELS, buckets=LATENCY_BUCKETS,
)
DECODES_AHEAD = Counter(
    "neuron_serve_generation_decodes_ahead", "Decode calls launched before the decode before them was read, fed its "
    "tokens on the core (async_scheduling)", GEN_LABELS,
)
DECODES_AHEAD_DROPPED = Counter(
    "neuron_serve_generation_decode_rows_ahead_dropped", "Rows of decodes launched ahead whose token was dropped: "
    "the row had ended with the token before, or the host chose that token otherwise than the core", GEN_LABELS,
)
REQUEST_QUEUE_TIME = Histogram(
    "neuron_serve_request_queue_time_seconds",
    "Time from a generate request's arrival at the engine to the start of its prompt's prefill",
    GEN_LABELS, buckets=LATENCY_BUCKETS,
)

# Pooling models (task: embed, score, classify): the infer metrics above count their requests, batches, chunks
# and cores (the same request queue and runner serve them); these add what only they have. Their inputs' tokens
# are counted in neuron_serve_prompt_tokens, as vLLM counts a pooling request's prompt tokens.
POOLING_REQUESTS = Counter(
    "neuron_serve_pooling_requests_total",
    "Embedding, rerank, score and classify requests by API (embeddings, rerank, score, classify) and outcome "
    "(HTTP status code)", ["model", "replica", "api", "code"],
)
POOLING_INPUTS = Counter(
    "neuron_serve_pooling_inputs_total", "Inputs pooled (texts, token-id lists or text pairs), by API",
    ["model", "replica", "api"],
)
PADDING_TOKENS = Counter(
    "neuron_serve_padding_tokens_total", "Free tokens of the compiled rows a pooling model's texts ran in (each text its "
    "share of its row's): wasted work",
    ["model", "replica"],
)


def scrape() -> bytes:
    """Every process's samples, merged: the body of GET /metrics."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=multiproc_dir())
    return generate_latest(registry)


def set_host_memory(model: str, replica: str, report: dict) -> None:
    """``neuron_serve_host_memory_bytes`` of ``model`` from an assembly/host_memory.report."""
    for kind, key in (("resident", "resident_bytes"), ("weights", "weights_bytes"),
                      ("weights_on_cores", "weights_on_cores_bytes"), ("kv_cache", "kv_cache_bytes"),
                      ("compiled_models", "compiled_models_total_bytes")):
        HOST_MEMORY.labels(model=model, replica=replica, kind=kind).set(report.get(key, 0))
