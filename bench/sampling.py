"""Sampled requests against greedy ones: the same engine, one run, the traffic users send.

    python -m bench.sampling [--quick] [--out DIR]    # also a part of python -m bench

The model a new user would try with a real vocabulary: a transformers Qwen2 with 2 layers,
hidden 128 and Llama 2's 32,000-token vocabulary (random weights, built here, nothing
downloaded), one engine over one emulated core computing on one thread (as a served
replica's engine process runs it), ``max_num_seqs`` 32. For greedy (``temperature: 0``),
``temperature: 1`` (OpenAI's default) and ``temperature: 0.7, top_p: 0.9`` (a typical
generation_config), each with a seed:

- a lone stream: 64 new tokens after a 32-token prompt, time per output token, p50;
- 32 requests at once, 64 new tokens each: output tokens per second over the workload.

Each sampled figure is given as a ratio against greedy's of the same run (targets: TPOT
at most 1.1x greedy's, tokens/s at least 0.9x). Each configuration runs once to warm up,
then three times (``--quick``: once); the median run is reported. It uses only
``engine_for`` and the engine's streaming API, so the same script measures an older
checkout (``PYTHONPATH=<checkout> python bench/sampling.py``) for a before-and-after.
Writes sampling.md (printed too) and sampling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")  # read when torch_xla starts

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
VOCAB, SLOTS, MAX_MODEL_LEN, PROMPT, NEW = 32000, 32, 256, 32, 64
REQUESTS = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
}
TARGETS = {"tpot": 1.1, "tokens_per_s": 0.9}


def build_lm() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN,
                         attn_implementation="eager")
    lm = Qwen2ForCausalLM(config).eval()
    lm.generation_config.eos_token_id = None  # every request runs to its max_tokens
    return lm


def run(engine, prompts: list[list[int]], params: list) -> dict:
    """Submit every request at once; output tokens/s, and each request's gaps between tokens."""
    times: list[list[float]] = [[] for _ in prompts]
    done = threading.Semaphore(0)
    reasons: list[str] = []

    def sink_for(i: int):
        def sink(event) -> None:
            if event.token is not None:
                times[i].append(time.perf_counter())
            if event.finished:
                reasons.append(event.finish_reason)
                done.release()
        return sink

    started = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.submit(prompt, p, sink_for(i))
    for _ in prompts:
        done.acquire()
    wall = time.perf_counter() - started
    assert set(reasons) == {"length"}, reasons
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:])]
    return {"tokens_per_s": sum(len(t) for t in times) / wall, "tpot_p50_s": statistics.median(gaps)}


def measure(engine, fields: dict, repeats: int) -> dict:
    from neuron_serve.generation import SamplingParams  # noqa: PLC0415

    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (PROMPT,), generator=rng).tolist() for _ in range(SLOTS)]
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True, seed=i, **fields) for i in range(SLOTS)]
    figures = {}
    for name, chosen in (("lone", slice(0, 1)), ("concurrent", slice(0, SLOTS))):
        run(engine, prompts[chosen], params[chosen])  # warm-up
        runs = sorted((run(engine, prompts[chosen], params[chosen]) for _ in range(repeats)),
                      key=lambda r: r["tokens_per_s"])
        figures[name] = runs[len(runs) // 2]
    return {"lone_tpot_p50_s": figures["lone"]["tpot_p50_s"], "tokens_per_s": figures["concurrent"]["tokens_per_s"]}


def report(results: dict) -> str:
    greedy = results["greedy"]
    lines = ["| request | lone-stream TPOT p50 | tokens/s, 32 requests at once |", "|---|---:|---:|"]
    for name, figures in results.items():
        tpot, rate = figures["lone_tpot_p50_s"], figures["tokens_per_s"]
        if name == "greedy":
            lines.append(f"| {name} | {tpot * 1e3:.2f} ms | {rate:,.0f} |")
        else:
            lines.append(f"| {name} | {tpot * 1e3:.2f} ms ({tpot / greedy['lone_tpot_p50_s']:.2f}x) | "
                         f"{rate:,.0f} ({rate / greedy['tokens_per_s']:.2f}x) |")
    lines.append("")
    for name, figures in results.items():
        if name == "greedy":
            continue
        tpot = figures["lone_tpot_p50_s"] / greedy["lone_tpot_p50_s"]
        rate = figures["tokens_per_s"] / greedy["tokens_per_s"]
        met = tpot <= TARGETS["tpot"] and rate >= TARGETS["tokens_per_s"]
        lines.append(f"- {name}: TPOT {tpot:.2f}x greedy's (target <= {TARGETS['tpot']}x), tokens/s {rate:.2f}x "
                     f"(target >= {TARGETS['tokens_per_s']}x): {'met' if met else 'NOT met'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one measured run per configuration")
    parser.add_argument("--out", type=Path, help="results folder (default bench/results/<time>)")
    args = parser.parse_args(argv)
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    try:  # one core's engine computes on one thread, as in a served replica's engine process
        from neuron_serve.targets.pjrt import start_emulated_cores_on_threads  # noqa: PLC0415

        start_emulated_cores_on_threads(1)
    except ImportError:
        pass
    from neuron_serve.generation import engine_for  # noqa: PLC0415

    started = time.perf_counter()
    engine = engine_for(build_lm(), max_num_seqs=SLOTS, max_model_len=MAX_MODEL_LEN, name="sampling")
    compiled = time.perf_counter() - started
    try:
        results = {name: measure(engine, fields, 1 if args.quick else 3) for name, fields in REQUESTS.items()}
    finally:
        engine.close()
    text = (f"## Sampling on the core (bench/sampling.py)\n\nSampled against greedy requests, one engine (Qwen2, 2 layers, hidden 128, vocabulary {VOCAB}; "
            f"compiled in {compiled:.0f} s):\n\n" + report(results))
    print(text)
    (out / "sampling.md").write_text(text)
    (out / "sampling.json").write_text(json.dumps({"results": results, "compile_s": compiled}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
