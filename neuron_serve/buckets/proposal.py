"""``neuron-serve buckets MODEL.yaml``: the padding a model's buckets cost on the sizes its replicas recorded, and
the bucket lists that would cost least, as a model.yaml fragment to paste. A generate model's prefill lengths,
decode rows and prompt chunks; a pooling model's (task: embed, score, classify) input lengths; a task: infer
model's sizes along its one bucketed dim (``shape``: buckets.sizes) and its chunks' rows (``rows``: batch_sizes).

The sizes come from the compile cache (buckets/usage.py: every replica of the model writes its own) or from a
file (``--sizes``: ``{family: {size: requests}}``, or a replica's file). Each family keeps its largest bucket (every
request must still fit) and, unless ``--max-models`` says otherwise, as many buckets as today: the same number of
compiled models, spent where the traffic is (buckets/traffic.py's propose). Work is counted in the family's units
(tokens, rows); padded work over real work is 1.0 when nothing is padded. A family with fewer calls recorded than
``--min-calls`` (default :data:`MIN_CALLS`) is not proposed for: the report says how many there are instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import traffic, usage
from .traffic import Sizes

# family -> (model.yaml field under generation, unit, GenerationBuckets attribute)
GENERATE_FAMILIES = {
    "prefill": ("prefill_buckets", "tokens", "prefill"),
    "decode_rows": ("decode_batch_buckets", "rows", "decode_rows"),
    "decode_context": ("decode_context_buckets", "positions", "decode_context"),
    "chunk": ("prefill_chunk_buckets", "tokens", "chunks"),
}
POOLING_FAMILIES = {"length": ("length_buckets", "tokens")}  # family -> (field under pooling, unit)
POOLING_TASKS = ("embed", "score", "classify")
MIN_CALLS = 100  # `neuron-serve buckets`' default: fewer calls of a family tell too little of its traffic


def read_sizes(path: str | Path) -> Sizes:
    """A sizes file: ``{family: {size: requests}}``, or a replica's (``{"sizes": ...}``)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--sizes: cannot read {path}: {exc}") from exc
    data = data.get("sizes", data) if isinstance(data, dict) else data
    try:
        return Sizes.from_dict(data)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"--sizes: {path} is not {{family: {{size: requests}}}} ({exc}); families: "
                          f"{', '.join([*GENERATE_FAMILIES, *POOLING_FAMILIES])}.") from exc


def generation_buckets(config: Any, base_dir: str | Path | None) -> Any:
    """The model's compiled generation buckets, ``auto`` lists as a replica starting now learns them (the model's
    own config read only when max_model_len is not set)."""
    from ..config.generation import GenerationSettings  # noqa: PLC0415
    from ..generation.compiling.build import learned  # noqa: PLC0415

    settings = config.generation or GenerationSettings()
    model_config = None
    if settings.max_model_len is None:
        from ..generation.compiling.loading import load_lm  # noqa: PLC0415 - max_model_len defaults from the model's config

        model_config = load_lm(config, base_dir).config
    return learned(settings, config.name, settings.to_buckets(model_config)).to_buckets(model_config)


def pooling_buckets(config: Any, base_dir: str | Path | None) -> list[int]:
    """A pooling model's compiled length buckets: model.yaml's, else the defaults from its directory."""
    if config.pooling is not None and config.pooling.length_buckets not in (None, "auto"):
        return list(config.pooling.length_buckets)
    from ..pooling import source  # noqa: PLC0415 - max_model_len defaults from the model's directory

    return list(source.load(config, base_dir)[1].length_buckets)


def infer_families(config: Any) -> dict[str, tuple[str, str, list[int]]]:
    """A task: infer model's families: its shape buckets when they bucket one dim (``shape``: a request's size
    along it), its compiled batch sizes with dynamic_batch (``rows``: a chunk's real rows)."""
    families = {}
    if config.buckets is not None:
        sizes = [size if isinstance(size, int) else size[0] for size in config.buckets.sizes
                 if isinstance(size, int) or len(size) == 1]
        if len(sizes) == len(config.buckets.sizes):
            families["shape"] = ("buckets.sizes", "positions", sorted(sizes))
    if (batch_sizes := config.compiled_batch_sizes()) is not None:
        families["rows"] = ("batch_sizes", "rows", sorted(batch_sizes))
    return families


