"""A pooling model's directory read with sentence-transformers' own loaders, and model.yaml's ``pooling`` applied.

``task: embed`` loads a ``SentenceTransformer`` (a directory it saved, or a plain transformers
model, which it wraps), ``score`` and ``classify`` a ``CrossEncoder`` (a sequence-classification
model). Its first module must be the transformer reading text; the modules after it
(pooling, Dense, normalisation) are kept as they are, but for what model.yaml overrides:
``pooling_type`` replaces the pooling, ``normalize`` adds or drops the final ``Normalize``.
The result is the module to compile (`PoolingGraph`) and the `PoolingSpec` a replica serves
it by.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ..buckets.auto import AUTO_LEARN_AFTER
from ..config.pooling import MAX_DEFAULT_MODEL_LEN, PoolingSettings
from ..config.schema import ModelConfig
from ..errors import ConfigError
from .graph import PoolingGraph
from .packed_graph import MODES, SEGMENTS, PackedPoolingGraph, SequenceClassifierHead, exact, position_offset
from .spec import OUTPUTS, POOLING_MODES, POOLING_NAMES, PoolingSpec

logger = logging.getLogger("neuron_serve")

# Modules that may follow the transformer: each maps sentence-transformers' features to features in torch alone.
HEADS = ("Pooling", "Dense", "Normalize", "LayerNorm", "Dropout")


def resolve_path(base_dir: str | Path | None, path: str) -> Path:
    """A path of model.yaml, relative to its folder."""
    resolved = Path(path).expanduser()
    return resolved if resolved.is_absolute() or base_dir is None else Path(base_dir) / resolved


def load(config: ModelConfig, base_dir: str | Path | None = None) -> tuple[PoolingGraph, PoolingSpec, Any]:
    """The graph to compile, its spec (``hidden_size`` not yet known) and the tokenizer, from ``config``."""
    directory = resolve_path(base_dir, config.model.pretrained)
    if not directory.is_dir():
        raise ConfigError(f"model.pretrained: {directory} is not a directory; give a directory written by "
                          f"SentenceTransformer.save, CrossEncoder.save or save_pretrained (relative to the "
                          f"model.yaml's folder).")
    settings = config.pooling or PoolingSettings()
    loaded = _load(config.task, directory)
    modules = list(loaded)
    transformer = _transformer(modules[0], directory)
    model = transformer.auto_model
    dtype = config.torch_dtype(model.get_input_embeddings().weight.dtype)
    loaded.to(dtype)  # every module, the heads (Dense, a classifier) included
    tokenizer = _tokenizer(config, base_dir, transformer)
    names = _input_names(model, tokenizer)
    prompt = _prompt(loaded, modules)
    if config.task == "embed":
        heads, fields = _embedding_heads(modules[1:], settings, directory, model, transformer)
        result, activation = "sentence_embedding", None
        fields.update(_matryoshka(settings, model.config))
    else:
        heads, activation, fields = _scoring(config.task, loaded, modules[1:], settings, model, directory)
        result = "scores"
    max_len = _max_model_len(settings, loaded, model, tokenizer)
    graph = PoolingGraph(model, names, _output_key(transformer), transformer.module_output_name, heads, result,
                         activation).eval()
    pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    vocab_size = int(model.get_input_embeddings().num_embeddings)
    packed, packing = _packing(config, settings, directory, model, names, transformer, heads, activation, graph,
                               pad_token_id, vocab_size)
    output = OUTPUTS[config.task] if config.task == "embed" or activation is not None else "logits"
    buckets, learned = length_buckets(config, settings, max_len)
    spec = PoolingSpec(task=config.task, input_names=names, output_name=output, max_model_len=max_len,
                       length_buckets=tuple(buckets), buckets_from=learned, pad_token_id=pad_token_id,
                       vocab_size=vocab_size, prompt=prompt, dtype=str(dtype).removeprefix("torch."),
                       segments=packed.segments if packed is not None else 1, packing=packing, **fields)
    return (packed if packed is not None else graph), spec, tokenizer


def _packing(config: ModelConfig, settings: PoolingSettings, directory: Path, model: torch.nn.Module,
             names: tuple[str, ...], transformer: Any, heads: list, activation: torch.nn.Module | None,
             padded: PoolingGraph, pad_token_id: int, vocab_size: int) -> tuple[PackedPoolingGraph | None, str]:
    """The packed graph of the model (several texts a row) and "on", or None and why it is served padded: packing
    off in model.yaml, a pooling it cannot do per text, or a model that computes otherwise packed (`exact`)."""
    if settings.packing is False:
        return None, "off (pooling.packing: false)"
    graph, reason = None, None
    if config.task == "embed":
        from sentence_transformers.sentence_transformer.modules import Pooling  # noqa: PLC0415

        first = heads[0] if heads else None
        mode = getattr(first, "pooling_mode", None) if isinstance(first, Pooling) else None
        if mode not in MODES:
            reason = f"its pooling ({mode or 'none'}) is not one of {', '.join(MODES)}, which are pooled per text"
        else:
            graph = PackedPoolingGraph(model, names, _output_key(transformer), SEGMENTS, position_offset(model),
                                       _is_decoder(model), mode, heads[1:], "sentence_embedding")
    elif not isinstance(getattr(model, "classifier", None), torch.nn.Module):
        reason = f"its {type(model).__name__} has no classifier reading the first token of each pair"
    else:
        graph = PackedPoolingGraph(model.base_model, names, "last_hidden_state", SEGMENTS, position_offset(model),
                                   False, None, heads, "scores", feature=transformer.module_output_name,
                                   classifier=SequenceClassifierHead(model), activation=activation)
    if graph is not None:
        reason = exact(graph.eval(), padded, vocab_size, pad_token_id)
    if reason is None:
        return graph, "on"
    if settings.packing:
        raise ConfigError(f"pooling.packing: {directory} cannot run several texts a row: {reason}; set packing: "
                          f"false or leave it out (it is then served one text a row)")
    logger.info("model %s: one text a row (packing off): %s", config.name, reason)
    return None, f"off: {reason}"



def _load(task: str, directory: Path) -> Any:
    from sentence_transformers import CrossEncoder, SentenceTransformer  # noqa: PLC0415

    kind = SentenceTransformer if task == "embed" else CrossEncoder
    try:
        return kind(str(directory), device="cpu", local_files_only=True)
    except Exception as exc:  # sentence-transformers and transformers raise many kinds for an unreadable directory
        what = "a sentence-transformers or transformers model" if task == "embed" else \
            "a cross-encoder (a transformers sequence-classification model)"
        raise ConfigError(f"model.pretrained: cannot load {directory} as {what} ({_first_line(exc)}); give a "
                          f"directory written by {kind.__name__}.save or save_pretrained.") from None


def _transformer(module: Any, directory: Path) -> Any:
    from sentence_transformers.base.modules import Transformer  # noqa: PLC0415

    if not isinstance(module, Transformer):
        raise ConfigError(f"model.pretrained: {directory}'s first module is a {type(module).__name__}; a pooling model "
                          f"starts with a transformers model (sentence-transformers' Transformer module).")
    modalities = module.modality_config
    if "text" not in modalities or "message" in modalities:
        raise ConfigError(f"model.pretrained: {directory} reads {sorted(modalities)} (sentence-transformers' "
                          f"modality_config); only plain text is served, not chat-formatted messages or other "
                          f"modalities.")
    return module


def _output_key(transformer: Any) -> str:
    key = transformer.modality_config["text"]["method_output_name"]
    return key if isinstance(key, str) else key[0]


def _tokenizer(config: ModelConfig, base_dir: str | Path | None, transformer: Any) -> Any:
    if config.tokenizer is None:
        tokenizer = transformer.tokenizer
        if tokenizer is None:
            raise ConfigError(f"tokenizer: {config.model.pretrained} holds no tokenizer; give one with tokenizer: "
                              f"<a directory of transformers tokenizer files>.")
        return tokenizer
    from transformers import AutoTokenizer  # noqa: PLC0415

    directory = resolve_path(base_dir, config.tokenizer)
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for unreadable tokenizer files
        raise ConfigError(f"tokenizer: cannot load a tokenizer from {directory} ({_first_line(exc)}); give a "
                          f"directory written by a tokenizer's save_pretrained.") from None


def _input_names(model: torch.nn.Module, tokenizer: Any) -> tuple[str, ...]:
    """input_ids and attention_mask, and token_type_ids when the tokenizer makes them and the model reads them
    (BERT's segments: a cross-encoder tells query from document by them)."""
    import inspect  # noqa: PLC0415

    names = ("input_ids", "attention_mask")
    takes = inspect.signature(model.forward).parameters
    if "token_type_ids" in getattr(tokenizer, "model_input_names", ()) and "token_type_ids" in takes:
        names += ("token_type_ids",)
    return names


def _prompt(loaded: Any, modules: list) -> str:
    """The directory's default prompt (config_sentence_transformers.json), which ``encode`` puts before each text."""
    name = getattr(loaded, "default_prompt_name", None)
    prompt = (getattr(loaded, "prompts", None) or {}).get(name, "") if name else ""
    if prompt and any(getattr(m, "include_prompt", True) is False for m in modules):
        raise ConfigError(f"model.pretrained: the default prompt {name!r} is left out of the pooling "
                          f"(include_prompt: false in its Pooling config), which is not supported; set "
                          f"include_prompt to true or remove default_prompt_name.")
    return prompt or ""


def _is_decoder(model: torch.nn.Module) -> bool:
    """A causal (decoder-only) model: one transformers cannot load for masked-language modelling."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES  # noqa: PLC0415

    return model.config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def _embedding_heads(heads: list, settings: PoolingSettings, directory: Path, model: torch.nn.Module,
                     transformer: Any) -> tuple[list, dict]:
    """The modules after the transformer with model.yaml's pooling_type and normalize applied, and the spec's
    fields they decide."""
    from sentence_transformers.base.modules import Normalize  # noqa: PLC0415
    from sentence_transformers.sentence_transformer.modules import Pooling  # noqa: PLC0415

    unknown = [type(h).__name__ for h in heads if type(h).__name__ not in HEADS]
    if unknown:
        raise ConfigError(f"model.pretrained: {directory} has modules {unknown} after its transformer; served are "
                          f"{', '.join(HEADS)}.")
    plain = not (directory / "modules.json").is_file()
    if plain:  # sentence-transformers wraps a plain model in mean pooling; vLLM's defaults are CLS or LAST
        heads = [h for h in heads if not isinstance(h, Pooling)]
        default = "LAST" if _is_decoder(model) else "CLS"
        heads.insert(0, Pooling(transformer.get_embedding_dimension(), POOLING_MODES[settings.pooling_type or default]))
    elif settings.pooling_type is not None:
        found = [i for i, h in enumerate(heads) if isinstance(h, Pooling)]
        if not found:
            raise ConfigError(f"pooling.pooling_type: {directory} has no Pooling module to set; remove pooling_type.")
        old = heads[found[0]]
        heads[found[0]] = Pooling(old.embedding_dimension, POOLING_MODES[settings.pooling_type], old.include_prompt)
    pools = [h for h in heads if isinstance(h, Pooling)]
    mode = pools[0].pooling_mode if pools else None
    name = POOLING_NAMES.get(mode, mode if isinstance(mode, str) or mode is None else "+".join(mode))
    has_norm = bool(heads) and isinstance(heads[-1], Normalize)
    normalize = settings.normalize if settings.normalize is not None else (has_norm or plain)
    if normalize and not has_norm:
        heads.append(Normalize())
    elif not normalize and has_norm:
        heads.pop()
    return heads, {"pooling_type": name, "normalize": normalize}


def _matryoshka(settings: PoolingSettings, model_config: Any) -> dict:
    """Which dimensions a request may ask for: model.yaml's, else the model config's (as vLLM reads them)."""
    listed = settings.matryoshka_dimensions
    if listed is None and settings.is_matryoshka is not False:
        listed = getattr(model_config, "matryoshka_dimensions", None)
    flag = settings.is_matryoshka
    if flag is None:
        flag = bool(getattr(model_config, "is_matryoshka", False)) or listed is not None
    return {"is_matryoshka": flag, "matryoshka_dimensions": tuple(int(d) for d in listed) if listed else None,
            "dimensions": settings.dimensions}


def _scoring(task: str, loaded: Any, heads: list, settings: PoolingSettings, model: torch.nn.Module,
             directory: Path) -> tuple[list, torch.nn.Module | None, dict]:
    """A cross-encoder's heads, activation and labels (score: one label; classify: any)."""
    unknown = [type(h).__name__ for h in heads if type(h).__name__ not in HEADS]
    if unknown:
        raise ConfigError(f"model.pretrained: {directory} has modules {unknown} after its transformer; served are "
                          f"{', '.join(HEADS)}.")
    labels = int(loaded.num_labels)
    if task == "score" and labels != 1:
        raise ConfigError(f"task: score needs a cross-encoder with one label (num_labels 1, a relevance score); "
                          f"{directory} has {labels}: serve it with task: classify.")
    id2label = getattr(model.config, "id2label", None) or {}
    names = tuple(str(id2label.get(i, f"LABEL_{i}")) for i in range(labels))
    activation = None
    if settings.use_activation is not False:
        if task == "score":
            activation = loaded.activation_fn
        else:  # vLLM's /classify answers probabilities: softmax over the labels, sigmoid for one label
            activation = torch.nn.Softmax(dim=-1) if labels > 1 else torch.nn.Sigmoid()
        if isinstance(activation, torch.nn.Identity):
            activation = None
    return heads, activation, {"labels": names, "activation": type(activation).__name__ if activation is not None
                               else None}


def _positions(model: torch.nn.Module) -> int | None:
    """The most tokens the model's position embeddings hold (RoBERTa's start after its padding index)."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is None:
        return None
    embeddings = getattr(model, "embeddings", None) or getattr(getattr(model, "base_model", None), "embeddings", None)
    offset = getattr(embeddings, "padding_idx", None)
    if offset is not None and type(embeddings).__name__.startswith(("Roberta", "XLMRoberta", "Camembert")):
        positions -= offset + 1
    return int(positions)


def _max_model_len(settings: PoolingSettings, loaded: Any, model: torch.nn.Module, tokenizer: Any) -> int:
    """pooling.max_model_len (or its buckets' largest), else sentence-transformers' max_seq_length, else the
    model's positions and the tokenizer's limit, at most MAX_DEFAULT_MODEL_LEN; never past the positions."""
    positions = _positions(model)
    listed = settings.length_buckets if settings.length_buckets != "auto" else None
    given = settings.max_model_len or (listed[-1] if listed else None)
    if given is not None:
        if positions is not None and given > positions:
            field = "max_model_len" if settings.max_model_len else "length_buckets"
            raise ConfigError(f"pooling.{field}: {given} tokens is more than the model's {positions} positions; give "
                              f"at most {positions}.")
        return int(given)
    limits = [getattr(loaded, "max_seq_length", None), positions, MAX_DEFAULT_MODEL_LEN]
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and model_max < 1_000_000:
        limits.append(model_max)
    return int(min(v for v in limits if v))


def length_buckets(config: ModelConfig, settings: PoolingSettings, max_len: int) -> tuple[list[int], str]:
    """The length buckets to compile and where they come from: model.yaml's list, the defaults, or (``auto``) the
    lengths the model's replicas recorded in the compile cache, once ``learn_buckets_after`` of them are: as many
    buckets as the defaults, those that pad the recorded inputs least, ``max_len`` kept."""
    defaults = settings.default_buckets(max_len)
    if settings.length_buckets != "auto":
        return defaults, "model.yaml" if settings.length_buckets is not None else "defaults"
    from ..buckets import usage as bucket_usage  # noqa: PLC0415 - only auto reads the recorded lengths

    chosen, calls = bucket_usage.learn(config.name, "length", "length buckets", defaults,
                                       settings.learn_buckets_after or AUTO_LEARN_AFTER, "inputs")
    return chosen, f"traffic ({calls} inputs)" if calls else "defaults"


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
