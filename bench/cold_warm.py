"""Cold versus warm start of the example deployments (the persistent compile cache), and how soon
a replica answers when it is ready on its first compiled models (model.yaml's background_compile).

Each start is a fresh Python process that builds the model as a replica does (capture, analyze,
partition, compile per bucket on the compile queue, load onto every core) and reports, from the
build's beginning: when the replica is ready (``ready``), when it gave its first correct answer
(a one-row request equal to eager PyTorch, ``first answer``) and when every compiled model had
joined it (``compiled``). Imports are timed apart, being the same in every start.

- background: ready on the largest shape bucket at the largest batch size, the rest compiled behind
  (the default); whole: ``background_compile: false``, ready once everything is compiled;
- cold: an empty compile cache; warm: the same cache again, as a second replica started beside
  the first, or one added by autoscaling, finds it (median of ``--runs``);
- artifact: ``neuron-serve build`` once, then a fresh process loads the artifact.

Beside the example deployments as they are, the MLP is also started with one compiled
batch size and with six (``mlp@1``, ``mlp@6``), so the table shows what each further
size costs at start-up: its compile, its load onto every core and its timing at load.

Usage: ``python bench/cold_warm.py [--models mlp encoder convnet mlp@1 mlp@6] [--runs 2] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from neuron_serve.buckets.order import expected_padding
from neuron_serve.config.schema import load_deployment

ROOT = Path(__file__).resolve().parents[1]

START = """
import asyncio, json, sys, time
started = time.perf_counter()
import torch
import torch.utils._pytree as pytree
from neuron_serve.config.factory import build_model
from neuron_serve.config.schema import load_deployment
from neuron_serve.assembly.from_config import StagedBuild
from neuron_serve.runtime.runner import ModelRunner
from neuron_serve.targets.pjrt import xla
xla()  # torch-xla and its PJRT client start the same way cold or warm
imported = time.perf_counter()
config, base = load_deployment(sys.argv[1])
request = [t[:1] for t in config.example_inputs()]  # one row
expected = None
if config.model.factory is not None:
    with torch.no_grad():
        expected = [t for t in pytree.tree_leaves(build_model(config, base)(*request)) if isinstance(t, torch.Tensor)]
began = time.perf_counter()
build = StagedBuild(config, base, background=sys.argv[2] == "background")
runners = []

def load(model):
    runners.append(ModelRunner(model, cores=config.cores_per_replica))
    return runners[0]

runner = build.start(load, lambda model: runners[0].grow(model))
ready = time.perf_counter()
[answer] = asyncio.run(runner.infer([request]))
answered = time.perf_counter()
if expected is not None:
    torch.testing.assert_close(list(answer), expected, atol=1e-3, rtol=1e-3)
build.finished.wait()
compiled = time.perf_counter()
import torch_xla.debug.metrics as met
compiles = met.metric_data("CompileTime") or (0, 0.0)
# Each compiled model's seconds (its compile and, in the background, its load onto the cores), by grid entry.
seconds = {}
if build.grid is not None:
    jobs = {job.label: job.seconds or 0.0 for job in build.compiles.jobs()}
    for entry in build.grid.order:
        label = build.grid.label(entry)
        seconds[f"{entry.bucket},{entry.batch}"] = jobs.get(label, 0.0) + jobs.get(f"load {label}", 0.0)
print(json.dumps({"import_s": imported - started, "ready_s": ready - began, "first_answer_s": answered - began,
                  "compiled_s": compiled - began, "xla_compile_s": compiles[1] / 1e9, "entry_s": seconds}))
