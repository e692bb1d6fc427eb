"""Tensor parallelism benchmark: one Llama of about 110M parameters at TP 1, TP 2 and DP 2.

    python -m bench.tensor_parallel [--quick] [--out DIR]    # also a part of python -m bench

The model (hidden 1024, 8 layers, 16 heads of which 8 key/value, MLP 2816, vocabulary
8192; random weights, built here) runs in three layouts, each in a fresh process of its
own (SPMD is a mode of the whole process), one after another, emulated cores computing
on one XLA:CPU thread each as the engine process runs them:

- ``tp1``: one engine on one core;
- ``tp2``: one engine over two cores, the model split by its tensor-parallel plan;
- ``dp2``: two engines, a whole copy of the model on each of two cores.

Figures: start-up (compiling every bucket, and for DP 2 the copy onto the second core),
a lone greedy request's time per output token (64 prompt tokens, 64 new, median gap),
and output tokens/s of 32 concurrent greedy requests (64 prompt tokens, 64 new each;
``--quick``: 16). Ratios: TP 2's lone TPOT over TP 1's (target at most 0.65), TP 2's
tokens/s over DP 2's at 32 streams, TP 2's start-up over TP 1's. Writes
tensor_parallel.md (printed too) and tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 2), "dp2": (2, 1)}  # name -> (cores, tensor_parallel_size)
PROMPT, NEW = 64, 64
MAX_MODEL_LEN = 256
TPOT_TARGET = 0.65


def build_lm():
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=MAX_MODEL_LEN,
                         attn_implementation="eager")
    lm = LlamaForCausalLM(config).eval()
    lm.generation_config.eos_token_id = None
    return lm


def _run(engine, prompts: list[list[int]]) -> tuple[float, list[float]]:
    """Submit every prompt at once; (wall seconds, every gap between two tokens of a request)."""
    from neuron_serve.generation import SamplingParams  # noqa: PLC0415

    times: list[list[float]] = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def sink_for(i: int):
        def sink(event) -> None:
            if event.token is not None:
                times[i].append(time.perf_counter())
            if event.finished:
                done.release()
        return sink

    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True), sink_for(i))
    for _ in prompts:
        done.acquire()
    return time.perf_counter() - started, [b - a for ts in times for a, b in zip(ts, ts[1:])]


def measure(layout: str, streams: int, repeats: int) -> dict:
    """One layout, in this process (started by :func:`main` with the layout's cores)."""
    import random  # noqa: PLC0415

    from neuron_serve.generation import engine_for  # noqa: PLC0415
    from neuron_serve.buckets.generation import GenerationBuckets  # noqa: PLC0415
    from neuron_serve.generation.core.group import EngineGroup  # noqa: PLC0415
    from neuron_serve.generation.compiling.compile import compile_generation  # noqa: PLC0415
    from neuron_serve.targets.pjrt import start_emulated_cores_on_threads  # noqa: PLC0415

    cores, tp = LAYOUTS[layout]
    start_emulated_cores_on_threads(cores)
    lm = build_lm()
    slots = streams if layout != "dp2" else streams // 2
    shapes = {"max_num_seqs": slots, "max_model_len": MAX_MODEL_LEN, "prefill_buckets": [PROMPT, MAX_MODEL_LEN],
              "decode_batch_buckets": [1, slots], "decode_context_buckets": [PROMPT + NEW, MAX_MODEL_LEN]}
    started = time.perf_counter()
    if layout == "dp2":
        buckets = GenerationBuckets.build(slots, MAX_MODEL_LEN, prefill=shapes["prefill_buckets"],
                                          decode_rows=shapes["decode_batch_buckets"],
                                          decode_context=shapes["decode_context_buckets"])
        engine = EngineGroup.on_cores(compile_generation(lm, buckets), cores)
    else:
        engine = engine_for(lm, **shapes, tensor_parallel_size=tp)
    startup = time.perf_counter() - started
    rng = random.Random(0)
    prompts = [[rng.randrange(8192) for _ in range(PROMPT)] for _ in range(streams)]
    try:
        _run(engine, prompts[:2])  # warm-up: every bucket's first call
        lone = [statistics.median(_run(engine, prompts[:1])[1]) for _ in range(repeats)]
        walls = [_run(engine, prompts)[0] for _ in range(repeats)]
    finally:
        engine.close()
    return {"layout": layout, "cores": cores, "tensor_parallel_size": tp, "startup_s": startup,
            "lone_tpot_s": statistics.median(lone), "streams": streams,
            "tokens_per_s": streams * NEW / statistics.median(walls)}


def _child(layout: str, streams: int, repeats: int) -> dict:
    cores = LAYOUTS[layout][0]
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(cores), "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "bench.tensor_parallel", "--layout", layout, "--streams",
                           str(streams), "--repeats", str(repeats)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(rows: dict[str, dict]) -> tuple[str, dict]:
    tp1, tp2, dp2 = rows["tp1"], rows["tp2"], rows["dp2"]
    ratios = {"tp2_over_tp1_lone_tpot": tp2["lone_tpot_s"] / tp1["lone_tpot_s"],
              "tp2_over_dp2_tokens_per_s": tp2["tokens_per_s"] / dp2["tokens_per_s"],
              "tp2_over_tp1_startup": tp2["startup_s"] / tp1["startup_s"]}
    lines = ["## Tensor parallelism (Llama, ~110M parameters, emulated cores, one XLA:CPU thread each)", "",
             "| layout | cores | start-up s | lone TPOT ms | tok/s at %d streams |" % tp1["streams"],
             "|---|---:|---:|---:|---:|"]
    for row in (tp1, tp2, dp2):
        lines.append(f"| {row['layout']} | {row['cores']} | {row['startup_s']:.1f} | {row['lone_tpot_s'] * 1e3:.2f} "
                     f"| {row['tokens_per_s']:.0f} |")
    met = "met" if ratios["tp2_over_tp1_lone_tpot"] <= TPOT_TARGET else "not met"
    lines += ["", f"- lone TPOT, TP 2 / TP 1: **{ratios['tp2_over_tp1_lone_tpot']:.2f}x** (target <= "
                  f"{TPOT_TARGET}: {met})",
              f"- tokens/s at {tp1['streams']} streams, TP 2 / DP 2: **{ratios['tp2_over_dp2_tokens_per_s']:.2f}x**",
              f"- start-up, TP 2 / TP 1: **{ratios['tp2_over_tp1_startup']:.2f}x**"]
    return "\n".join(lines) + "\n", ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tensor_parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 streams, one repeat")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)  # a child's own layout
    parser.add_argument("--streams", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layout:
        print(json.dumps(measure(args.layout, args.streams, args.repeats)))
        return 0
    streams, repeats = (16, 1) if args.quick else (32, 3)
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for layout in LAYOUTS:
        print(f"tensor parallelism: {layout} ...", file=sys.stderr, flush=True)
        rows[layout] = _child(layout, streams, repeats)
    text, ratios = report(rows)
    (out / "tensor_parallel.md").write_text(text)
    (out / "tensor_parallel.json").write_text(json.dumps({"rows": rows, "ratios": ratios}, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
