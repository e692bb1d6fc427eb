"""model.yaml: what to serve and how to compile it, validated by pydantic.

Every validation error is re-raised as a ConfigError that names the field (as a
dotted path, e.g. ``inputs.0.dtype``) and says how to fix it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from .compiler_args import parse_compiler_args
from ..errors import ConfigError
from ..buckets.auto import AUTO_LEARN_AFTER
from .generation import FieldError, GenerationSettings, check_task
from .messages import format_errors
from .names import NAME_PATTERN
from .pooling import POOLING_TASKS, PoolingSettings, check_pooling_task
from ..buckets.batch_sizes import check_batch_sizes, default_batch_sizes
from ..partition.config import DEFAULT_SUPPORT_THRESHOLD, NO_LIMIT, PartitionerConfig
from ..partition.placement import ModelPlacement

if TYPE_CHECKING:
    import torch

# model.yaml's input dtypes, by torch's names (torch is imported where a tensor is made: the serving edge reads
# model.yaml without it).
DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool")


def torch_dtype(name: str) -> "torch.dtype":
    import torch  # noqa: PLC0415

    return getattr(torch, name)


DEFAULT_TARGET = "neuron"
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_MAX_QUEUE_DELAY_MS = 2.0
DEFAULT_MAX_QUEUE_SIZE = 256
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_TARGET_ONGOING_REQUESTS = 16.0
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_GRPC_PORT = 8001  # Triton's
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
AUTH_TOKEN_ENV = "NEURON_SERVE_AUTH_TOKEN"
MIN_TOKEN_LENGTH = 16
FACTORY_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSource(_Strict):
    factory: str | None = Field(
        default=None, pattern=FACTORY_PATTERN, description="import path 'package.module:function' returning an nn.Module"
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the factory")
    artifact: str | None = Field(
        default=None, description="a directory written by 'neuron-serve build' (relative to the model.yaml's folder)"
    )
    pretrained: str | None = Field(
        default=None, min_length=1, description="task: generate: a transformers causal LM directory; task: embed, "
                                                "score, classify: a sentence-transformers or transformers model "
                                                "directory (save_pretrained or save; relative to the model.yaml's "
                                                "folder), loaded with local files only")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSource":
        if sum(s is not None for s in (self.factory, self.artifact, self.pretrained)) != 1:
            raise ValueError(
                "give exactly one of 'factory' (an import path 'package.module:function'), 'artifact' "
                "(a directory written by 'neuron-serve build') or 'pretrained' (a transformers or sentence-transformers "
                "model directory)"
            )
        if self.factory is None and self.kwargs:
            raise ValueError("'kwargs' apply to a factory; an artifact or a pretrained directory is loaded as it is, "
                             "remove 'kwargs'")
        return self


class InputSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z_][\w.-]*$")
    shape: list[int] = Field(min_length=0, description="trace-time shape; dim 0 is the batch")
    dtype: Literal[tuple(DTYPES)] = "float32"  # type: ignore[valid-type]
    high: int | None = Field(default=None, ge=1, description="integer inputs: example values are drawn from [0, high)")

    @field_validator("shape")
    @classmethod
    def _positive(cls, shape: list[int]) -> list[int]:
        if any(d < 1 for d in shape):
            raise ValueError(f"every dimension must be >= 1, got {shape}")
        return shape

    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    def example(self) -> torch.Tensor:
        import torch  # noqa: PLC0415

        dtype = torch_dtype(self.dtype)
        if dtype.is_floating_point:
            return torch.rand(self.shape, dtype=dtype)
        return torch.randint(0, self.high or 2, self.shape, dtype=dtype)


def _check_compiler_args(value: str | list[str] | None) -> str | list[str] | None:
    try:
        parse_compiler_args(value, "neuronx-cc arguments")
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return value


def _under(base_dir: str | Path | None, path: str | None) -> str | None:
    """A path of model.yaml, relative to its folder (replicas may run elsewhere)."""
    if path is None or base_dir is None:
        return path
    resolved = Path(path).expanduser()
    return str(resolved if resolved.is_absolute() else Path(base_dir) / resolved)


class TraceKwargsSettings(_Strict):
    """PartitionerConfig.trace_kwargs: what every accelerator subgraph is traced with."""

    compiler_workdir: str | None = Field(
        default=None, min_length=1, description="folder for each compiled subgraph's HLO (relative to the model.yaml)")
    compiler_args: str | list[str] | None = Field(
        default=None, description="neuronx-cc arguments for every accelerator subgraph (as the top-level compiler_args)")

    @field_validator("compiler_args")
    @classmethod
    def _known_flags(cls, value: str | list[str] | None) -> str | list[str] | None:
        return _check_compiler_args(value)


class AnalyzeParametersSettings(_Strict):
    """PartitionerConfig.analyze_parameters: the analysis deciding what the accelerator runs."""

    compiler_workdir: str | None = Field(
        default=None, min_length=1, description="folder to write the analyze report to (relative to the model.yaml)")
    additional_ignored_ops: list[str] = Field(
        default_factory=list, description="operators left out of the support percentage, e.g. aten::relu")
    max_workers: int = Field(1, ge=1, description="threads running the operator support checks")


class PartitionerSettings(_Strict):
    """PartitionerConfig as YAML; same names and defaults."""

    model_support_percentage_threshold: float = Field(DEFAULT_SUPPORT_THRESHOLD, ge=0, le=1)
    min_subgraph_size: int = NO_LIMIT
    max_subgraph_count: int = NO_LIMIT
    ops_to_partition: list[str] = Field(default_factory=list)
    trace_kwargs: TraceKwargsSettings | None = None
    analyze_parameters: AnalyzeParametersSettings | None = None

    def to_config(self, base_dir: str | Path | None = None) -> PartitionerConfig:
        trace_kwargs = self.trace_kwargs.model_dump(exclude_none=True) if self.trace_kwargs else None
        analyze = self.analyze_parameters.model_dump(exclude_none=True) if self.analyze_parameters else None
        for given in (trace_kwargs, analyze):
            if given and "compiler_workdir" in given:
                given["compiler_workdir"] = _under(base_dir, given["compiler_workdir"])
        if analyze:
            analyze["additional_ignored_ops"] = set(analyze["additional_ignored_ops"])
        return PartitionerConfig(
            model_support_percentage_threshold=self.model_support_percentage_threshold,
            min_subgraph_size=self.min_subgraph_size,
            max_subgraph_count=self.max_subgraph_count,
            ops_to_partition=set(self.ops_to_partition),
            trace_kwargs=trace_kwargs,
            analyze_parameters=analyze,
        )


class PlacementSettings(_Strict):
    """Where the accelerator work runs (see neuron_serve.ModelPlacement): a full copy per core, or a
    pipeline of stages, one per core, split by memory or balanced latency."""

    mode: Literal["replicate", "pipeline"] = Field(
        "replicate", description="replicate: every core runs the whole model; pipeline: stages over cores"
    )
    cores_per_pipeline: int | None = Field(
        default=None, ge=1, description="pipeline: cores one copy of the pipeline spans (default cores_per_replica)"
    )
    balance: Literal["size_based", "cost_aware", "kl_based", "latency"] | None = Field(
        default=None, description="pipeline: split by memory (size_based, default), by torch's latency cost model "
                                  "(cost_aware, kl_based: one input's end-to-end latency), or into stages of even "
                                  "measured latency (latency)",
    )
    saturate_host: bool | None = Field(
        default=None, description="pipeline: copy the pipeline onto every further group of the replica's cores "
                                  "(default true)",
    )

    def to_placement(self, cores_per_replica: int) -> ModelPlacement:
        cores = self.cores_per_pipeline
        if self.mode == "pipeline" and cores is None:
            cores = cores_per_replica
        return ModelPlacement(self.mode, cores, self.balance, self.saturate_host)


class BucketSettings(_Strict):
    """Declarative shape buckets (see neuron_serve.BucketSpec)."""

    sizes: list[int | list[int]] = Field(min_length=1, description="buckets, smallest first; one size per bucketed dim")
    inputs: dict[str, int | list[int]] = Field(min_length=1, description="input name -> bucketed dim(s)")
    pad_values: dict[str, float] = Field(default_factory=dict, description="input name -> pad value (default 0)")
    outputs: dict[str, int | list[int]] = Field(
        default_factory=dict, description="output name -> dim(s) cut back to the request's size"
    )


class BatchingSettings(_Strict):
    """The replica's dynamic request batcher."""

    max_batch_size: int = Field(DEFAULT_MAX_BATCH_SIZE, ge=1, description="most rows in one batch")
    max_queue_delay_ms: float = Field(DEFAULT_MAX_QUEUE_DELAY_MS, ge=0, description="longest wait to fill a batch")
    max_queue_size: int = Field(DEFAULT_MAX_QUEUE_SIZE, ge=1, description="waiting requests before 503")
    request_timeout_s: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0, description="a request waiting longer gets 504")
    max_batch_tokens: int | None = Field(
        None, ge=1,
        description="task: embed, score and classify: most tokens of the texts one batch takes (text-embeddings-"
                    "inference's max-batch-tokens): requests join a batch while their tokens fit, then its texts "
                    "are packed into rows; a request of more runs alone. Default: max_batch_size times the longest "
                    "length bucket")


