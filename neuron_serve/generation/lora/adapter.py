"""LoRA adapters: a PEFT adapter directory read, checked against its base model, and laid out for the core.

An adapter is what PEFT's ``save_pretrained`` writes: ``adapter_config.json`` (a LoraConfig) and
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` (r, in) and ``lora_B.weight``
(out, r) for each targeted module). Which modules it targets is decided as PEFT decides it
(``target_modules`` as names or a regular expression, ``exclude_modules``, ``layers_to_transform``,
``layers_pattern``), so the delta served is the one PEFT's own model computes. Every projection's
delta is laid out for the buffers on the core: ``x @ a @ b`` with ``a`` (in, R) and ``b`` (R, out),
the scaling folded into ``b`` and R = max_lora_rank (a smaller rank is zero-padded, which adds nothing).

Imported by the engine process only (torch, safetensors); the replica's front end never reads an
adapter. The config is read as JSON rather than through ``peft`` (which would bring accelerate into
every engine): its fields are LoraConfig's, with LoraConfig's defaults. The weights are read with
safetensors' own loader; a pickled ``adapter_model.bin`` is refused, never unpickled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers.pytorch_utils import Conv1D

from ...config.generation import DEFAULT_MAX_LORA_RANK, LORA_RANKS
from ...errors import AdapterError
from .config import ADAPTER_CONFIG, AdapterConfig, read_config
from ..precision.quantization import QuantizedLinear

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_WEIGHTS = "adapter_model.bin"
RANK_FIELD = "generation.lora.max_lora_rank"

# The attention and MLP projections an adapter may target, by the names the served architectures give
# them. Any other module a target reaches (embeddings, the LM head, norms, routers) is refused by name.
PROJECTIONS = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",  # Llama, Mistral, Qwen2, Qwen3
    "c_attn", "c_proj", "c_fc",  # GPT-2: Conv1D, whose weight is stored (in, out)
    "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",  # GPT-NeoX
    "fc1", "fc2",  # Phi (q/k/v_proj, and dense as its attention's output)
})
# A module inside a decoder layer: the first numbered segment of its name is the layer (as PEFT reads it).
_IN_LAYER = re.compile(r"^.*?\.(?P<layer>\d+)\.(?P<name>.+)$")
_WEIGHT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


@dataclass(frozen=True)
class Projection:
    """One linear projection of the base model an adapter may target (the core holds a buffer for each)."""

    module: str  # its name in the causal LM, e.g. model.layers.0.self_attn.q_proj
    layer: int
    name: str  # its name within the layer, e.g. self_attn.q_proj (GPT-2 has attn.c_proj and mlp.c_proj)
    in_features: int
    out_features: int
    dtype: torch.dtype
    # How its base linear is split over a tensor-parallel group: colwise splits the output features (so B's
    # columns), rowwise the input features (so A's rows); None keeps it whole on every core.
    split: Literal["colwise", "rowwise"] | None = None


@dataclass(frozen=True)
class LoraBase:
    """What adapters are checked against and laid out for: the base model's projections, split over its cores."""

    architecture: str
    projections: tuple[Projection, ...]
    modules: Mapping[str, str]  # every module of the model -> its class name: what a target may reach
    embeddings: frozenset[str]  # embeddings and the LM head: never targets
    tensor_parallel_size: int = 1

    @classmethod
    def of(cls, lm: torch.nn.Module, tensor_parallel_size: int = 1) -> "LoraBase":
        """``lm`` (a transformers causal LM) described, its projections split as its weights are over
        ``tensor_parallel_size`` cores (transformers' tp plan, as neuron_serve.generation.runner.tensor_parallel)."""
        splits = _splits(lm, tensor_parallel_size)
        heads = {id(m) for m in (lm.get_input_embeddings(), lm.get_output_embeddings()) if m is not None}
        projections, modules, embeddings = [], {}, set()
        for module_name, module in lm.named_modules():
            if not module_name:
                continue
            modules[module_name] = type(module).__name__
            if id(module) in heads or isinstance(module, torch.nn.Embedding):
                embeddings.add(module_name)
                continue
            place = _IN_LAYER.match(module_name)
            if place is None or module_name.rpartition(".")[2] not in PROJECTIONS:
                continue
            if isinstance(module, (torch.nn.Linear, QuantizedLinear)):
                features = module.in_features, module.out_features
            elif isinstance(module, Conv1D):
                features = module.weight.shape[0], module.weight.shape[1]
            else:
                continue
            projections.append(Projection(module_name, int(place["layer"]), place["name"], *features,
                                          getattr(module, "compute_dtype", module.weight.dtype),
                                          splits.get(module_name)))
        return cls(type(lm).__name__, tuple(projections), modules, frozenset(embeddings), tensor_parallel_size)

    def projection(self, module: str) -> Projection | None:
        """The projection named ``module`` (its name in the causal LM), if it is one."""
        return self._by_module.get(module)

    @cached_property
    def _by_module(self) -> dict[str, Projection]:
        return {p.module: p for p in self.projections}

    def projection_names(self) -> list[str]:
        """The projections' own names (q_proj, ...), sorted: what an adapter may target."""
        return sorted({p.module.rpartition(".")[2] for p in self.projections})


