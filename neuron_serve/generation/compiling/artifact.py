"""``neuron-serve build`` of a task: generate model: its compiled models, buckets and tokenizer.

The artifact is a neuron-serve artifact (see neuron_serve.assembly.artifact) of every prefill and
decode model, sharing one state (the cache, saved empty), plus in its manifest the
buckets, vocabulary size and EOS ids the engine needs, and for a tensor-parallel model
its split (loaded again over a group of as many cores), and the tokenizer's files under
``tokenizer/``. A speculative draft model is an artifact of the same kind in ``draft/``,
which the artifact's model.yaml names as its ``speculative_config.model``. Loading compiles the models again for the core (through the compile
cache) without the transformers model or its Python code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...assembly import artifact
from ...buckets.generation import GenerationBuckets
from ...compile import sharding as spmd
from ...errors import ArtifactError
from ...model import CompiledModel
from ..runner.model import GenerationModel
from ..runner.shapes import shapes_of

TOKENIZER_DIR = "tokenizer"
DRAFT_DIR = "draft"
# The compiled families an artifact holds: 2 since every prefill samples on the core and each decode and
# verify bucket has a greedy and a sampled model (shapes.shapes_of). An artifact of another layout is refused.
FAMILIES = 2


def save_generation(model: GenerationModel, path: str | Path, *, eos_token_ids: list[int], tokenizer: Any = None,
                    config: dict | None = None, source: str | None = None) -> Path:
    """Write ``model`` to directory ``path``; ``config`` is the model.yaml that serves it from there."""
    model.reset()  # the cache is saved empty: slots hold nothing across a restart
    # The engine picks buckets itself, so the models are stored without the bucket kernel (Python code).
    stored = CompiledModel([model.bucket(shape) for shape in shapes_of(model.buckets)])
    extra = {"generation": {**model.buckets.describe(), "vocab_size": model.vocab_size,
                            "eos_token_ids": list(eos_token_ids), "tokenizer": tokenizer is not None,
                            "weight_bytes": model.weight_bytes, "families": FAMILIES,
                            "draft": DRAFT_DIR if model.draft is not None else None,
                            "precision": model.precision}}
    if model.sharding is not None:  # loaded again over a group of as many cores, split the same way
        plan = model.sharding
        extra["generation"]["sharding"] = {"devices": plan.devices, "state": plan.state,
                                           "weights": {name: list(spec) for name, spec in plan.weights.items()}}

    def add_files(root: Path) -> None:
        if tokenizer is not None:
            tokenizer.save_pretrained(str(root / TOKENIZER_DIR))
        if model.draft is not None:  # hashed with the rest: the outer manifest covers every file below it
            save_generation(model.draft, root / DRAFT_DIR, eos_token_ids=[], source=source)

    return artifact.save(stored, path, config=config, source=source, extra=extra, add_files=add_files)


def load_generation(path: str | Path) -> tuple[GenerationModel, list[int], str | None]:
    """The compiled models of an artifact written by :func:`save_generation`, its EOS ids and tokenizer folder."""
    root = Path(path)
    described = artifact.read_manifest(root).get("extra", {}).get("generation")
    if described is None:
        raise ArtifactError(f"artifact {root} holds a task: infer model; serve it with task: infer, or build the "
                            f"generate model.yaml again.")
    if described.get("families") != FAMILIES:
        raise ArtifactError(f"artifact {root} was built by an older neuron-serve, before its models chose tokens on "
                            f"the core; build it again (neuron-serve build) from its model.yaml.")
    split = described.get("sharding")
    plan = None
    if split is not None:  # one program over a group of cores: this process's cores must be that group
        plan = spmd.Sharding(split["devices"], {name: tuple(spec) for name, spec in split["weights"].items()},
                             tuple(split["state"]) if split["state"] is not None else None)
        spmd.start_spmd(plan.devices)
    with spmd.sharded(plan):
        compiled = artifact.load(root)
    buckets = GenerationBuckets(described["max_num_seqs"], described["max_model_len"], described["prefill_buckets"],
                                described["decode_batch_buckets"], described["decode_context_buckets"],
                                described.get("decode_steps", 1), described.get("enable_prefix_caching", False),
                                described.get("speculative_tokens", 0), described["on_device_sampling"],
                                described.get("prefill_chunk_buckets", []), described.get("prefill_batch_buckets", [1]))
    tokenizer = str(root / TOKENIZER_DIR) if described["tokenizer"] else None
    model = GenerationModel(compiled.buckets[0].state, buckets, described["vocab_size"], plan,
                            described.get("weight_bytes"), compiled=dict(zip(shapes_of(buckets), compiled.buckets)))
    model.precision = described.get("precision", {})
    if described.get("draft"):
        model.draft = load_generation(root / described["draft"])[0]
    return model, described["eos_token_ids"], tokenizer
