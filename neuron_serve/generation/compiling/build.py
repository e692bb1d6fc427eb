"""A model.yaml of ``task: generate`` to a running :class:`~neuron_serve.generation.core.engine.Engine`.

The model is a factory's transformers causal LM or a ``save_pretrained`` directory
(``model.pretrained``, read with local files only); the tokenizer comes from
``tokenizer`` or the pretrained directory. The KV cache is checked against one core's
memory before anything is compiled.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch

from ...buckets.generation import LEARNED, GenerationBuckets
from ...config.schema import ModelConfig, _under
from ...config.generation import GenerationSettings
from ...errors import ArtifactError, ConfigError
from ...partition.pipeline import core_memory_bytes
from ..runner import attention, tensor_parallel
from .. import eos_token_ids
from ..frontend.processor import Frontend
from ..core.group import EngineGroup
from ...assembly.queue import READY, compile_queue
from .compile import GenerationBuild, compile_generation
from .loading import DRAFT_FIELD, load_draft, load_lm, load_tokenizer
from ..runner.model import GenerationModel
from ..runner.slots import cache_element_bytes, kv_cache_bytes

logger = logging.getLogger("neuron_serve")

def weight_bytes(lm: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each shared tensor once)."""
    return sum(t.numel() * t.element_size() for t in [*lm.parameters(), *lm.buffers()])


