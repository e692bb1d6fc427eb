"""model.yaml's ``pooling`` section and the rules of the pooling tasks (``embed``, ``score``, ``classify``).

Part of the model.yaml schema: it imports nothing of the compiler, transformers or
sentence-transformers, so the server reads a config without loading them. Settings left
out are read from the model's directory when a replica builds it (neuron_serve.pooling):
a sentence-transformers directory's ``modules.json``, ``1_Pooling/config.json`` and
``config_sentence_transformers.json``, or a transformers model's ``config.json``. The
names are vLLM's (its ``PoolerConfig`` and pooling parameters).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from ..buckets.auto import AUTO_LEARN_AFTER
from .generation import FieldError

POOLING_TASKS = ("embed", "score", "classify")
MAX_DEFAULT_MODEL_LEN = 512
SMALLEST_DEFAULT_BUCKET = 32

# Top-level fields of an inference model that a pooling model cannot honour (when given), and why.
_TOKENS = "a pooling model takes text (or token ids) and derives its inputs and outputs from the model"
_BUCKETS = "a pooling model's length buckets are pooling.length_buckets"
_WEIGHTS = "a pooling model is compiled from its directory (serve another checkpoint as model.pretrained)"
# field -> (the task it applies to, why a pooling model has no use for it)
POOLING_REFUSED = {"inputs": ("infer", _TOKENS), "outputs": ("infer", _TOKENS), "buckets": ("infer", _BUCKETS),
                   "weights": ("infer", _WEIGHTS), "inline_weights_to_neff": ("infer", _WEIGHTS),
                   "generation": ("generate", "a pooling model generates no tokens")}
_EMBED_ONLY = ("pooling_type", "normalize", "dimensions", "is_matryoshka", "matryoshka_dimensions")


class PoolingSettings(BaseModel):
    """task: embed, score or classify: how the model's output becomes a vector or scores, and the compiled lengths.

    Settings not given are read from the model directory: the pooling of
    ``1_Pooling/config.json``, the normalisation of a ``Normalize`` module in
    ``modules.json``, a cross-encoder's activation, ``max_seq_length``; a plain transformers
    model pools CLS (an encoder) or LAST (a decoder) and is normalised."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pooling_type: Literal["CLS", "MEAN", "LAST"] | None = Field(
        default=None,
        description="task: embed: the token vectors pooled into one: CLS (the first token), MEAN (the mean of the "
                    "input's tokens) or LAST (the last token, for decoder embedders); default: the sentence-"
                    "transformers directory's pooling, else CLS for an encoder and LAST for a decoder")
    normalize: bool | None = Field(
        default=None,
        description="task: embed: scale every embedding to unit length; default: whether the sentence-transformers "
                    "directory ends in a Normalize module, else true")
    dimensions: PositiveInt | None = Field(
        default=None,
        description="task: embed: the dimensions of an embedding when a request gives none (the first ones of a "
                    "Matryoshka model's vector; normalised again when normalize is on); default: all of them")
    is_matryoshka: bool | None = Field(
        default=None,
        description="task: embed: whether the model was trained for Matryoshka truncation, so that a request may "
                    "ask for fewer dimensions; default: the model config's is_matryoshka, or true when it lists "
                    "matryoshka_dimensions")
    matryoshka_dimensions: list[PositiveInt] | None = Field(
        default=None, min_length=1,
        description="task: embed: the only dimensions a request may ask for (implies is_matryoshka); default: the "
                    "model config's matryoshka_dimensions, else any number up to the model's")
    use_activation: bool | None = Field(
        default=None,
        description="task: score and classify: apply the model's activation to its logits (score: the cross-"
                    "encoder's activation_fn, sigmoid by default, as CrossEncoder.predict; classify: softmax, so "
                    "the answer holds probabilities); false: raw logits. Default: true")
    max_model_len: PositiveInt | None = Field(
        default=None,
        description=f"the most tokens of one input (a text, or a query and document together); longer inputs are "
                    f"refused unless a request sets truncate_prompt_tokens; default: the sentence-transformers "
                    f"max_seq_length, else the model's positions, at most {MAX_DEFAULT_MODEL_LEN}")
    length_buckets: list[PositiveInt] | Literal["auto"] | None = Field(
        default=None,
        description=f"the sequence lengths compiled (each at every batch size); an input runs in the smallest that "
                    f"holds it; the largest is max_model_len; default: {SMALLEST_DEFAULT_BUCKET}, doubling up to "
                    f"max_model_len. auto: as many lengths as the default, chosen from the input lengths the "
                    f"model's replicas recorded in the compile cache (the ones that pad least, max_model_len kept) "
                    f"once learn_buckets_after inputs are recorded; the defaults until then")
    packing: bool | None = Field(
        default=None,
        description="run several texts in one compiled row (first-fit decreasing into rows of a length bucket), "
                    "each attending only to itself, its positions restarting and pooled on its own, so a batch "
                    "pads to whole rows rather than every text to its bucket; a text longer than a row runs in the "
                    "bucket that holds it. Default: on where the model computes the same packed as alone (checked "
                    "on it at load: mean, CLS or last-token pooling, an encoder or decoder taking a 4-D attention "
                    "mask and position ids, a cross-encoder's classifier on each pair's first token), else off "
                    "with the reason in the model's metadata; true refuses a model that cannot; false: one text "
                    "a row")
    learn_buckets_after: PositiveInt | None = Field(
        default=None,
        description=f"length_buckets: auto: the recorded inputs a replica needs before it starts on the buckets "
                    f"chosen from them; default: {AUTO_LEARN_AFTER}")

    @model_validator(mode="after")
    def _check(self) -> "PoolingSettings":
        buckets = self.length_buckets
        if buckets is not None and buckets != "auto":
            if not buckets:
                raise FieldError("length_buckets", "give at least one length, or auto")
            if buckets != sorted(set(buckets)):
                raise FieldError("length_buckets", f"{buckets} must be increasing, each length once; give them "
                                                   f"smallest first")
            if self.max_model_len is not None and buckets[-1] != self.max_model_len:
                raise FieldError("length_buckets", f"the largest bucket, {buckets[-1]}, must equal max_model_len "
                                                   f"({self.max_model_len}); end the list with it or remove "
                                                   f"max_model_len")
        if self.learn_buckets_after is not None and buckets != "auto":
            raise FieldError("learn_buckets_after", "applies to length_buckets: auto only; set length_buckets: auto "
                                                    "or remove learn_buckets_after")
        given = self.matryoshka_dimensions
        if given is not None:
            if self.is_matryoshka is False:
                raise FieldError("matryoshka_dimensions", "is given with is_matryoshka: false; remove one of them")
            if self.dimensions is not None and self.dimensions not in given:
                raise FieldError("dimensions", f"{self.dimensions} is not one of matryoshka_dimensions {given}; "
                                               f"give one of them")
        if self.dimensions is not None and self.is_matryoshka is False:
            raise FieldError("dimensions", "fewer dimensions than the model's need a Matryoshka model; remove "
                                           "dimensions or set is_matryoshka: true")
        return self

    def default_buckets(self, max_model_len: int) -> list[int]:
        """The length buckets: as given, else (``auto`` too) powers of two from 32 below ``max_model_len``, then it."""
        if self.length_buckets not in (None, "auto"):
            return list(self.length_buckets)
        buckets, length = [], SMALLEST_DEFAULT_BUCKET
        while length < max_model_len:
            buckets.append(length)
            length *= 2
        return [*buckets, max_model_len]