def today(config: Any, base_dir: str | Path | None) -> dict[str, tuple[str, str, list[int]]]:
    """Each family of the model's compiled shapes: (its model.yaml field, its unit, its buckets today)."""
    if config.task == "generate":
        buckets = generation_buckets(config, base_dir)
        return {family: (f"generation.{field}", unit, sorted(getattr(buckets, attribute)))
                for family, (field, unit, attribute) in GENERATE_FAMILIES.items()}
    if config.task in POOLING_TASKS:
        (family, (field, unit)), = POOLING_FAMILIES.items()
        return {family: (f"pooling.{field}", unit, pooling_buckets(config, base_dir))}
    if families := infer_families(usage.learned_batch_sizes(config)):
        return families
    raise ConfigError(f"buckets: {config.name} compiles one shape at one batch size: nothing to propose. neuron-serve "
                      f"buckets proposes a task: infer model's shape buckets when they bucket one dim (buckets.sizes) "
                      f"and its batch sizes (dynamic_batch: true)")


def propose(config: Any, base_dir: str | Path | None, sizes: Sizes, max_models: int | None = None,
            min_calls: int = 1) -> dict:
    """Per family with buckets and recorded sizes: today's buckets and padding, the proposed ones and theirs. A
    family with fewer than ``min_calls`` calls recorded gets no proposal (``proposed`` None): too little traffic to
    tell its buckets by."""
    if max_models is not None and max_models < 1:
        raise ConfigError(f"--max-models: a family needs at least one bucket; got {max_models}.")
    if min_calls < 1:
        raise ConfigError(f"--min-calls: a proposal needs at least one call; got {min_calls}.")
    families = {}
    for family, (field, unit, buckets) in today(config, base_dir).items():
        counts = sizes.of(family)
        if not buckets or not counts:
            continue
        calls = sum(counts.values())
        proposed = traffic.propose(counts, max_models or len(buckets), buckets[-1]) if calls >= min_calls else None
        families[family] = {
            "field": field, "unit": unit, "calls": calls, "min_calls": min_calls,
            "today": buckets, "padding_today": traffic.padding(counts, buckets),
            "proposed": proposed, "padding_proposed": traffic.padding(counts, proposed) if proposed else None,
            "per_bucket_today": traffic.per_bucket(counts, buckets),
        }
    return families


def from_cache(config: Any, base_dir: str | Path | None) -> dict:
    """:func:`propose` on the sizes every replica of ``config``'s model kept in the compile cache; {} when the cache
    is off, holds none, or the model has nothing to propose (one shape at one batch size)."""
    from ..compile import cache as compile_cache  # noqa: PLC0415 - the cache module imports torch-xla's pieces

    store = compile_cache.current()
    if store is None:
        return {}
    try:
        return propose(config, base_dir, usage.recorded(store.root, config.name))
    except ConfigError:
        return {}


def report(name: str, families: dict, source: str) -> str:
    """What a person reads: each family's padding today and proposed, then the fragment to paste."""
    lines = [f"{name}: sizes from {source}"]
    for family, entry in families.items():
        lines.append(f"{family} ({entry['field']}, {entry['unit']}; {entry['calls']} calls):")
        lines.append(f"  today    {entry['today']}: padded work {entry['padding_today']:.2f}x the real")
        for bucket, use in entry["per_bucket_today"].items():
            if use["requests"]:
                lines.append(f"    {bucket:>6}: {use['requests']} calls, {use['real']} real, {use['padded']} padded")
        if entry["proposed"] is None:
            lines.append(f"  too little traffic to propose from: {entry['calls']} calls recorded, at least "
                         f"{entry['min_calls']} wanted (--min-calls N)")
        else:
            lines.append(f"  proposed {entry['proposed']}: padded work {entry['padding_proposed']:.2f}x the real")
    proposed = {family: entry for family, entry in families.items() if entry["proposed"] is not None}
    if not proposed:
        return "\n".join([*lines, "", "model.yaml: nothing to change until more traffic is recorded"])
    lines += ["", "model.yaml:"]
    sections: dict[str, list[str]] = {}
    for entry in proposed.values():
        if "." not in entry["field"]:  # a top-level field (an infer model's batch_sizes)
            lines.append(f"{entry['field']}: {entry['proposed']}")
            continue
        section, field = entry["field"].split(".", 1)
        sections.setdefault(section, []).append(f"  {field}: {entry['proposed']}")
    for section, fields in sections.items():
        lines += [f"{section}:", *fields]
    return "\n".join(lines)
