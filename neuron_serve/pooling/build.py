"""From a pooling model.yaml to a compiled model: one graph per sequence-length bucket and batch size.

The graph (source.py) is traced with ``trace_buckets``: the bucket spec pads every input
along its sequence dimension to the smallest length bucket that holds it (token ids with
the tokenizer's pad id, the attention mask with zeros), each bucket is compiled at every
batch size of ``batch_sizes`` (or the defaults of ``batching.max_batch_size``), and
``dynamic_batch`` lets any number of rows run as the cheapest of them, as an infer model's
do. The replica runs it with the same runtime (request queue, cores round-robin).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from ..api import dynamic_batch, trace_buckets
from ..buckets.shape import BucketSpec
from ..assembly import progress
from ..compile import cache as compile_cache
from ..compile.subgraph import compile_count
from ..config.schema import ModelConfig
from ..errors import ConfigError
from ..model import CompiledModel
from ..partition.config import PartitionerConfig
from . import source
from .spec import PoolingSpec

logger = logging.getLogger("neuron_serve")


def example_inputs(spec: PoolingSpec, rows: int) -> tuple[torch.Tensor, ...]:
    """Inputs of ``rows`` rows at the longest bucket: token ids, an attention mask with padding, segment ids."""
    length = spec.length_buckets[-1]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.int64)
    mask[-1, length // 2 + 1:] = 0  # a shorter row: the graph is traced as it runs, with padding
    given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    return tuple(given[name] for name in spec.input_names)


def compile_pooling(graph: torch.nn.Module, spec: PoolingSpec, config: ModelConfig,
                    base_dir: str | Path | None = None) -> CompiledModel:
    """``graph`` compiled at every length bucket and batch size of ``config``, with dynamic batching."""
    sizes = config.compiled_batch_sizes()
    buckets = BucketSpec.build(sizes=list(spec.length_buckets), inputs={i: 1 for i in range(len(spec.input_names))},
                               pad_values={0: spec.pad_token_id})
    # Operators the accelerator cannot run go to CPU subgraphs (the partitioner's defaults) unless model.yaml
    # sets the partitioner; the placement line of the build names them.
    partitioner = config.partitioner_config(base_dir) or PartitionerConfig()
    labels = [f"len {n}" for n in spec.length_buckets]
    with progress.reporting(progress.BuildProgress(config.name, len(labels), batch_sizes=len(sizes), labels=labels)):
        compiled = trace_buckets(graph, example_inputs(spec, max(sizes)), buckets, partitioner_config=partitioner,
                                 target=config.target, batch_sizes=sizes, compiler_args=config.compiler_args)
    dynamic_batch(compiled)
    compiled.input_names = list(spec.input_names)
    compiled.output_names = [spec.output_name]
    return compiled


def build(config: ModelConfig, base_dir: str | Path | None = None) -> tuple[CompiledModel, PoolingSpec, Any]:
    """Load, compile and describe the pooling model of ``config``: (compiled model, spec, tokenizer)."""
    started = time.perf_counter()
    compiles = compile_count()
    store = compile_cache.current()  # opens the persistent cache before anything compiles
    graph, spec, tokenizer = source.load(config, base_dir)
    compiled = compile_pooling(graph, spec, config, base_dir)
    spec = spec.with_hidden_size(int(compiled.signature().outputs[0].shape[-1]))
    check_dimensions(spec)
    compiled.build_info.seconds = time.perf_counter() - started
    compiled.build_info.compiles = compile_count() - compiles
    compiled.build_info.cache_hits = {kind: s.hits for kind, s in (store.stats.items() if store is not None else ())}
    logger.info("model %s built in %.1fs (task %s, lengths %s)", config.name, compiled.build_info.seconds,
                spec.task, list(spec.length_buckets))
    return compiled, spec, tokenizer


def check_dimensions(spec: PoolingSpec) -> None:
    """Refuse model.yaml dimensions wider than the embedding the model makes."""
    if spec.task != "embed":
        return
    for field, values in (("dimensions", [spec.dimensions] if spec.dimensions else []),
                          ("matryoshka_dimensions", list(spec.matryoshka_dimensions or ()))):
        wider = [d for d in values if d > spec.hidden_size]
        if wider:
            raise ConfigError(f"pooling.{field}: {wider} is more than the model's {spec.hidden_size} dimensions; "
                              f"give at most {spec.hidden_size}.")