"""


def waste_over_time(order: list[tuple[int, int]], entry_s: dict[tuple[int, int], float], shapes: list[list[int]],
                    max_rows: int) -> float:
    """The expected share of work wasted on padding (buckets/order.py's measure), averaged over the
    background compile's time when its models compile in ``order``, each taking its measured seconds."""
    compiled, weighted, total = {order[0]}, 0.0, 0.0
    for entry in order[1:]:
        weighted += expected_padding(compiled, shapes, max_rows) * entry_s[entry]
        total += entry_s[entry]
        compiled.add(entry)
    return weighted / total if total else 0.0



def _start(target: str, cache: Path, cores: int, mode: str = "background") -> dict:
    """One replica's start in a fresh process: ``mode`` "background" (ready on the first compiled
    models) or "whole" (ready once everything is compiled)."""
    env = {**os.environ, "NEURON_SERVE_CACHE_DIR": str(cache), "PJRT_DEVICE": "CPU",
           "CPU_NUM_DEVICES": str(cores), "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", START, target, mode], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(f"{target} ({mode}) failed to start:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


SIZE_VARIANTS = {"1": [32], "6": [1, 2, 4, 8, 16, 32]}


def _config(model: str, work: Path) -> Path:
    """The deployment file of ``model``; ``name@N`` is that deployment compiled at N batch sizes."""
    import yaml  # noqa: PLC0415

    name, _, variant = model.partition("@")
    config = ROOT / "deployments" / f"{name}.yaml"
    if not variant:
        return config
    if variant not in SIZE_VARIANTS:
        raise SystemExit(f"{model}: the batch-size variants are {', '.join('@' + v for v in SIZE_VARIANTS)}")
    doc = yaml.safe_load(config.read_text())
    doc["batch_sizes"] = SIZE_VARIANTS[variant]
    doc["batching"]["max_batch_size"] = max(SIZE_VARIANTS[variant])
    folder = work / f"deployments-{name}-{variant}"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "example_models").exists():  # factories resolve beside the deployment file
        (folder / "example_models").symlink_to(ROOT / "deployments" / "example_models")
    variant_config = folder / f"{name}.yaml"
    variant_config.write_text(yaml.safe_dump(doc))
    return variant_config


def _median(starts: list[dict], key: str) -> float:
    return statistics.median(start[key] for start in starts)


def measure(model: str, runs: int, work: Path) -> dict:
    """Cold and warm starts of ``model`` (a deployment name, or a model.yaml's path: the LLM example's
    place, once its engines build through the compile queue), ready on the first compiled models and
    after the whole compile, and a load of its artifact."""
    import yaml  # noqa: PLC0415

    config = Path(model) if model.endswith(".yaml") else _config(model, work)
    cores = yaml.safe_load(config.read_text()).get("cores_per_replica", 1)
    sizes = load_deployment(str(config))[0].compiled_batch_sizes() or "trace-time batch"
    row = {"model": model, "batch_sizes": sizes, "cores": cores}
    for mode in ("background", "whole"):
        cache = work / f"cache-{Path(model).stem}-{mode}"
        cold = _start(str(config), cache, cores, mode)
        if mode == "background":
            cold_background_entry_s = cold["entry_s"]
        warm = [_start(str(config), cache, cores, mode) for _ in range(runs)]
        for key in ("ready_s", "first_answer_s", "compiled_s", "xla_compile_s"):
            row[f"{mode}_cold_{key}"] = cold[key]
            row[f"{mode}_warm_{key}"] = _median(warm, key)
        row["import_s"] = cold["import_s"]
    artifact = work / f"artifact-{Path(model).stem}"
    subprocess.run([sys.executable, "-m", "neuron_serve.cli", "--cache-dir", str(work / f"cache-{Path(model).stem}-whole"),
                    "build", str(config), "-o", str(artifact)], cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "PYTHONWARNINGS": "ignore"})
    row["artifact_s"] = _start(str(artifact), work / f"cache-{Path(model).stem}-empty", cores, "whole")["first_answer_s"]
    # The figures the earlier table had: a whole build, cold and warm, and what XLA:CPU's compiles take of it.
    row["cold_s"], row["warm_s"] = row["whole_cold_ready_s"], row["whole_warm_ready_s"]
    row["warm_ratio"] = row["warm_s"] / row["cold_s"]
    row["warm_ratio_without_xla_compile"] = (row["warm_s"] - row["whole_warm_xla_compile_s"]) / row["cold_s"]
    row["first_answer_ratio"] = row["background_cold_first_answer_s"] / row["whole_cold_first_answer_s"]
    row.update(_orders(config, cold_background_entry_s))
    return row