def _splits(lm: torch.nn.Module, size: int) -> dict[str, str]:
    if size == 1:
        return {}
    from ..runner import tensor_parallel  # noqa: PLC0415 (with the compiler's sharding types: only for a split)

    tensor_parallel.check(lm.config, size)
    styles = {tensor_parallel.COLUMN: "colwise", tensor_parallel.ROW: "rowwise"}
    plan = tensor_parallel.plan(lm, size).weights
    return {name[len("lm."):-len(".weight")]: styles[spec] for name, spec in plan.items()
            if name.endswith(".weight") and spec in styles}


@dataclass(frozen=True)
class LoraWeights:
    """One projection's delta: ``x @ a @ b`` added to its output."""

    projection: Projection
    a: torch.Tensor  # (in_features, R): A transposed, zero-padded past the adapter's rank
    b: torch.Tensor  # (R, out_features): B transposed times the scaling, zero-padded past the rank


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter read and checked, laid out for the core's buffers (each tensor in its projection's dtype)."""

    name: str
    path: str
    rank: int  # r (the largest, with a rank_pattern)
    alpha: float  # lora_alpha
    use_rslora: bool  # scaling alpha / sqrt(r) instead of alpha / r
    max_lora_rank: int  # R: every a and b is padded to it
    target_modules: tuple[str, ...]  # the targeted projections' names within their layer, sorted
    weights: Mapping[tuple[int, str], LoraWeights]  # (layer, name within the layer) -> its delta
    nbytes: int  # bytes of every a and b held


def read_adapter(name: str, path: str | Path, base: LoraBase | torch.nn.Module, *,
                 max_lora_rank: int = DEFAULT_MAX_LORA_RANK) -> LoraAdapter:
    """Read the PEFT adapter directory ``path`` as adapter ``name`` for ``base`` (a LoraBase, or the causal LM).

    Raises AdapterError naming the file (adapter_config.json or adapter_model.safetensors), the module and
    the fix: unreadable files, options that change the math (DoRA, modules_to_save, biases, ...), a rank
    over ``max_lora_rank``, targets the model lacks or cannot serve, weights of other shapes."""
    if not isinstance(base, LoraBase):
        base = LoraBase.of(base)
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"{directory}: not a directory; give a PEFT adapter directory ({ADAPTER_CONFIG} and "
                           f"{ADAPTER_WEIGHTS}, as save_pretrained writes them).")
    config = read_config(directory / ADAPTER_CONFIG)
    _check_rank(config, max_lora_rank)
    targeted = _targets(config, base)
    tensors = _read_weights(directory)
    weights = {}
    for module, (a, b) in _pair(tensors, targeted, base, directory / ADAPTER_WEIGHTS).items():
        projection = base.projection(module)
        weights[projection.layer, projection.name] = _lay_out(a, b, projection, config, max_lora_rank,
                                                              directory / ADAPTER_WEIGHTS)
    return LoraAdapter(name, str(directory), config.max_rank, config.alpha, config.use_rslora, max_lora_rank,
                       tuple(sorted({key[1] for key in weights})), weights,
                       sum(w.a.nbytes + w.b.nbytes for w in weights.values()))


def _check_rank(config: AdapterConfig, max_lora_rank: int) -> None:
    rank = config.max_rank
    if rank <= max_lora_rank:
        return
    given = f"r is {rank}" if rank == config.r else f"rank_pattern gives a module rank {rank}"
    reachable = [r for r in LORA_RANKS if r >= rank]
    fix = (f"set {RANK_FIELD} to {reachable[0]}" if reachable else
           f"no {RANK_FIELD} reaches it (at most {LORA_RANKS[-1]})")
    raise AdapterError(f"{config.file}: {given}, more than {RANK_FIELD} ({max_lora_rank}); {fix}, or serve an "
                       f"adapter of rank at most {max_lora_rank}.")


def _targets(config: AdapterConfig, base: LoraBase) -> set[str]:
    """The modules PEFT would give this adapter on ``base``; refuses any it cannot serve, and targets that
    reach nothing (an adapter of another base model)."""
    targeted = {module for module, kind in base.modules.items()
                if config.targets(module, kind, head=module in base.embeddings)}
    projections = ", ".join(base.projection_names())
    unmatched = config.unmatched(base.modules)
    if unmatched:
        raise AdapterError(f"{config.file}: target_modules names {unmatched[0]}, which the model ({base.architecture}) "
                           f"has no module of; the adapter is of another base model (this one's projections: "
                           f"{projections}).")
    if not targeted:
        raise AdapterError(f"{config.file}: target_modules {config.shown_targets()} reach no module of the model "
                           f"({base.architecture}); the adapter is of another base model (this one's projections: "
                           f"{projections}).")
    for module in sorted(targeted):
        if module in base.embeddings:
            raise AdapterError(f"{config.file}: target_modules reach {module} ({base.modules[module]}): embedding and "
                               f"LM head targets are not served; train the adapter on the attention and MLP "
                               f"projections ({projections}).")
        if base.projection(module) is None:
            raise AdapterError(f"{config.file}: target_modules reach {module} ({base.modules[module]}), which is not "
                               f"an attention or MLP projection; train the adapter on those ({projections}).")
    return targeted


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    file = directory / ADAPTER_WEIGHTS
    if not file.is_file():
        if (directory / PICKLED_WEIGHTS).is_file():
            raise AdapterError(f"{directory / PICKLED_WEIGHTS}: the adapter's weights are pickled, and neuron-serve "
                               f"does not unpickle; save the adapter with save_pretrained(..., "
                               f"safe_serialization=True) (the default), which writes {ADAPTER_WEIGHTS}.")
        raise AdapterError(f"{file}: no such file; a PEFT adapter directory holds its weights there (save the "
                           f"adapter with save_pretrained).")
    try:
        return load_file(file)
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{file}: not a safetensors file ({exc}); save the adapter again with "
                           f"save_pretrained.") from None


def _pair(tensors: dict[str, torch.Tensor], targeted: set[str], base: LoraBase, file: Path) -> dict[str, tuple]:
    """module -> (lora_A, lora_B), every targeted module once; any other tensor refused."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(tensors):
        match = _WEIGHT_KEY.match(key)
        if match is None:
            raise AdapterError(f"{file}: {key} is not a LoRA weight (base_model.model.<module>.lora_A.weight or "
                               f"lora_B.weight); serve a plain LoRA adapter, as PEFT's save_pretrained writes it.")
        found.setdefault(match["module"], {})[match["part"]] = tensors[key]
    for module in sorted(found):
        if module not in targeted:
            if module not in base.modules:
                raise AdapterError(f"{file}: {module}: the model ({base.architecture}) has no such module; the "
                                   f"adapter is of another base model: serve it on the model it was trained for.")
            raise AdapterError(f"{file}: {module}: {ADAPTER_CONFIG}'s target_modules do not reach it, so the two "
                               f"files are of different adapters; save the adapter again with save_pretrained.")
    for module in sorted(targeted):
        parts = found.get(module, {})
        for part in "AB":
            if part not in parts:
                raise AdapterError(f"{file}: {module}: lora_{part}.weight is missing, though {ADAPTER_CONFIG}'s "
                                   f"target_modules reach it; save the adapter again with save_pretrained.")
    return {module: (found[module]["A"], found[module]["B"]) for module in sorted(targeted)}


