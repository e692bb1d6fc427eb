"""model.yaml's ``generation`` section and the rules of ``task: generate``.

Part of the model.yaml schema (neuron_serve.config): it imports nothing of generation,
the compiler or transformers, so the server reads a config without loading them. The
bucket lists are checked, and ``to_buckets`` derived, by the bucket arithmetic of
neuron_serve.buckets.generation.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from ..buckets.auto import AUTO_LEARN_AFTER
from ..buckets.generation import GenerationBuckets
from ..errors import ConfigError
from .names import NAME_PATTERN, NAME_RULE

DEFAULT_MAX_NUM_SEQS = 8
DEFAULT_MAX_WAITING = 256
MAX_DEFAULT_MODEL_LEN = 2048

# Top-level fields of an inference model that a generate model cannot honour (when given), and why.
_TOKENS = "a generate model takes prompt token ids and returns tokens"
_BUCKETS = "a generate model compiles its own buckets (see generation)"
_WEIGHTS = ("a generate model's executables always take its weights as inputs, shared by every compiled model "
            "(another checkpoint: weights, beside model.artifact)")
INFER_ONLY = {"inputs": _TOKENS, "outputs": _TOKENS, "buckets": _BUCKETS, "batch_sizes": _BUCKETS,
              "inline_weights_to_neff": _WEIGHTS,
              "partitioner": "a generate model is compiled with the default partitioner settings"}


class FieldError(ValueError):
    """A model-level check's error that belongs to ``field`` (a dotted path below the validated model).

    neuron_serve.config.schema reports it as ``<field>: <message>`` instead of under the model."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


MAX_SPECULATIVE_TOKENS = 8


class SpeculativeConfig(BaseModel):
    """vLLM's ``speculative_config``: proposals verified by the model, several tokens a call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model"] | None = Field(
        None, description="ngram: proposals copied from the sequence's own earlier tokens (prompt lookup), no draft "
                          "model; draft_model: proposals from a small causal LM (model), its k steps in one compiled "
                          "call; default: draft_model when model is given, else ngram")
    model: str | None = Field(
        None, description="draft_model: the draft causal LM's save_pretrained directory (relative to the model.yaml's "
                          "folder), with the model's tokenizer and vocabulary")
    num_speculative_tokens: int = Field(
        ..., ge=1, le=MAX_SPECULATIVE_TOKENS,
        description="k: tokens proposed per round; the model verifies them and adds one in one compiled call")
    prompt_lookup_max: int = Field(
        4, ge=1, description="ngram: the longest suffix of the sequence looked up among its earlier tokens")
    prompt_lookup_min: int = Field(
        1, ge=1, description="ngram: the shortest suffix looked up (no proposal below it)")

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model is not None else "ngram")
        if self.method == "draft_model" and self.model is None:
            raise FieldError("model", "method draft_model needs the draft's directory; give model: <directory>")
        if self.method == "ngram" and self.model is not None:
            raise FieldError("model", "applies to method draft_model; remove it or set method: draft_model")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise FieldError("prompt_lookup_min", f"{self.prompt_lookup_min} is more than prompt_lookup_max "
                                                  f"({self.prompt_lookup_max}); lower it to at most that")
        return self


# vLLM's allowed max_lora_rank values (its --max-lora-rank choices).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORA_RANK = 16


class LoraSettings(BaseModel):
    """vLLM's LoRA settings: adapters of the model served beside it, each requested as a model of its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_loras: int = Field(
        1, ge=1, description="adapters held on the core at once (buffers preallocated at max_lora_rank); a request "
                             "for another adapter waits for a buffer to be free")
    max_lora_rank: int = Field(
        DEFAULT_MAX_LORA_RANK, json_schema_extra={"enum": list(LORA_RANKS)},
        description=f"the largest adapter rank served (vLLM's values: {', '.join(map(str, LORA_RANKS))}); an "
                    f"adapter of a smaller rank is zero-padded to it")
    max_cpu_loras: int | None = Field(
        default=None, ge=1, description="adapters kept read on the host, the least recently used evicted; at least "
                                        "max_loras; default: max_loras")
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="adapters served from the start: name -> PEFT adapter directory (adapter_config.json and "
                    "adapter_model.safetensors, relative to the model.yaml's folder); a request names the adapter "
                    "as its model")
    allow_runtime_updates: bool = Field(
        False, description="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes), so adapters "
                           "are loaded and unloaded while serving")

    @model_validator(mode="after")
    def _check(self) -> "LoraSettings":
        if self.max_lora_rank not in LORA_RANKS:
            allowed = ", ".join(map(str, LORA_RANKS[:-1])) + f" or {LORA_RANKS[-1]}"
            raise FieldError("max_lora_rank", f"{self.max_lora_rank} is not a rank vLLM allows; use {allowed} "
                                              f"(an adapter of a smaller rank is zero-padded to it)")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise FieldError("max_cpu_loras", f"{self.max_cpu_loras} is fewer than max_loras ({self.max_loras}), and "
                                              f"every adapter on the core is also kept on the host; raise "
                                              f"max_cpu_loras to at least {self.max_loras} or lower max_loras")
        for name, path in self.lora_modules.items():
            if not re.match(NAME_PATTERN, name):
                raise FieldError(f"lora_modules.{name}", f"not a valid adapter name (a request names the adapter as "
                                                         f"its model: {NAME_RULE}); rename it")
            if not path.strip():
                raise FieldError(f"lora_modules.{name}", "give the adapter's directory (a PEFT adapter directory, "
                                                         "relative to the model.yaml's folder)")
        return self