def _orders(config: Path, entry_s: dict[str, float]) -> dict:
    """The time-averaged padding of the background compile in the order chosen (most padding saved
    first) and in the grid's own (bucket by bucket, smallest batch first), from measured seconds."""
    parsed = load_deployment(str(config))[0]
    shapes = parsed.buckets.sizes if parsed.buckets else [[1]]
    shapes = [[s] if isinstance(s, int) else list(s) for s in shapes]
    seconds = {tuple(int(n) for n in key.split(",")): value for key, value in entry_s.items()}
    if len(seconds) < 2:
        return {}
    chosen = list(seconds)  # the start's own order
    grid = [chosen[0]] + sorted(e for e in seconds if e != chosen[0])
    rows = max(e[1] for e in seconds)
    return {"waste_chosen_order": waste_over_time(chosen, seconds, shapes, rows),
            "waste_grid_order": waste_over_time(grid, seconds, shapes, rows), "order": [list(e) for e in chosen]}


def table(rows: list[dict]) -> str:
    lines = ["Seconds from the replica's build beginning (imports apart). First answer: a one-row request, "
             "equal to eager. Background: ready on the largest shape bucket at the largest batch size, the rest "
             "compiled behind (the default); whole: `background_compile: false`.",
             "",
             "| model | batch sizes | cores | cold: first answer, background (ready) | cold: first answer, whole | "
             "background / whole | cold: all compiled, background | warm: first answer, background | warm: first "
             "answer, whole | warm / cold (whole) | XLA:CPU compile in warm (whole) | artifact: first answer | "
             "imports |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch_sizes']} | {r['cores']} | {r['background_cold_first_answer_s']:.1f} "
            f"({r['background_cold_ready_s']:.1f}) | {r['whole_cold_first_answer_s']:.1f} | "
            f"{r['first_answer_ratio']:.2f} | {r['background_cold_compiled_s']:.1f} | "
            f"{r['background_warm_first_answer_s']:.1f} | {r['whole_warm_first_answer_s']:.1f} | "
            f"{r['warm_ratio']:.2f} | {r['whole_warm_xla_compile_s']:.1f} | {r['artifact_s']:.1f} | "
            f"{r['import_s']:.1f} |")
    ordered = [r for r in rows if "waste_chosen_order" in r]
    if ordered:
        lines += ["", "The order of the background compile: the expected share of work spent on padding while it "
                  "runs (rows uniform over 1..max_batch_size, each shape bucket alike; buckets/order.py), averaged "
                  "over its measured time, in the order chosen (most padding saved first) and in the grid's own "
                  "(bucket by bucket, smallest batch first), both after the same start-up model.", "",
                  "| model | order chosen (bucket, batch) | padding, order chosen | padding, grid order |",
                  "|---|---|---|---|"]
        for r in ordered:
            lines.append(f"| {r['model']} | {' '.join(f'({b + 1}, {n})' for b, n in r['order'])} | "
                         f"{r['waste_chosen_order']:.0%} | {r['waste_grid_order']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "encoder", "convnet", "mlp@1", "mlp@6"])
    parser.add_argument("--runs", type=int, default=2, help="warm starts per model (median reported)")
    parser.add_argument("--out", type=Path, help="also write the table (cold_warm.md) and JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="neuron-serve-bench-") as work:
        rows = [measure(m, args.runs, Path(work)) for m in args.models]
    text = table(rows)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cold_warm.md").write_text(text + "\n")
        (args.out / "cold_warm.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
