"""Generation (task: generate): a causal LM compiled around a KV cache on the core, and its engine.

::

    from neuron_serve.generation import SamplingParams, engine_for

    engine = engine_for(model, max_num_seqs=8, max_model_len=512)    # a transformers causal LM
    [done] = engine.generate_batch([prompt_ids], SamplingParams(max_tokens=32, temperature=0))
    async for event in engine.generate(prompt_ids, SamplingParams(max_tokens=32)):  # streamed
        ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..buckets.generation import GenerationBuckets
from .frontend.protocol import Completion, TokenEvent
from .sample.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from .frontend.processor import Frontend

# The engine and the compiled model (.engine, .model) load the compiler: import them from
# their modules. This package stays light, as the replica imports it without the compiler.
__all__ = ["Completion", "GenerationBuckets", "SamplingParams", "TokenEvent", "engine_for", "eos_token_ids"]


def eos_token_ids(lm: torch.nn.Module) -> list[int]:
    """The end-of-sequence ids a transformers model's generation config (or config) names."""
    source = getattr(lm, "generation_config", None) or lm.config
    eos = getattr(source, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def engine_for(lm: torch.nn.Module, *, max_num_seqs: int = 8, max_model_len: int = 512,
               prefill_buckets: Sequence[int] | str | None = None,
               decode_batch_buckets: Sequence[int] | str | None = None, learn_buckets_after: int | None = None,
               prefill_batch_buckets: Sequence[int] | None = None,
               decode_context_buckets: Sequence[int] | None = None, decode_steps: int = 1,
               max_num_batched_tokens: int | None = None,
               max_waiting: int = 256, request_timeout_s: float | None = None, tokenizer: Any = None,
               target: str = "neuron", name: str = "model", tensor_parallel_size: int = 1,
               enable_prefix_caching: bool = False, speculative_config: Any = None,
               draft: torch.nn.Module | None = None, on_device_sampling: bool = True,
               enable_chunked_prefill: bool = False, prefill_chunk_buckets: Sequence[int] | None = None,
               long_prefill_token_threshold: int = 0, max_num_partial_prefills: int = 1,
               async_scheduling: bool | None = None) -> Frontend:
    """Compile ``lm`` for generation and start an engine over it, behind its front end (which checks and
    admits requests, and with a ``tokenizer`` detokenizes and applies stop strings; its ``engines`` is the
    :class:`~.engine.Engine`).

    The arguments are model.yaml's ``generation`` fields, checked as a model.yaml's are (``build.checked_buckets``);
    a KV cache that does not fit next to the weights on one core is refused with the bytes, as there.
    ``tensor_parallel_size`` N above 1 splits the model over N cores, which must be all
    the cores of this process: call it before any other XLA work here (emulated, the
    process then gets N XLA:CPU devices), or serve the model, where each group of cores
    runs in a process of its own. LoRA adapters, quantization: ``build.build_engine`` of a model.yaml (or
    ``precision.prepare`` of ``lm`` first)."""
    from ..buckets.learn import attach  # noqa: PLC0415
    from ..config.generation import GenerationSettings  # noqa: PLC0415
    from .compiling.build import check_draft, checked_buckets, engine_options  # noqa: PLC0415
    from .compiling.compile import compile_generation  # noqa: PLC0415
    from .core.engine import Engine  # noqa: PLC0415
    from .frontend.processor import Frontend  # noqa: PLC0415
    from .core.group import describe  # noqa: PLC0415
    from .compiling.rebucket import families  # noqa: PLC0415

    given = {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len, "prefill_buckets": prefill_buckets,
             "decode_batch_buckets": decode_batch_buckets, "decode_context_buckets": decode_context_buckets,
             "decode_steps": decode_steps, "max_num_batched_tokens": max_num_batched_tokens,
             "max_waiting": max_waiting, "request_timeout_s": request_timeout_s,
             "tensor_parallel_size": tensor_parallel_size, "enable_prefix_caching": enable_prefix_caching,
             "speculative_config": speculative_config, "on_device_sampling": on_device_sampling,
             "enable_chunked_prefill": enable_chunked_prefill, "prefill_chunk_buckets": prefill_chunk_buckets,
             "learn_buckets_after": learn_buckets_after, "prefill_batch_buckets": prefill_batch_buckets,
             "async_scheduling": async_scheduling}
    if enable_chunked_prefill:  # given only with it, as a model.yaml gives them
        given.update(long_prefill_token_threshold=long_prefill_token_threshold,
                     max_num_partial_prefills=max_num_partial_prefills)
    settings = GenerationSettings.checked({k: v for k, v in given.items() if v is not None})
    buckets = checked_buckets(lm, settings, field_prefix="", name=name)
    model = compile_generation(lm, buckets, target=target, tensor_parallel_size=tensor_parallel_size)
    if draft is not None:
        from ..errors import InvalidInput  # noqa: PLC0415

        if settings.speculative_config is None:
            raise InvalidInput("draft needs speculative_config (its num_speculative_tokens, k)")
        check_draft(lm, draft, enable_prefix_caching, field="draft")
        model.draft = compile_generation(draft.eval(), buckets.for_draft(), target=target,
                                         tensor_parallel_size=tensor_parallel_size)
    engine = Engine(model, eos_token_ids=eos_token_ids(lm), tokenizer=tokenizer, name=name,
                    **engine_options(settings))
    attach([engine], settings, model.build, families(model.build, name, "0", engine.usage))
    return Frontend(engine, describe([engine], max_waiting), tokenizer)