class GenerationSettings(BaseModel):
    """task: generate: the KV cache's slots and length, the compiled buckets and the engine's queue.

    Bucket lists not given default as in neuron_serve.buckets.generation: prompt lengths and
    contexts double from 32 and 128 up to max_model_len (prompt lengths from 256 on with a
    bucket half way between each: 384, 768, ...), running-sequence counts are the powers
    of 4 below max_num_seqs and max_num_seqs itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int = Field(
        DEFAULT_MAX_NUM_SEQS, ge=1, description="sequences generated at once: the KV cache's slots on the core")
    max_model_len: int | None = Field(
        default=None, ge=2,
        description=f"most tokens of a sequence, prompt and output (positions of a cache slot); default: the "
                    f"model's max_position_embeddings, at most {MAX_DEFAULT_MODEL_LEN}")
    prefill_buckets: list[PositiveInt] | Literal["auto"] | None = Field(
        default=None,
        description="prompt lengths to compile prefill at; the largest is max_model_len. auto: as many as the "
                    "defaults, chosen from the prompt lengths the model's replicas recorded in the compile cache "
                    "once learn_buckets_after are (the defaults until then), and switched while serving when the "
                    "calls recorded since call for others")
    decode_batch_buckets: list[PositiveInt] | Literal["auto"] | None = Field(
        default=None,
        description="running-sequence counts to compile decode at; the largest is max_num_seqs. auto: as many as "
                    "the defaults, chosen from the decode calls' rows the replicas recorded, as prefill_buckets")
    prefill_batch_buckets: list[PositiveInt] | None = Field(
        default=None, min_length=1,
        description="prompts prefilled in one compiled call (each count compiled with every prefill bucket whose "
                    "count x length is at most max_model_len): prompts arriving together are prefilled together, "
                    "not one behind another; from 1 to at most max_num_seqs. Default: 1, then the powers of 4 up to "
                    "max_num_seqs and max_num_seqs itself. [1]: a prompt a call")
    learn_buckets_after: PositiveInt | None = Field(
        default=None,
        description=f"with prefill_buckets, decode_batch_buckets or decode_context_buckets auto: the calls of a family recorded before a "
                    f"replica starts on the buckets chosen from them, and between two looks while it serves; "
                    f"default: {AUTO_LEARN_AFTER}")
    decode_context_buckets: list[PositiveInt] | Literal["auto"] | None = Field(
        default=None,
        description="context lengths to compile decode at (each compiled for every decode batch bucket); a decode "
                    "attends over the smallest that holds its longest row; the largest is max_model_len. auto: as "
                    "many as the defaults, chosen from the contexts the decode calls' longest rows had, as "
                    "prefill_buckets")
    decode_steps: int = Field(
        1, ge=1, description="decode steps run in one compiled call, greedy or sampled on the core, while no "
                             "running sequence needs the host for its next token (penalties, a logit bias, a grammar "
                             "or logprobs): the host and the core meet once per that many tokens; tokens past a "
                             "sequence's stop, EOS or max_tokens are computed and dropped, and waiting prompts wait "
                             "for the call; compiles each decode bucket a second time (greedy and sampled). 1: one "
                             "token per call")
    on_device_sampling: bool = Field(
        True,
        description="choose sampled tokens on the core (temperature, top_k, top_p, min_p, from each row's seed), so "
                    "only token ids come home; compiles each decode bucket twice (by argmax for batches of greedy "
                    "rows, and with the sampler). false: each decode bucket is compiled once, by argmax, and a "
                    "sampled row's logits go to the host, which chooses its token from the same distribution "
                    "(the same tokens for a seed, more slowly); half the decode models to compile")
    tensor_parallel_size: int = Field(
        1, ge=1,
        description="cores one engine spans: the model's weights and KV cache are split over them (tensor "
                    "parallelism, by the model's transformers tp plan) and each prefill and decode bucket is "
                    "compiled once for the group; cores_per_replica must be a multiple of it, and the replica runs "
                    "cores_per_replica / tensor_parallel_size engines. 1: a whole model on each core")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1,
        description="the tokens of one engine step, which bounds how long running sequences wait for their next "
                    "token: prompt tokens prefilled per step (a longer prompt still runs, alone); with "
                    "enable_chunked_prefill, a token for each decode row then prompt chunks up to it. Default: "
                    "max_model_len (what the largest prefill call holds); with chunked prefill, a quarter of "
                    "max_model_len, at least 32, plus max_num_seqs")
    enable_chunked_prefill: bool = Field(
        False,
        description="vLLM's chunked prefill: a step decodes every running sequence and writes a chunk of a waiting "
                    "prompt in the same compiled call (a mixed model per decode-rows bucket and chunk length), so a "
                    "long prompt never holds the running streams for its whole prefill; decode rows first, then "
                    "prompt tokens up to max_num_batched_tokens (scheduler.py). Llama-style attention only "
                    "(Llama, Mistral, Qwen2, Qwen3)")
    prefill_chunk_buckets: list[PositiveInt] | None = Field(
        default=None, min_length=1,
        description="with enable_chunked_prefill: chunk lengths to compile the mixed models at (each with every "
                    "decode_batch_buckets size, over max_model_len positions); default: a quarter of max_model_len, "
                    "at least 32")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="with enable_chunked_prefill: the most tokens of one prompt a step takes (vLLM's); 0: "
                             "as many as the budget and the chunk buckets allow")
    max_num_partial_prefills: int = Field(
        1, ge=1, description="with enable_chunked_prefill: prompts part way through their prefill at once (vLLM's); "
                             "each step's chunk goes to the one with the fewest tokens left, so a short prompt is "
                             "not held behind a long one")
    async_scheduling: bool | None = Field(
        None,
        description="vLLM's async scheduling: while nothing but the running rows' decode is to be done, each engine "
                    "step launches the next decode from the last one's tokens on the core before it reads them, so "
                    "the host's part of a step (reading tokens, stops, events) runs while the core computes; a row "
                    "ends one call late (that call's token for it is dropped, never sent). Default: on with Neuron "
                    "devices, off on emulated cores (XLA:CPU computes on the CPUs the host's work needs: slower "
                    "served at one stream), and off with speculative decoding and decode_steps > 1, which do not "
                    "feed one call's tokens to the next (true with them is refused)")
    max_waiting: int = Field(
        DEFAULT_MAX_WAITING, ge=1, description="requests waiting for a slot before more are refused (503)")
    enable_prefix_caching: bool = Field(
        False,
        description="reuse the keys and values of earlier prompts (vLLM's automatic prefix caching): prompt tokens are "
                    "hashed in blocks of 16, a prompt whose leading blocks are held in a slot's cache prefills only "
                    "the rest, and finished sequences' slots keep their cache until a new sequence needs the slot "
                    "(least recently used first); compiles an extend model per (prefill bucket x decode context "
                    "bucket) with the prefill bucket at most the context")
    speculative_config: SpeculativeConfig | None = Field(
        default=None,
        description="speculative decoding (vLLM's keys): each round, num_speculative_tokens proposals per running "
                    "sequence are verified by the model in one compiled call (greedy acceptance keeps exactly the "
                    "greedy output; sampled rows use rejection sampling, so their distribution is the model's); "
                    "compiles a verify model per decode bucket")
    lora: LoraSettings | None = Field(
        default=None,
        description="LoRA adapters of the model (vLLM's settings; present, even empty as `lora:` or `lora: "
                    "{}`, it turns LoRA on): every compiled model takes each row's adapter, loading one writes "
                    "buffers on the core; a request names an adapter as its model. neuron-serve build refuses it (an "
                    "artifact does not carry adapters)")
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        default=None,
        description="how the model writes a tool call, for OpenAI's tool_choice \"auto\" (vLLM's --tool-call-parser "
                    "names): hermes, a JSON object {name, arguments} between <tool_call> and </tool_call> (Hermes, "
                    "Qwen 2.5 and later); llama3_json, an answer that is JSON objects {name, parameters} separated "
                    "by ; (Llama 3.1 and later). Without it, tools are still served with tool_choice \"required\", "
                    "a named function or \"none\"")
    quantization: Literal["int8", "fp8"] | None = Field(
        default=None,
        description="weight-only quantization of the linear layers (vLLM's name; NxD Inference's scheme): int8, or "
                    "fp8 (e4m3 within a NeuronCore's range of +-240), symmetric, quantized at start-up from the "
                    "checkpoint's weights, held on the core with their scales and dequantized to the compute dtype "
                    "inside the compiled graph. A checkpoint already quantized (its config's quantization_config, "
                    "as llm-compressor or ModelOpt write it) is loaded as it is without this field; given, it must "
                    "agree. Default: none")
    quantization_type: Literal["per_channel_symmetric", "per_tensor_symmetric"] = Field(
        "per_channel_symmetric",
        description="with quantization (NxD Inference's name): one scale per output channel, or one per weight")
    modules_to_not_convert: list[str] | None = Field(
        default=None,
        description="with quantization: linear layers kept in the compute dtype, by name, last part of the name "
                    "(lm_head, o_proj) or shell pattern (model.layers.0.*); default [lm_head] (embeddings are never "
                    "quantized)")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto",
        description="the KV cache's dtype (vLLM's name): auto, the model's dtype; fp8 (fp8_e4m3), e4m3 within a "
                    "NeuronCore's range with a scale per layer for keys and one for values, from the checkpoint "
                    "when it has them, else measured at start-up on a few prompts (calculate_kv_scales): about "
                    "twice the slots of a bfloat16 cache in the same memory")
    calculate_kv_scales: bool | None = Field(
        default=None,
        description="with kv_cache_dtype fp8: true measures the scales at start-up (the keys' and values' largest "
                    "magnitude per layer over a few prompts), even when the checkpoint has its own; false takes "
                    "the checkpoint's and refuses one without; default: the checkpoint's, else measured")
    request_timeout_s: float | None = Field(
        default=None, gt=0,
        description="a request not finished this many seconds after it arrived (waiting or generating) is aborted: "
                    "its slot is free at the next engine step and it is answered 504 (a stream ends with an "
                    "error); default: no limit")

    @field_validator("lora", mode="before")
    @classmethod
    def _present_turns_lora_on(cls, value: Any) -> Any:
        # YAML reads a bare `lora:` as null; the key being there is what asks for LoRA.
        return {} if value is None else value

    @model_validator(mode="after")
    def _check(self) -> "GenerationSettings":
        """The bucket lists' checks that need no model (the length lists need max_model_len), and the
        quantization fields that need their switch."""
        if self.quantization is None:
            for name in ("quantization_type", "modules_to_not_convert"):
                if name in self.model_fields_set:
                    raise FieldError(name, "applies with quantization (int8 or fp8); set quantization or remove "
                                           f"{name}")
        if self.async_scheduling and (self.speculative_config is not None or self.decode_steps > 1):
            by = "speculative_config" if self.speculative_config is not None else "decode_steps > 1"
            raise FieldError("async_scheduling", f"feeds each one-step decode's tokens to the next on the core, and "
                                                 f"{by} does not decode that way; set it false or leave it unset")
        if not self.enable_chunked_prefill:
            for name in ("long_prefill_token_threshold", "max_num_partial_prefills"):
                if name in self.model_fields_set:
                    raise FieldError(name, f"applies with enable_chunked_prefill: true; turn it on or remove {name}")
        else:
            if self.speculative_config is not None:
                raise FieldError("enable_chunked_prefill", "not with speculative_config (a step verifies proposals "
                                                           "or carries a prompt's chunk, not both yet); turn one off")
            if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= self.max_num_seqs:
                raise FieldError("max_num_batched_tokens",
                                 f"{self.max_num_batched_tokens} leaves no prompt token beside {self.max_num_seqs} "
                                 f"decode rows (max_num_seqs) with enable_chunked_prefill; give at least "
                                 f"{self.max_num_seqs + 1}")
        learnable = ("prefill_buckets", "decode_batch_buckets", "decode_context_buckets")
        for name in learnable:
            if getattr(self, name) == []:
                raise FieldError(name, "give at least one size, or auto")
        if self.learn_buckets_after is not None and "auto" not in [getattr(self, name) for name in learnable]:
            raise FieldError("learn_buckets_after", "applies with prefill_buckets, decode_batch_buckets or "
                                                    "decode_context_buckets auto; set one to auto or remove "
                                                    "learn_buckets_after")
        if self.kv_cache_dtype == "auto" and self.calculate_kv_scales is not None:
            raise FieldError("calculate_kv_scales", "applies with kv_cache_dtype fp8 (a cache in the model's own "
                                                    "dtype has no scales); set kv_cache_dtype: fp8 or remove it")
        try:
            self._build(self.max_model_len or 2, field_prefix="", lengths=self.max_model_len is not None)
        except ConfigError as exc:
            field, _, message = str(exc).partition(": ")
            raise FieldError(field, message) from None
        return self

    @classmethod
    def checked(cls, fields: dict) -> "GenerationSettings":
        """``fields`` validated, for callers that take them as arguments (``engine_for``): a ConfigError naming the
        first field at fault, as a model.yaml's names it without its ``generation.``."""
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            item = exc.errors()[0]
            cause = item.get("ctx", {}).get("error")
            if isinstance(cause, FieldError):
                raise ConfigError(f"{cause.field}: {cause.message}") from None
            raise ConfigError(f"{'.'.join(map(str, item['loc']))}: {item['msg']}") from None

    def model_len(self, model_config: Any) -> int:
        """max_model_len, or its default from a transformers config; never past the model's positions."""
        positions = getattr(model_config, "max_position_embeddings", None)
        if self.max_model_len is None:
            if positions is None:
                raise ConfigError("generation.max_model_len: the model's config has no max_position_embeddings; "
                                  "set max_model_len.")
            return min(int(positions), MAX_DEFAULT_MODEL_LEN)
        if positions is not None and self.max_model_len > positions:
            raise ConfigError(f"generation.max_model_len: {self.max_model_len} is more than the model's "
                              f"max_position_embeddings ({positions}); lower max_model_len to at most {positions}.")
        return self.max_model_len

    def to_buckets(self, model_config: Any = None, field_prefix: str = "generation.") -> GenerationBuckets:
        """The compiled shapes; max_model_len defaults from ``model_config`` (a transformers config).

        Errors are ConfigErrors naming ``<field_prefix><field>``."""
        return self._build(self.model_len(model_config), field_prefix=field_prefix)

    def _build(self, max_model_len: int, field_prefix: str = "generation.", lengths: bool = True) -> GenerationBuckets:
        return GenerationBuckets.build(self.max_num_seqs, max_model_len,
                                       prefill=_listed(self.prefill_buckets) if lengths else None,
                                       decode_rows=_listed(self.decode_batch_buckets),
                                       decode_context=_listed(self.decode_context_buckets) if lengths else None,
                                       decode_steps=self.decode_steps, prefix_caching=self.enable_prefix_caching,
                                       speculative_tokens=self.speculative_config.num_speculative_tokens
                                       if self.speculative_config is not None else 0,
                                       sampled=self.on_device_sampling, chunks=self.prefill_chunk_buckets,
                                       chunked=self.enable_chunked_prefill,
                                       prefill_rows=self.prefill_batch_buckets, field_prefix=field_prefix)