def check_pooling_task(config: Any) -> None:
    """ModelConfig's rules of the pooling tasks (and of ``pooling`` elsewhere); raises FieldError naming the field."""
    if config.task not in POOLING_TASKS:
        if config.batching.max_batch_tokens is not None:
            raise FieldError("batching.max_batch_tokens", f"applies to task: embed, score or classify, whose texts "
                                                          f"are counted in tokens; a task: {config.task} batch is "
                                                          f"counted in rows (max_batch_size); remove it")
        if config.pooling is not None:
            raise FieldError("pooling", f"applies to task: embed, score or classify, not {config.task}; set one of "
                                        f"them or remove pooling")
        return
    if config.model.pretrained is None:
        raise FieldError("model.pretrained", f"Field required for task: {config.task} (a sentence-transformers or "
                                             f"transformers model directory, relative to the model.yaml)")
    for name, (task, reason) in POOLING_REFUSED.items():
        if getattr(config, name) is not None:
            raise FieldError(name, f"applies to task: {task}; {reason}; remove {name}")
    if not config.dynamic_batch:
        raise FieldError("dynamic_batch", "a pooling model runs the texts of many requests together, at any count; "
                                          "remove dynamic_batch: false")
    if config.placement.mode == "pipeline":
        raise FieldError("placement.mode", "pipeline applies to task: infer; a pooling model runs whole on each "
                                           "core; remove placement or use mode: replicate")
    settings = config.pooling
    if settings is None:
        return
    if config.task != "embed":
        for name in _EMBED_ONLY:
            if getattr(settings, name) is not None:
                raise FieldError(f"pooling.{name}", f"applies to task: embed; a {config.task} model's output is "
                                                    f"its logits (see use_activation); remove {name}")
    elif settings.use_activation is not None:
        raise FieldError("pooling.use_activation", "applies to task: score and classify; an embedding has no "
                                                   "activation (see normalize); remove use_activation")
