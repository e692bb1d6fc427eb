"""Which generation models are compiled: prefill and decode buckets and their defaults.

Prefill models are compiled per prompt-length bucket, decode models per (running
sequences x context length) bucket, as vLLM on Neuron and NxD Inference bucket
context encoding and token generation. Defaults follow from ``max_num_seqs`` and
``max_model_len``: prompt lengths and contexts double from 32 and 128 up to
``max_model_len``, prompt lengths from 256 on with a bucket half way between each
(384, 768, ...); running-sequence counts are the powers of 4 below ``max_num_seqs``
and ``max_num_seqs`` itself (as compiled batch sizes are).

Prompts arriving together are prefilled together: each prefill bucket is also compiled for
several prompts a call (``prefill_rows``, rows x prompt length, as NxD Inference's context-encoding
batch size), where rows x length is at most ``max_model_len`` (a call of several prompts costs at
most what the longest prompt's does). Defaults: 1, then the powers of 4 up to ``max_num_seqs`` and
``max_num_seqs`` itself, as decode rows. On SmolLM2-135M (XLA:CPU, 2 vCPUs) a one-prompt prefill of 32
tokens costs 102 ms, 8 of them in one call 329 ms (41 ms a prompt): most of a short prefill's time is
reading the weights, once a call.

Every decode bucket is compiled twice: choosing each row's token by argmax (a batch of
greedy rows), and by the sampler, from each row's parameters (a batch with a sampled row).
A draft model, and a model with ``on_device_sampling: false`` (``sampled`` False), has the
argmax form only: its sampled rows are chosen on the host.

With ``decode_steps`` K above 1, every decode bucket is also compiled as K steps in one
call (each step's token fed back on the core, as vLLM's multi-step scheduling and
on-device sampling do): a batch of sequences then crosses to the host once per K tokens.

With ``prefix_caching``, a prompt whose first tokens are already in a slot's cache is
prefilled from there: its remaining tokens run in an extend model, compiled per
(suffix-length bucket x context bucket), suffix lengths from the prefill buckets and
contexts from the decode context buckets, each suffix no longer than its context.

With ``speculative_tokens`` k, every decode bucket is also compiled as a verify model:
k + 1 tokens a row (the last token and k proposals), the logits of every one returned.

With chunked prefill (``chunks``: chunk-length buckets), every decode-rows bucket is also compiled as a
mixed model per chunk length: one call that decodes those rows and writes a chunk of one prompt into its
slot, both attending over ``max_model_len`` positions (one context: the grid stays rows x chunks). Its
default chunk length is a quarter of ``max_model_len`` (at least 32), the prefill budget's default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..errors import ConfigError

FIRST_PREFILL_BUCKET = 32
FIRST_CONTEXT_BUCKET = 128
# From here on a prefill's time grows with its padded length (below it a call's fixed cost
# dominates): a 310-token prompt took 8.9 ms in the 512 bucket, 7.0 in a 384 one, where
# eager transformers' forward of it takes 8.6 ms.
FINER_PREFILL_FROM = 256
MAX_DECODE_STEPS = 16
# A family whose buckets may be learned (model.yaml's auto): (recorded family, field, GenerationBuckets attribute)
LEARNED = (("prefill", "prefill_buckets", "prefill"), ("decode_rows", "decode_batch_buckets", "decode_rows"),
           ("decode_context", "decode_context_buckets", "decode_context"))


def doubling(first: int, last: int) -> list[int]:
    """first, 2 first, 4 first, ... below ``last``, then ``last``."""
    sizes, size = [], min(first, last)
    while size < last:
        sizes.append(size)
        size *= 2
    return [*sizes, last]


def prefill_sizes(last: int) -> list[int]:
    """Prompt-length buckets: doubling from 32, and from 256 on 1.5x between each doubling, so a long
    prompt pads by at most a third, not by as much again."""
    sizes = []
    for size in doubling(FIRST_PREFILL_BUCKET, last):
        if sizes and sizes[-1] >= FINER_PREFILL_FROM and sizes[-1] * 3 // 2 < size:
            sizes.append(sizes[-1] * 3 // 2)
        sizes.append(size)
    return sizes


def default_chunk(max_model_len: int) -> int:
    """A mixed model's chunk length when none is given: a quarter of ``max_model_len``, at least 32 (below it)."""
    return min(max(FIRST_PREFILL_BUCKET, max_model_len // 4), max_model_len - 1)


def powers_of_four(last: int) -> list[int]:
    sizes, size = [], 1
    while size < last:
        sizes.append(size)
        size *= 4
    return [*sizes, last]


@dataclass
class GenerationBuckets:
    """The compiled shapes of a generation model; see the module docstring for the defaults."""

    max_num_seqs: int
    max_model_len: int
    prefill: list[int] = field(default_factory=list)
    decode_rows: list[int] = field(default_factory=list)
    decode_context: list[int] = field(default_factory=list)
    decode_steps: int = 1
    prefix_caching: bool = False
    speculative_tokens: int = 0  # k: verify models take k + 1 tokens a row (0: none compiled)
    sampled: bool = True  # decode and verify also compiled with the sampler (a draft's are not)
    chunks: list[int] = field(default_factory=list)  # chunk lengths of the mixed models (none: no chunked prefill)
    prefill_rows: list[int] = field(default_factory=lambda: [1])  # prompts a prefill call takes

    @classmethod
    def build(cls, max_num_seqs: int, max_model_len: int, *, prefill: Sequence[int] | None = None,
              decode_rows: Sequence[int] | None = None, decode_context: Sequence[int] | None = None,
              decode_steps: int = 1, prefix_caching: bool = False, speculative_tokens: int = 0,
              sampled: bool = True, chunks: Sequence[int] | None = None, chunked: bool = False,
              prefill_rows: Sequence[int] | None = None, field_prefix: str = "generation.") -> "GenerationBuckets":
        """Defaults for what is not given; each list checked and sorted. Errors name the model.yaml field."""
        if max_num_seqs < 1:
            raise ConfigError(f"{field_prefix}max_num_seqs: must be at least 1, got {max_num_seqs}.")
        if max_model_len < 2:
            raise ConfigError(f"{field_prefix}max_model_len: must be at least 2 (a prompt token and a generated "
                              f"one), got {max_model_len}.")
        if not 1 <= decode_steps <= MAX_DECODE_STEPS:
            raise ConfigError(f"{field_prefix}decode_steps: must be 1 (one token per call) to {MAX_DECODE_STEPS}, "
                              f"got {decode_steps}.")
        lists = {
            "prefill_buckets": (prefill, prefill_sizes(max_model_len), max_model_len),
            "decode_batch_buckets": (decode_rows, powers_of_four(max_num_seqs), max_num_seqs),
            "decode_context_buckets": (decode_context, doubling(FIRST_CONTEXT_BUCKET, max_model_len), max_model_len),
        }
        chosen = {}
        for name, (given, default, limit) in lists.items():
            sizes = sorted(set(given)) if given is not None else default
            if not sizes or any(s < 1 for s in sizes):
                raise ConfigError(f"{field_prefix}{name}: give positive sizes, got {list(given or [])}.")
            if sizes[-1] != limit:
                what = "max_num_seqs" if name == "decode_batch_buckets" else "max_model_len"
                raise ConfigError(f"{field_prefix}{name}: the largest bucket must be {what} ({limit}), got "
                                  f"{sizes[-1]}: a larger one could never be used, a smaller one leaves "
                                  f"{what} unreachable.")
            chosen[name] = sizes
        chunk_sizes = []
        if chunked:
            chunk_sizes = sorted(set(chunks)) if chunks is not None else [default_chunk(max_model_len)]
            if not chunk_sizes or chunk_sizes[0] < 1 or chunk_sizes[-1] >= max_model_len:
                raise ConfigError(f"{field_prefix}prefill_chunk_buckets: give chunk lengths from 1 to below "
                                  f"max_model_len ({max_model_len}), got {list(chunks or [])}.")
        elif chunks is not None:
            raise ConfigError(f"{field_prefix}prefill_chunk_buckets: applies with enable_chunked_prefill: true; "
                              f"turn it on or remove prefill_chunk_buckets.")
        rows = sorted(set(prefill_rows)) if prefill_rows is not None else powers_of_four(max_num_seqs)
        if not rows or rows[0] != 1 or rows[-1] > max_num_seqs:
            raise ConfigError(f"{field_prefix}prefill_batch_buckets: give prompt counts from 1 (a prompt alone) to at "
                              f"most max_num_seqs ({max_num_seqs}), got {list(prefill_rows or [])}.")
        return cls(max_num_seqs, max_model_len, chosen["prefill_buckets"], chosen["decode_batch_buckets"],
                   chosen["decode_context_buckets"], decode_steps, prefix_caching, speculative_tokens, sampled,
                   chunk_sizes, rows)

    @property
    def count(self) -> int:
        """How many models are compiled."""
        decode = len(self.decode_rows) * len(self.decode_context) * (2 if self.sampled else 1)
        return (len(self.prefills) + decode * (2 if self.decode_steps > 1 else 1) + len(self.extend)
                + (decode if self.speculative_tokens else 0) + len(self.mixed) * (2 if self.sampled else 1))

    @property
    def prefills(self) -> list[tuple[int, int]]:
        """(prompts, length) of each prefill model: every length alone, and with more prompts a call while they
        hold at most ``max_model_len`` tokens, in that order."""
        return [(rows, length) for rows in self.prefill_rows for length in self.prefill
                if rows == 1 or rows * length <= self.max_model_len]

    @property
    def mixed(self) -> list[tuple[int, int]]:
        """(decode rows, chunk tokens) of each mixed model, over max_model_len positions (none without chunks)."""
        return [(rows, tokens) for rows in self.decode_rows for tokens in self.chunks]

    @property
    def extend(self) -> list[tuple[int, int]]:
        """(suffix tokens, context) of each extend model: prefill after a cached prefix (none without caching)."""
        if not self.prefix_caching:
            return []
        return [(tokens, context) for context in self.decode_context for tokens in self.prefill if tokens <= context]

    def for_draft(self) -> "GenerationBuckets":
        """A speculative draft's buckets: the same prefill and decode shapes, each decode also compiled as k + 1
        greedy steps (k proposals, and the last one fed too, so the draft's cache holds every accepted token)."""
        return GenerationBuckets(self.max_num_seqs, self.max_model_len, self.prefill, self.decode_rows,
                                 self.decode_context, self.speculative_tokens + 1, sampled=False)  # prompts one a call

    def describe(self) -> dict:
        return {"max_num_seqs": self.max_num_seqs, "max_model_len": self.max_model_len,
                "prefill_buckets": self.prefill, "decode_batch_buckets": self.decode_rows,
                "decode_context_buckets": self.decode_context,
                "decode_steps": self.decode_steps, "enable_prefix_caching": self.prefix_caching,
                "speculative_tokens": self.speculative_tokens, "on_device_sampling": self.sampled,
                "enable_chunked_prefill": bool(self.chunks), "prefill_chunk_buckets": self.chunks,
                "prefill_batch_buckets": self.prefill_rows}