def _listed(buckets: list[int] | str | None) -> list[int] | None:
    """A bucket list as given, None for the defaults (auto starts from them: generation/build.learned)."""
    return None if buckets == "auto" else buckets


def check_task(config: Any) -> None:
    """ModelConfig's rules of ``task``; raises FieldError naming the field and the fix."""
    source = config.model
    if config.task == "infer":
        if config.generation is not None:
            raise FieldError("generation", "applies to task: generate; set task: generate or remove generation")
        if config.tokenizer is not None:
            raise FieldError("tokenizer", "applies to task: generate, embed, score or classify; set one of them or "
                                          "remove tokenizer")
        if source.pretrained is not None:
            raise FieldError("model.pretrained", "a transformers model directory is served with task: generate (a "
                                                 "causal LM) or embed, score, classify (a pooling model); set one "
                                                 "of them, or use model.factory or model.artifact")
        if config.inputs is None:
            raise FieldError("inputs", "Field required for task: infer (add the model's inputs, each with name, "
                                       "shape and dtype)")
        return
    for name, reason in INFER_ONLY.items():
        if name in config.model_fields_set:
            raise FieldError(name, f"applies to task: infer; {reason}; remove {name}")
    if config.weights is not None and source.artifact is None:
        raise FieldError("weights", "a generate model swaps in another checkpoint of its architecture from an artifact "
                                    "(model.artifact, written by neuron-serve build), without compiling; to compile "
                                    "from a checkpoint, name its directory as model.pretrained and remove weights")
    tp = config.generation.tensor_parallel_size if config.generation is not None else 1
    if config.cores_per_replica % tp:
        raise FieldError("generation.tensor_parallel_size",
                         f"{tp} cores per engine do not divide the replica's {config.cores_per_replica} "
                         f"(cores_per_replica); set cores_per_replica to a multiple of {tp} (each group of {tp} "
                         f"cores runs one engine)")
    lora = config.generation.lora if config.generation is not None else None
    if lora is not None and config.name in lora.lora_modules:
        raise FieldError(f"generation.lora.lora_modules.{config.name}",
                         "is the model's own name (the base model answers to it); give the adapter another name")
    if config.placement.mode == "pipeline":
        raise FieldError("placement.mode", "pipeline applies to task: infer; a generate model runs on one core; "
                                           "remove placement or use mode: replicate")


def refuse_lora(settings: "GenerationSettings | None", where: str) -> None:
    """generation.lora where adapters cannot be chosen yet (``where``): refused, not ignored."""
    if settings is not None and settings.lora is not None:
        raise ConfigError(f"generation.lora: {where} does not serve LoRA adapters yet; `neuron-serve deploy` "
                          f"serves them from the model.yaml (a request names the adapter as its model), and so "
                          f"does build_engine in process. "
                          f"Remove generation.lora to serve the base model, or merge an adapter into the weights "
                          f"(peft's merge_and_unload) and serve the merged model.")