def _lay_out(a: torch.Tensor, b: torch.Tensor, projection: Projection, config: AdapterConfig, max_lora_rank: int,
             file: Path) -> LoraWeights:
    """A (r, in) and B (out, r) checked against ``projection`` and padded to (in, R) and (R, out), scaled."""
    rank, alpha = config.rank_of(projection.module), config.alpha_of(projection.module)
    want = {"A": (rank, projection.in_features), "B": (projection.out_features, rank)}
    for part, tensor in (("A", a), ("B", b)):
        shape = tuple(tensor.shape)
        if shape == want[part]:
            continue
        rank_dim = 0 if part == "A" else 1
        if len(shape) == 2 and shape[rank_dim] != rank:
            raise AdapterError(f"{file}: {projection.module}: lora_{part} is {shape}, of rank {shape[rank_dim]}, "
                               f"but {ADAPTER_CONFIG} gives the module rank {rank}; "
                               f"the two files are of different adapters: save the adapter again with "
                               f"save_pretrained.")
        features = (f"takes {projection.in_features} input features" if part == "A" else
                    f"gives {projection.out_features} output features")
        raise AdapterError(f"{file}: {projection.module}: lora_{part} is {shape}, but the model's "
                           f"{projection.name.rpartition('.')[2]} {features} (lora_{part} would be {want[part]}); "
                           f"the adapter is of another base model: serve it on the model it was trained for.")
    scaling = alpha / rank ** 0.5 if config.use_rslora else alpha / rank
    padded_a = torch.zeros(projection.in_features, max_lora_rank, dtype=projection.dtype)
    padded_b = torch.zeros(max_lora_rank, projection.out_features, dtype=projection.dtype)
    padded_a[:, :rank] = a.to(torch.float32).T.to(projection.dtype)
    padded_b[:rank] = (b.to(torch.float32).T * scaling).to(projection.dtype)
    return LoraWeights(projection, padded_a, padded_b)


def buffer_bytes(base: LoraBase | torch.nn.Module, max_loras: int, max_lora_rank: int) -> int:
    """Bytes of the buffers for ``max_loras`` adapters at ``max_lora_rank`` on each core of ``base``'s group.

    Every projection holds an (in, R) and an (R, out) buffer per adapter in its dtype; over a tensor-parallel
    group each is split as its base linear is (see :class:`Projection`), the other kept whole."""
    if not isinstance(base, LoraBase):
        base = LoraBase.of(base)
    cores, total = base.tensor_parallel_size, 0
    for p in base.projections:
        rows = -(-p.in_features // cores) if p.split == "rowwise" else p.in_features
        columns = -(-p.out_features // cores) if p.split == "colwise" else p.out_features
        total += (rows + columns) * max_lora_rank * p.dtype.itemsize
    return total * max_loras