class AutoscalingSettings(_Strict):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(ge=1)
    target_ongoing_requests: float = Field(DEFAULT_TARGET_ONGOING_REQUESTS, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingSettings":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        return self


class AuthSettings(_Strict):
    """Bearer-token authentication: every route but /v2/health/* needs the token.

    The token itself never goes in model.yaml; it is read from an environment variable
    or a file (a mounted Kubernetes Secret) when the server starts.
    """

    token_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description=f"environment variable holding the token (default {AUTH_TOKEN_ENV})",
    )
    token_file: str | None = Field(default=None, min_length=1, description="file holding the token (e.g. a mounted Secret)")

    @model_validator(mode="after")
    def _one_source(self) -> "AuthSettings":
        if self.token_env is not None and self.token_file is not None:
            raise ValueError("give token_env or token_file, not both")
        return self


class HttpSettings(_Strict):
    host: str = DEFAULT_HOST
    port: int = Field(DEFAULT_PORT, ge=1, le=65535)
    max_request_bytes: int = Field(DEFAULT_MAX_REQUEST_BYTES, ge=1024, description="larger bodies get 413")
    auth: AuthSettings | None = Field(
        default=None, description=f"bearer-token authentication (off unless set here or ${AUTH_TOKEN_ENV} is set)"
    )


