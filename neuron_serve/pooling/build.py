"""From a pooling model.yaml to a compiled model: one graph per sequence-length bucket and batch size.

The graph (source.py) is compiled as an infer model's grid (assembly/grid.py, one job on the
compile queue per compiled model): the bucket spec pads every input along its sequence
dimension to the smallest length bucket that holds it (token ids with the tokenizer's pad id,
the attention mask with zeros), each bucket is compiled at every batch size of
``batch_sizes`` (or the defaults of ``batching.max_batch_size``), and ``dynamic_batch`` lets
any number of rows run as the cheapest of them. A replica is ready on the first compiled
model and takes the others as they compile; it runs them with the same runtime (request
queue, cores round-robin).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ..buckets import usage as bucket_usage
from ..assembly.from_config import StagedBuild
from ..assembly.grid import Source
from ..assembly.queue import READY, compile_queue
from ..buckets.shape import BucketSpec
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


def grid_source(graph: torch.nn.Module, spec: PoolingSpec, config: ModelConfig,
                base_dir: str | Path | None = None) -> Source:
    """``graph`` as a grid: its length buckets (token ids padded with the tokenizer's pad id, the mask with zeros)
    at every compiled batch size of ``config``."""
    sizes = config.compiled_batch_sizes()
    buckets = BucketSpec.build(sizes=list(spec.length_buckets), inputs={i: 1 for i in range(len(spec.input_names))},
                               pad_values={0: spec.pad_token_id})
    # Operators the accelerator cannot run go to CPU subgraphs (the partitioner's defaults) unless model.yaml
    # sets the partitioner; the placement line of the build names them.
    return Source(module=graph, example=example_inputs(spec, max(sizes)), spec=buckets,
                  input_names=list(spec.input_names), output_names=[spec.output_name],
                  labels=[f"len {n}" for n in spec.length_buckets],
                  partitioner=config.partitioner_config(base_dir) or PartitionerConfig(),
                  weights=bucket_usage.shares(config.name, "length", spec.length_buckets, "input lengths"))


def staged(config: ModelConfig, base_dir: str | Path | None = None, *,
           background: bool | None = None) -> tuple[StagedBuild, PoolingSpec, Any]:
    """The pooling model of ``config`` loaded and its grid ready to compile, as an infer model's: a replica is ready
    on the longest length bucket at the largest batch size (any input fits it) and compiles the rest behind
    (model.yaml's ``background_compile``). (build, spec without its hidden size, tokenizer)."""
    graph, spec, tokenizer = source.load(config, base_dir)
    return StagedBuild(config, base_dir, background=background,
                       source=grid_source(graph, spec, config, base_dir)), spec, tokenizer


def described(compiled: CompiledModel, spec: PoolingSpec) -> PoolingSpec:
    """``spec`` with the hidden size of the embeddings ``compiled`` makes, checked against model.yaml's dimensions."""
    spec = spec.with_hidden_size(int(compiled.signature().outputs[0].shape[-1]))
    check_dimensions(spec)
    return spec


def build(config: ModelConfig, base_dir: str | Path | None = None) -> tuple[CompiledModel, PoolingSpec, Any]:
    """Load and compile the pooling model of ``config``, every length bucket and batch size of it:
    (compiled model, spec, tokenizer). The compiles run on the process's compile queue."""
    job = compile_queue().submit(f"load {config.name} (pooling model)", lambda: staged(config, base_dir,
                                                                                        background=False),
                                 priority=READY, kind="load")
    build_, spec, tokenizer = job.future.result()
    compiled = build_.start()
    spec = described(compiled, spec)
    logger.info("model %s: task %s, lengths %s", config.name, spec.task, list(spec.length_buckets))
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
