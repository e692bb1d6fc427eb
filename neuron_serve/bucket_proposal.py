"""``neuron-serve buckets MODEL.yaml``: the padding a model's buckets cost on the sizes its replicas recorded, and
the bucket lists that would cost least, as a model.yaml fragment to paste.

The sizes come from the compile cache (generation/bucket_usage.py: every replica of the model writes its own) or from a
file (``--sizes``: ``{family: {size: requests}}``, or a replica's file). Each family keeps its largest bucket (every
request must still fit) and, unless ``--max-models`` says otherwise, as many buckets as today: the same number of
compiled models, spent where the traffic is (buckets/traffic.py's propose). Work is counted in the family's units
(tokens, rows); padded work over real work is 1.0 when nothing is padded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..buckets import traffic
from ..buckets.traffic import Sizes

# family -> (model.yaml field under generation, unit, GenerationBuckets attribute)
GENERATE_FAMILIES = {
    "prefill": ("prefill_buckets", "tokens", "prefill"),
    "decode_rows": ("decode_batch_buckets", "rows", "decode_rows"),
    "chunk": ("prefill_chunk_buckets", "tokens", "chunks"),
}


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
                          f"{', '.join(GENERATE_FAMILIES)}.") from exc


def generation_buckets(config: Any, base_dir: str | Path | None) -> Any:
    """The model's compiled generation buckets (the model's own config read only when max_model_len is not set)."""
    from ..config.generation import GenerationSettings  # noqa: PLC0415

    settings = config.generation or GenerationSettings()
    if settings.max_model_len is not None:
        return settings.to_buckets(None)
    from .loading import load_lm  # noqa: PLC0415 - max_model_len defaults from the model's config

    return settings.to_buckets(load_lm(config, base_dir).config)


def propose(config: Any, base_dir: str | Path | None, sizes: Sizes, max_models: int | None = None) -> dict:
    """Per family with buckets and recorded sizes: today's buckets and padding, the proposed ones and theirs."""
    if config.task != "generate":
        raise ConfigError(f"task: neuron-serve buckets proposes a task: generate model's buckets (its replicas record "
                          f"their prompt lengths and decode rows); {config.name} is task: {config.task}.")
    if max_models is not None and max_models < 1:
        raise ConfigError(f"--max-models: a family needs at least one bucket; got {max_models}.")
    buckets = generation_buckets(config, base_dir)
    families = {}
    for family, (field, unit, attribute) in GENERATE_FAMILIES.items():
        today = sorted(getattr(buckets, attribute))
        counts = sizes.of(family)
        if not today or not counts:
            continue
        proposed = traffic.propose(counts, max_models or len(today), today[-1])
        families[family] = {
            "field": f"generation.{field}", "unit": unit, "calls": sum(counts.values()),
            "today": today, "padding_today": traffic.padding(counts, today),
            "proposed": proposed, "padding_proposed": traffic.padding(counts, proposed),
            "per_bucket_today": traffic.per_bucket(counts, today),
        }
    return families


def report(name: str, families: dict, source: str) -> str:
    """What a person reads: each family's padding today and proposed, then the fragment to paste."""
    lines = [f"{name}: sizes from {source}"]
    for family, entry in families.items():
        lines.append(f"{family} ({entry['field']}, {entry['unit']}; {entry['calls']} calls):")
        lines.append(f"  today    {entry['today']}: padded work {entry['padding_today']:.2f}x the real")
        for bucket, use in entry["per_bucket_today"].items():
            if use["requests"]:
                lines.append(f"    {bucket:>6}: {use['requests']} calls, {use['real']} real, {use['padded']} padded")
        lines.append(f"  proposed {entry['proposed']}: padded work {entry['padding_proposed']:.2f}x the real")
    lines += ["", "model.yaml:", "generation:"]
    lines += [f"  {entry['field'].split('.', 1)[1]}: {entry['proposed']}" for entry in families.values()]
    return "\n".join(lines)
