"""Cold versus warm start of the example deployments (the persistent compile cache).

Each start is a fresh Python process that builds the model as a replica does
(``ModelRunner``: capture, analyze, partition, compile per bucket, load onto every
core) and reports the build time; imports are timed apart, being the same in both.

- cold: an empty compile cache;
- warm: the same cache, second and third start (the median is reported);
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

from neuron_serve.config.schema import load_deployment

ROOT = Path(__file__).resolve().parents[1]

START = """
import json, sys, time
started = time.perf_counter()
from neuron_serve.config.schema import load_deployment
from neuron_serve.build.from_config import build
from neuron_serve.runtime.runner import ModelRunner
from neuron_serve.targets.pjrt import xla
xla()  # torch-xla and its PJRT client start the same way cold or warm
imported = time.perf_counter()
config, base = load_deployment(sys.argv[1])
built = time.perf_counter()
runner = ModelRunner(build(config, base), cores=config.cores_per_replica)
import torch_xla.debug.metrics as met
compiles = met.metric_data("CompileTime") or (0, 0.0)
print(json.dumps({"import_s": imported - started, "build_s": time.perf_counter() - built, "xla_compile_s": compiles[1] / 1e9}))
"""


def _start(target: str, cache: Path, cores: int) -> dict:
    env = {**os.environ, "NEURON_SERVE_CACHE_DIR": str(cache), "PJRT_DEVICE": "CPU",
           "CPU_NUM_DEVICES": str(cores), "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", START, target], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True)
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


def measure(model: str, runs: int, work: Path) -> dict:
    import yaml  # noqa: PLC0415

    config = _config(model, work)
    cores = yaml.safe_load(config.read_text()).get("cores_per_replica", 1)
    cache = work / f"cache-{model}"
    sizes = load_deployment(str(config))[0].compiled_batch_sizes() or "trace-time batch"
    cold = _start(str(config), cache, cores)
    warm = [_start(str(config), cache, cores) for _ in range(runs)]
    artifact = work / f"artifact-{model}"
    subprocess.run([sys.executable, "-m", "neuron_serve.cli", "--cache-dir", str(cache), "build", str(config),
                    "-o", str(artifact)], cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "PYTHONWARNINGS": "ignore"})
    loaded = _start(str(artifact), work / f"cache-{model}-empty", cores)
    warm_s = statistics.median(w["build_s"] for w in warm)
    warm_xla = statistics.median(w["xla_compile_s"] for w in warm)
    return {"model": model, "batch_sizes": sizes, "cores": cores, "import_s": cold["import_s"], "cold_s": cold["build_s"],
            "warm_s": warm_s, "warm_ratio": warm_s / cold["build_s"], "cold_xla_compile_s": cold["xla_compile_s"],
            "warm_xla_compile_s": warm_xla, "warm_ratio_without_xla_compile": (warm_s - warm_xla) / cold["build_s"], "artifact_s": loaded["build_s"],
            "artifact_ratio": loaded["build_s"] / cold["build_s"]}


def table(rows: list[dict]) -> str:
    lines = ["| model | batch sizes | cores | cold build (s) | warm build (s) | warm / cold | XLA:CPU compile in warm (s) "
             "| warm without it / cold | artifact load (s) | artifact / cold | imports (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch_sizes']} | {r['cores']} | {r['cold_s']:.2f} | {r['warm_s']:.2f} | {r['warm_ratio']:.2f} "
                     f"| {r['warm_xla_compile_s']:.2f} | {r['warm_ratio_without_xla_compile']:.2f} "
                     f"| {r['artifact_s']:.2f} | {r['artifact_ratio']:.2f} | {r['import_s']:.2f} |")
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