def check_fits(config, buckets: GenerationBuckets, weight_bytes: int, dtype_bytes: int, core_bytes: int,
               field_prefix: str = "generation.", cache_share: int = 1,
               needs: Callable[[], int | None] | None = None) -> int:
    """Refuse a cache that does not fit next to the weights on one core; returns one core's cache bytes.

    ``weight_bytes`` is what one core holds of the weights and ``cache_share`` how many
    cores split the cache (tensor parallelism); ``needs()`` is the smallest
    tensor_parallel_size at which the model would fit, named in the refusal."""
    cache = kv_cache_bytes(config, buckets.max_num_seqs, buckets.max_model_len, dtype_bytes) // cache_share
    if weight_bytes + cache <= core_bytes:
        return cache
    per_slot = kv_cache_bytes(config, 1, buckets.max_model_len, dtype_bytes) // cache_share
    fit = max(0, (core_bytes - weight_bytes) // per_slot)
    more = needs() if needs is not None else None
    split = (f", or split the model over {more} cores with {field_prefix}tensor_parallel_size: {more}"
             if more else "")
    raise ConfigError(
        f"{field_prefix}max_num_seqs: {buckets.max_num_seqs} slots of {buckets.max_model_len} positions need "
        f"{cache} bytes of KV cache ({per_slot} per slot) next to {weight_bytes} bytes of weights, more than the "
        f"core's {core_bytes} bytes; at most {fit} slot(s) fit. Lower max_num_seqs or max_model_len{split}."
    )


def slots_that_fit(lm: torch.nn.Module, buckets: GenerationBuckets, core_bytes: int | None = None,
                   tensor_parallel_size: int = 1) -> int:
    """How many slots of ``buckets.max_model_len`` positions fit one core beside ``lm``'s weights (its share of
    them at ``tensor_parallel_size``), in the cache's dtype (an fp8 cache holds twice a bfloat16 one's)."""
    core = core_bytes if core_bytes is not None else core_memory_bytes()
    plan = tensor_parallel.plan(lm, tensor_parallel_size) if tensor_parallel_size > 1 else None
    share = 1 if tensor_parallel.kv_replicated(lm.config, tensor_parallel_size) else tensor_parallel_size
    per_slot = kv_cache_bytes(lm.config, 1, buckets.max_model_len, cache_element_bytes(lm)) // share
    return max(0, (core - tensor_parallel.bytes_per_core(lm, plan)) // per_slot)


def check_cache_fits(lm: torch.nn.Module, buckets: GenerationBuckets, field_prefix: str = "generation.",
                     tensor_parallel_size: int = 1) -> int:
    """Refuse ``buckets``' KV cache when it does not fit next to ``lm``'s weights on one core (see check_fits).

    At ``tensor_parallel_size`` N each core holds its share of the weights and of the cache.
    A refusal names the smallest N (dividing the heads, up to 64) at which the model fits."""
    dtype_bytes = cache_element_bytes(lm)  # the cache's dtype (see SlotLM)
    core = core_memory_bytes()

    def share(size: int) -> tuple[int, int]:
        per_core = tensor_parallel.bytes_per_core(lm, tensor_parallel.plan(lm, size) if size > 1 else None)
        return per_core, 1 if tensor_parallel.kv_replicated(lm.config, size) else size

    def needs() -> int | None:
        for size in (2, 4, 8, 16, 32, 64):
            if size <= tensor_parallel_size:
                continue
            try:
                tensor_parallel.check(lm.config, size)
                weights, cache_share = share(size)
                check_fits(lm.config, buckets, weights, dtype_bytes, core, field_prefix, cache_share)
            except ConfigError:
                continue
            return size
        return None

    weights, cache_share = share(tensor_parallel_size)
    return check_fits(lm.config, buckets, weights, dtype_bytes, core, field_prefix, cache_share, needs)




def learned(settings: GenerationSettings, name: str | None, buckets: GenerationBuckets,
            field_prefix: str = "generation.") -> GenerationSettings:
    """``settings`` with each ``auto`` bucket list chosen from the calls the model's replicas recorded in the compile
    cache (buckets/usage.py), once ``learn_buckets_after`` of a family are: as many buckets as its defaults
    (``buckets``), the largest kept, those that pad the recorded calls least; the defaults until then."""
    auto = [entry for entry in LEARNED if getattr(settings, entry[1]) == "auto"]
    if not auto:
        return settings
    from ...buckets import usage as bucket_usage  # noqa: PLC0415
    from ...buckets.auto import AUTO_LEARN_AFTER  # noqa: PLC0415

    wanted = settings.learn_buckets_after or AUTO_LEARN_AFTER
    update = {}
    for family, field, attribute in auto:
        defaults = sorted(getattr(buckets, attribute))
        chosen = bucket_usage.learn(name, family, f"{field_prefix}{field}", defaults, wanted, "calls")[0] \
            if name else defaults
        update[field] = chosen
    return settings.model_copy(update=update)


def checked_buckets(lm: torch.nn.Module, settings: GenerationSettings,
                    field_prefix: str = "generation.", name: str | None = None) -> GenerationBuckets:
    """``settings``' compiled shapes for ``lm``, once every check that needs the model passed (the split over
    tensor_parallel_size cores, chunked prefill's attention, the cache beside the weights on a core): before
    anything compiles, each refusal naming its field. ``auto`` bucket lists are learned for model ``name``."""
    buckets = settings.to_buckets(lm.config, field_prefix)
    settings = learned(settings, name, buckets, field_prefix)
    buckets = settings.to_buckets(lm.config, field_prefix)
    tp = settings.tensor_parallel_size
    tensor_parallel.check(lm.config, tp, field=f"{field_prefix}tensor_parallel_size")
    if settings.enable_chunked_prefill and not attention.applies(lm):
        raise ConfigError(f"{field_prefix}enable_chunked_prefill: a mixed call splits attention between decode rows "
                          f"and a prompt's chunk, which needs Llama-style attention (Llama, Mistral, Qwen2, Qwen3); "
                          f"{getattr(lm.config, 'model_type', type(lm).__name__)}'s is not; turn it off.")
    check_cache_fits(lm, buckets, field_prefix=field_prefix, tensor_parallel_size=tp)
    return buckets


def engine_options(settings: GenerationSettings) -> dict[str, Any]:
    """What each engine takes of ``settings`` (Engine's keyword arguments)."""
    return {"max_num_batched_tokens": settings.max_num_batched_tokens, "request_timeout_s": settings.request_timeout_s,
            "speculative_config": settings.speculative_config,
            "long_prefill_token_threshold": settings.long_prefill_token_threshold,
            "max_num_partial_prefills": settings.max_num_partial_prefills,
            "async_scheduling": settings.async_scheduling}


def compile_from_config(config: ModelConfig, base_dir: str | Path | None = None, *,
                        background: bool = False) -> tuple[GenerationModel, list[int], Any]:
    """Load, check and compile a factory or pretrained ``task: generate`` model: (model, EOS ids, tokenizer).

    With ``background`` the model returns once the models that answer every request are compiled; the rest
    compile on the process's compile queue and join it (compile.py). A draft compiles whole, first."""
    settings = config.generation or GenerationSettings()
    tokenizer = load_tokenizer(config, base_dir)
    lm = load_lm(config, base_dir, tokenizer)
    buckets = checked_buckets(lm, settings, name=config.name)
    tp = settings.tensor_parallel_size
    policy = None
    if settings.lora is not None:
        from ..lora.adapters import AdapterPolicy  # noqa: PLC0415

        policy = AdapterPolicy.of(lm, settings.lora, tp)
    draft = None
    spec = settings.speculative_config
    if spec is not None and spec.method == "draft_model":
        draft = load_draft(config, base_dir, tokenizer)
        check_draft(lm, draft, settings.enable_prefix_caching)
        tensor_parallel.check(draft.config, tp, field=DRAFT_FIELD)
    build = GenerationBuild(lm, buckets, target=config.target, compiler_args=config.compiler_args,
                            tensor_parallel_size=tp, name=config.name,
                            lora=policy.layout if policy is not None else None)
    model = build.start(background=background)
    model.adapter_policy = policy
    if draft is not None:
        model.draft = compile_generation(draft, buckets.for_draft(), target=config.target,
                                         compiler_args=config.compiler_args, tensor_parallel_size=tp,
                                         name=f"{config.name} draft")
    return model, eos_token_ids(lm), tokenizer


def check_draft(lm: torch.nn.Module, draft: torch.nn.Module, prefix_caching: bool = False,
                field: str = DRAFT_FIELD) -> None:
    """Refuse a draft that cannot propose for ``lm``: another vocabulary, or beside prefix caching."""
    ours, theirs = (int(m.get_output_embeddings().weight.shape[0]) for m in (lm, draft))
    if ours != theirs:
        raise ConfigError(f"{field}: the draft's vocabulary has {theirs} tokens and the model's {ours}; a draft must "
                          f"share the model's tokenizer and vocabulary.")
    if prefix_caching:
        raise ConfigError("generation.enable_prefix_caching: not with a draft model (the draft's cache would need the "
                          "same reuse); use speculative_config method ngram, or turn prefix caching off.")


def _from_artifact(config: ModelConfig, base_dir: str | Path | None) -> tuple[GenerationModel, list[int], Any]:
    from .artifact import DRAFT_DIR, load_generation  # noqa: PLC0415

    path = _under(base_dir, config.model.artifact)
    model, eos, tokenizer_dir = load_generation(path)
    spec = config.generation.speculative_config if config.generation else None
    if spec is not None and spec.method == "draft_model":
        if model.draft is None:
            raise ArtifactError(f"generation.speculative_config.model: {path} was built without a draft model; "
                                f"rebuild it from a model.yaml with this speculative_config, or use method ngram.")
        named, carried = Path(_under(base_dir, spec.model)).resolve(), (Path(path) / DRAFT_DIR).resolve()
        if named != carried:
            raise ArtifactError(f"generation.speculative_config.model: {path} carries its draft, compiled, in "
                                f"{carried}; name that folder, not {named} (or rebuild the artifact with this draft).")
    elif model.draft is not None:
        raise ArtifactError(f"generation.speculative_config: {path} was built with a draft model; serve it with the "
                            f"speculative_config it was built with (the artifact's own model.yaml), or rebuild it.")
    given = config.generation.model_dump(exclude_unset=True) if config.generation else {}
    built = {**model.buckets.describe(), "tensor_parallel_size": model.tensor_parallel_size}
    held = model.precision  # what the artifact's weights and cache were compiled in
    if held:
        built.update(quantization=held.get("quantization"), kv_cache_dtype=_kv_name(held.get("kv_cache_dtype")))
        if held.get("quantization"):
            built["quantization_type"] = held["quantization_type"]
        given = {k: _kv_name(v) if k == "kv_cache_dtype" else v for k, v in given.items()}
        if "dtype" in config.model_fields_set and config.dtype != held.get("dtype"):
            raise ArtifactError(f"dtype: {path} was built in {held.get('dtype')}, but this model.yaml asks for "
                                f"{config.dtype}; rebuild the artifact from this model.yaml or remove dtype.")
    differ = sorted(k for k in built if k in given and given[k] != built[k])
    if differ:
        raise ArtifactError(f"generation.{differ[0]}: {path} was built with {differ[0]} {built[differ[0]]}, but this "
                            f"model.yaml asks for {given[differ[0]]}; rebuild the artifact from this model.yaml or "
                            f"remove generation.{differ[0]}.")
    tokenizer = load_tokenizer(config, base_dir)
    if tokenizer is None and tokenizer_dir is not None:
        from transformers import AutoTokenizer  # noqa: PLC0415

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    if config.weights is not None:
        _swap_weights(model, config, base_dir, tokenizer)
    return model, eos, tokenizer


def _swap_weights(model: GenerationModel, config: ModelConfig, base_dir: str | Path | None, tokenizer: Any) -> None:
    """The artifact's compiled models handed the ``weights`` checkpoint (a save_pretrained directory of the same
    architecture), loaded as model.pretrained is, in the model.yaml's dtype and quantization; nothing compiles."""
    from ...compile.subgraph import compile_count  # noqa: PLC0415
    from .loading import _prepared, load_pretrained  # noqa: PLC0415
    from ..runner.slots import weights_of  # noqa: PLC0415

    directory = _under(base_dir, config.weights)
    lm, found = load_pretrained(directory, "weights", dtype=config.dtype)
    lm = _prepared(lm, config, config.generation or GenerationSettings(), found, tokenizer, directory)
    before = compile_count()
    try:
        replaced = model.replace_weights(weights_of(lm))
    except ConfigError as exc:
        raise ConfigError(f"weights: {directory}: {str(exc).removeprefix('replace_weights: ')} Give a checkpoint of "
                          f"the artifact's architecture, or remove weights to serve the artifact's own.") from None
    logger.info("model %s: weights from %s (%d tensors) swapped in; %d subgraph(s) compiled for them", config.name,
                directory, replaced, compile_count() - before)


def _kv_name(value: Any) -> Any:
    """fp8 and fp8_e4m3 are one KV cache dtype."""
    return "fp8_e4m3" if value == "fp8" else value


def build_engines(config: ModelConfig, base_dir: str | Path | None = None, *, replica: str = "0",
                  cores: int | None = None, background: bool = False) -> EngineGroup:
    """Load (or compile), check and start the engines of a ``task: generate`` model.yaml over ``cores`` cores
    (default: the replica's): one per core, or one per group of ``generation.tensor_parallel_size`` cores.
    With ``background`` they start on the models that answer every request, and the rest join as they
    compile (compiling.py; model.yaml's ``background_compile``).

    ``base_dir`` is the model.yaml's folder (relative paths and factory imports resolve
    against it). An artifact written by ``neuron-serve build`` is loaded without the
    transformers model. Errors name the model.yaml field.
    """
    if config.task != "generate":
        raise ConfigError(f"task: {config.name} is a task: {config.task} model; build_engine serves task: generate.")
    settings = config.generation or GenerationSettings()
    if config.model.artifact is not None:  # loading compiles too (in emulation): on the compile queue
        model, eos, tokenizer = compile_queue().submit(f"load {config.name} (artifact {config.model.artifact})",
                                                       lambda: _from_artifact(config, base_dir), priority=READY,
                                                       kind="load").future.result()
    else:
        model, eos, tokenizer = compile_from_config(config, base_dir, background=background)
    group = EngineGroup.on_cores(model, cores or config.cores_per_replica, eos_token_ids=eos,
                                 tokenizer=tokenizer, max_waiting=settings.max_waiting, name=config.name,
                                 replica=replica, adapters=model.adapter_policy, **engine_options(settings))
    from ...buckets.learn import attach  # noqa: PLC0415
    from .rebucket import families  # noqa: PLC0415

    # none for an artifact (model.build is None): its models compile nowhere
    attach(group.engines, settings, model.build, families(model.build, config.name, replica, group.engines[0].usage))
    for name, path in (settings.lora.lora_modules if settings.lora is not None else {}).items():
        try:
            group.load_adapter(name, _under(base_dir, path))
        except Exception:
            group.close()
            raise
    return group


def build_engine(config: ModelConfig, base_dir: str | Path | None = None, *, replica: str = "0",
                 cores: int | None = None, background: bool = False) -> Frontend:
    """:func:`build_engines`, behind their front end (its ``engines``), to serve in this process."""
    group = build_engines(config, base_dir, replica=replica, cores=cores, background=background)
    return Frontend(group, group.info, group.engines[0].tokenizer)