class GrpcSettings(_Strict):
    enabled: bool = Field(True, description="serve OIP v2 over gRPC (inference.GRPCInferenceService) beside HTTP")
    port: int = Field(DEFAULT_GRPC_PORT, ge=1, le=65535, description="gRPC port, on http.host")


class ModelConfig(_Strict):
    """One deployment: the model, its inputs and how to compile it."""

    name: str = Field(pattern=NAME_PATTERN, description="model name in URLs: lowercase letters, digits, '-', '_', '.'")
    task: Literal["infer", "generate", "embed", "score", "classify"] = Field(
        "infer", description="infer: tensors in, tensors out; generate: a causal LM generating tokens (see "
                             "generation); embed: text in, embeddings out (/v1/embeddings); score: a cross-encoder "
                             "scoring text pairs (/v1/rerank, /v1/score); classify: a sequence classifier "
                             "(/classify); the last three see pooling")
    model: ModelSource
    inputs: list[InputSpec] | None = Field(default=None, min_length=1, description="task: infer (required)")
    tokenizer: str | None = Field(default=None, min_length=1, description="task: generate, embed, score, classify: "
                                  "a directory of transformers tokenizer files (relative to the model.yaml; default "
                                  "model.pretrained)")
    generation: GenerationSettings | None = Field(default=None, description="task: generate (defaults when absent)")
    pooling: PoolingSettings | None = Field(default=None, description="task: embed, score, classify (defaults, "
                                            "read from the model's directory, when absent)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="task: generate, embed, score, classify: the dtype of the weights, the activations and the KV "
                    "cache (vLLM's name): auto, the checkpoint's own (its config's dtype, or a factory model's "
                    "as built); logits, the sampler and pooled outputs stay in float32. task: infer takes the "
                    "model's own dtype (compiler_args --auto-cast casts its products)")
    target: Literal["neuron", "xla"] = DEFAULT_TARGET
    partitioner: PartitionerSettings | None = None
    compiler_args: str | list[str] | None = Field(
        default=None, description="neuronx-cc arguments, e.g. '--auto-cast matmult --auto-cast-type bf16' "
                                  "(--auto-cast is reproduced in emulation; other options have no effect there)",
    )
    inline_weights_to_neff: bool | None = Field(
        default=None,
        description="false: weights stay out of the compiled executables (trace(inline_weights_to_neff=False)), "
                    "so 'weights' can swap in another checkpoint without compiling. Default: true for a factory, "
                    "as the artifact was built for an artifact",
    )
    weights: str | None = Field(
        default=None, min_length=1,
        description="a checkpoint of the same architecture (relative to the model.yaml) served instead of the "
                    "model's own weights, without compiling. task: infer: torch.save(model.state_dict(), path), "
                    "into a model traced with inline_weights_to_neff: false; task: generate: a save_pretrained "
                    "directory (a fine-tune), into the model.artifact built from another checkpoint",
    )
    outputs: list[str] | None = Field(default=None, description="names of the flattened outputs (default: from the model)")
    buckets: BucketSettings | None = None
    dynamic_batch: bool = Field(True, description="accept any batch size, run as the cheapest compiled batch sizes")
    batch_sizes: list[int] | Literal["auto"] | None = Field(
        default=None,
        description="batch sizes to compile each bucket at (default: powers of 4 up to batching.max_batch_size, "
                    "plus it); needs dynamic_batch. auto (task: infer): as many as the defaults, the largest kept, "
                    "those that pad the chunks the model's replicas recorded least, once learn_buckets_after are; a "
                    "serving replica looks again every learn_buckets_after chunks and switches to better ones",
    )
    learn_buckets_after: PositiveInt | None = Field(
        default=None,
        description=f"batch_sizes: auto: the recorded chunks a replica needs before it starts on the batch sizes "
                    f"chosen from them, and between two looks while it serves; default: {AUTO_LEARN_AFTER}",
    )
    cores_per_replica: int = Field(1, ge=1)
    background_compile: bool = Field(
        True,
        description="true: a replica is ready as soon as it holds compiled models that answer every request (the "
                    "largest shape bucket at the largest batch size: smaller requests are padded into it), and "
                    "compiles the rest in the background, most padding saved first, each serving as soon as it is "
                    "compiled; false: ready only once everything is compiled, for the same latency from the first "
                    "request. Models of task generate, embed, score and classify, and artifacts, compile everything "
                    "before they are ready either way, for now",
    )
    placement: PlacementSettings = Field(default_factory=PlacementSettings)
    replicas: int = Field(1, ge=1)
    autoscaling: AutoscalingSettings | None = None
    batching: BatchingSettings = Field(default_factory=BatchingSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    grpc: GrpcSettings = Field(default_factory=GrpcSettings)

    @model_validator(mode="after")
    def _unique_inputs(self) -> "ModelConfig":
        check_pooling_task(self)
        if self.task not in POOLING_TASKS:
            check_task(self)
        if self.task == "infer" and self.dtype != "auto":
            raise FieldError("dtype", "applies to task: generate, embed, score or classify; a task: infer model is "
                                      "compiled in its own dtype (cast it in its factory, or compile its products in "
                                      "bfloat16 with compiler_args: --auto-cast matmult --auto-cast-type bf16); "
                                      "remove dtype")
        names = [i.name for i in self.inputs or []]
        if len(set(names)) != len(names):
            raise ValueError(f"input names must be unique, got {names}")
        if self.buckets is not None:
            unknown = sorted((set(self.buckets.inputs) | set(self.buckets.pad_values)) - set(names))
            if unknown:
                raise ValueError(f"buckets name unknown inputs {unknown}; inputs are {names}")
        if self.partitioner is not None:
            self.partitioner.to_config()  # PartitionerConfig's own checks, with its messages
            if self.compiler_args is not None and (self.partitioner.trace_kwargs or TraceKwargsSettings()).compiler_args:
                raise ValueError("compiler_args is given both at the top level and in partitioner.trace_kwargs; "
                                 "give it once")
        if self.weights is not None and self.model.factory is not None and self.inline_weights_to_neff is not False:
            raise ValueError("weights: a checkpoint can only be swapped into a weight-separated model; set "
                             "inline_weights_to_neff: false (or serve an artifact built with it)")
        self._check_placement()
        if self.batch_sizes is not None:
            if not self.dynamic_batch:
                raise ValueError("batch_sizes needs dynamic_batch: true (without it a request must have the "
                                 "trace-time batch); remove batch_sizes or enable dynamic_batch")
            if self.batch_sizes != "auto":
                check_batch_sizes(self.batch_sizes, limit=self.batching.max_batch_size)
        self._check_learning()
        return self

    def _check_learning(self) -> None:
        if self.batch_sizes == "auto" and self.task != "infer":
            learns = ("generation.prefill_buckets: auto or decode_batch_buckets: auto" if self.task == "generate"
                      else "pooling.length_buckets: auto")
            raise FieldError("batch_sizes", f"auto applies to task: infer (it learns from the rows of its chunks); a "
                                            f"task: {self.task} model learns its buckets with {learns}; give a list")
        if self.learn_buckets_after is not None and self.batch_sizes != "auto":
            where = {"generate": "generation.", "infer": ""}.get(self.task, "pooling.")
            raise FieldError("learn_buckets_after", f"applies to batch_sizes: auto; set batch_sizes: auto or remove "
                                                    f"learn_buckets_after" + (f" (or give {where}learn_buckets_after)"
                                                                              if where else ""))

    def _check_placement(self) -> None:
        try:
            placed = self.placement.to_placement(self.cores_per_replica)  # ModelPlacement's own checks
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if placed.pipelined and placed.cores_per_pipeline > self.cores_per_replica:
            raise ValueError(f"placement.cores_per_pipeline is {placed.cores_per_pipeline} but the replica has "
                             f"{self.cores_per_replica} core(s); set cores_per_replica to at least "
                             f"{placed.cores_per_pipeline} or lower placement.cores_per_pipeline")

    def torch_dtype(self, checkpoint: torch.dtype) -> torch.dtype:
        """The dtype a generate or pooling model computes in: ``dtype``, or with auto ``checkpoint`` (the dtype its
        checkpoint was saved in)."""
        return checkpoint if self.dtype == "auto" else torch_dtype(self.dtype)

    def model_placement(self) -> ModelPlacement:
        """The placement ``trace`` takes."""
        return self.placement.to_placement(self.cores_per_replica)

    @field_validator("compiler_args")
    @classmethod
    def _known_flags(cls, value: str | list[str] | None) -> str | list[str] | None:
        return _check_compiler_args(value)

    @field_validator("batch_sizes")
    @classmethod
    def _sorted_sizes(cls, sizes: list[int] | str | None) -> list[int] | str | None:
        return sizes if sizes is None or sizes == "auto" else check_batch_sizes(sizes)

    def compiled_batch_sizes(self) -> list[int] | None:
        """The batch sizes to compile: as given, else derived from batching.max_batch_size (None: the trace batch).
        With auto, the defaults: a build starts from :func:`buckets.usage.learned_batch_sizes`' copy instead."""
        if not self.dynamic_batch:
            return None
        if self.batch_sizes is None or self.batch_sizes == "auto":
            return default_batch_sizes(self.batching.max_batch_size)
        return self.batch_sizes

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(spec.example() for spec in self.inputs or [])

    def partitioner_config(self, base_dir: str | Path | None = None) -> PartitionerConfig | None:
        """The partitioner section as a PartitionerConfig; its folders relative to ``base_dir``."""
        return self.partitioner.to_config(base_dir) if self.partitioner else None

    def weights_path(self, base_dir: str | Path | None = None) -> str | None:
        """The ``weights`` checkpoint's path, relative to ``base_dir`` (the model.yaml's folder)."""
        return _under(base_dir, self.weights)


def parse_config(data: Any, source: str = "model.yaml") -> ModelConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping with 'name', 'model' and 'inputs'.")
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, source)) from None


def load_config(path: str | Path) -> ModelConfig:
    """Read and validate a model.yaml."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; pass the path of a model.yaml.") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, str(path))


def load_deployment(path: str | Path) -> tuple[ModelConfig, str]:
    """A model.yaml, or an artifact directory (served by the model.yaml inside it).

    Returns the config and the folder its relative paths resolve against.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / "model.yaml").is_file():
            raise ConfigError(f"{path}: a directory to deploy must be an artifact written by 'neuron-serve build' "
                              "(it holds a model.yaml); pass a model.yaml or such a directory.")
        path = path / "model.yaml"
    return load_config(path), str(path.resolve().parent)


def json_schema() -> dict:
    """The JSON Schema of model.yaml, for editors (shipped as model.schema.json)."""
    schema = ModelConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "neuron-serve model.yaml"
    return schema
