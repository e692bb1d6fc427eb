"""Generation benchmark: neuron-serve's engine against transformers, in one process.

    python -m bench.generate [--quick] [--out DIR]    # also a part of python -m bench

One small Llama (random weights, built here, nothing downloaded) and one workload of
32 greedy requests (random prompt ids of 8 to 200 tokens, 16 to 128 new tokens each,
fixed seeds) run on three systems, one after another, never at the same time:

1. neuron-serve's engine (``engine_for``: compiled prefill and decode buckets on an
   emulated NeuronCore, XLA:CPU), every request submitted at once;
2. transformers' continuous batching (the manager ``generate_batch`` runs on), every
   request added at once, each with its own ``max_new_tokens``;
3. transformers ``generate`` in eager PyTorch, one request after another.

For each: output tokens/s (generated tokens over the wall time of the whole workload),
time to first token (from the arrival of all requests) and time per output token (every
gap between two tokens of a request, pooled), p50 and p99; then one request alone (64
prompt tokens, 64 new): the engine's TPOT against eager ``generate``. EOS is off, so every
system generates the same tokens. Each workload runs once to warm up, then three times
(``--quick``: once); the run of median tokens/s is reported. The engine's compile time is
reported apart. Writes generate.md (the tables, printed too) and generate.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import threading
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")  # read when torch_xla starts

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
VOCAB, SLOTS, MAX_MODEL_LEN = 2048, 32, 512
# transformers' paged cache holds pages of 256 tokens: 64 pages are the engine's 32 slots x 512 positions.
CB_PAGE, CB_PAGES = 256, SLOTS * MAX_MODEL_LEN // 256
# Continuous batching on CPU runs "sdpa" or "paged|eager" (plain "eager" is switched to the latter);
# sdpa is the faster of the two here (about 1400 against 900 tokens/s on this workload), so the baseline.
CB_ATTENTION = "sdpa"
TARGETS = [  # (key, description, figure, bound, "min" or "max")
    ("vs_cb", "engine tok/s >= 3x transformers continuous batching", "tokens_per_s_ratio_cb", 3.0, "min"),
    ("vs_sequential", "engine tok/s >= 10x sequential generate", "tokens_per_s_ratio_seq", 10.0, "min"),
    ("single_tpot", "single-request TPOT <= 0.5x eager generate", "single_tpot_ratio", 0.5, "max"),
    ("tpot_tail", "engine p99 TPOT under load <= 3x its p50", "engine_tpot_p99_over_p50", 3.0, "max"),
]


def build_lm() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_MODEL_LEN,
                         attn_implementation="eager")
    lm = LlamaForCausalLM(config).eval()
    lm.generation_config.eos_token_id = None  # every request runs to its max_new_tokens, in every system
    return lm


def workload(requests: int, new_tokens: tuple[int, int], seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(8, 200))] for _ in range(requests)]
    return prompts, [rng.randint(*new_tokens) for _ in range(requests)]


def summarise(tokens: list[list[int]], times: list[list[float]], arrivals: list[float], wall: float) -> dict:
    ttft = [ts[0] - t for ts, t in zip(times, arrivals)]
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:])]
    total, pct = sum(len(t) for t in tokens), lambda xs, q: float(np.percentile(xs, q))
    return {"output_tokens": total, "wall_s": wall, "tokens_per_s": total / wall, "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99), "tpot_p50_s": pct(gaps, 50), "tpot_p99_s": pct(gaps, 99)}


def engine_steps() -> dict[str, list[float]]:
    """The engine's own step histogram so far: [calls, seconds] by compiled model (bucket label)."""
    from neuron_serve import metrics  # noqa: PLC0415

    steps: dict[str, list[float]] = {}
    for sample in (s for m in metrics.STEP_TIME.collect() for s in m.samples if s.name.endswith(("_count", "_sum"))):
        steps.setdefault(sample.labels["bucket"], [0, 0.0])[sample.name.endswith("_sum")] += sample.value
    return steps


# -- the systems: each returns (tokens per request, token times per request, arrivals, wall seconds) --

def run_engine(engine, prompts, news):
    from neuron_serve.generation import SamplingParams  # noqa: PLC0415

    tokens, times = [[] for _ in prompts], [[] for _ in prompts]
    done, reasons = threading.Semaphore(0), []

    def sink_for(i: int):
        def sink(event) -> None:  # on the engine's thread, as the token is handed over
            if event.token is not None:
                times[i].append(time.perf_counter())
                tokens[i].append(event.token)
            if event.finished:
                reasons.append(event.finish_reason)
                done.release()
        return sink

    started = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, news)):
        engine.submit(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), sink_for(i))
    for _ in prompts:
        done.acquire()
    wall = time.perf_counter() - started
    assert set(reasons) == {"length"}, f"engine requests ended with {set(reasons)}"
    return tokens, times, [started] * len(prompts), wall


def run_cb(manager, prompts, news):
    # generate_batch takes one max_new_tokens for every request; the manager it wraps
    # (continuous_batching_context_manager) takes one per request, so the work is the same.
    started = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=n, record_timestamps=True) for p, n in zip(prompts, news)]
    results = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=60)
        if result is None:
            raise RuntimeError("transformers continuous batching stopped answering")
        if result.is_finished():
            results[result.request_id] = result
    wall = time.perf_counter() - started
    outs = [results[i] for i in ids]
    assert not any(o.error for o in outs), [o.error for o in outs if o.error]
    return [o.generated_tokens for o in outs], [o.timestamps for o in outs], [started] * len(outs), wall


def transformers_cb(lm, prompts, news, repeats: int) -> list:
    from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: PLC0415
    from transformers.generation.continuous_batching.utils import WorkloadHints  # noqa: PLC0415

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # the EOS and psutil notices
    lm.set_attn_implementation(CB_ATTENTION)
    config = GenerationConfig(max_new_tokens=max(news), do_sample=False)
    # Auto-sized, the cache takes 60% of the host's memory (1.7 GB, 24 s to allocate); the engine's capacity is enough.
    # No prefix caching (the engine has none): repeated runs must prefill their prompts again.
    cb_config = ContinuousBatchingConfig(page_size=CB_PAGE, num_blocks=CB_PAGES, allow_block_sharing=False)
    hints = WorkloadHints(max(map(len, prompts)), max(news), len(prompts))  # as generate_batch gives them
    try:
        with torch.no_grad(), lm.continuous_batching_context_manager(
                generation_config=config, continuous_batching_config=cb_config, workload_hints=hints) as manager:
            run_cb(manager, prompts, news)
            return [run_cb(manager, prompts, news) for _ in range(repeats)]
    finally:
        lm.set_attn_implementation("eager")


class Stamps(BaseStreamer):
    """A generate() streamer: the time of each new token (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.puts = 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts > 1:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_sequential(lm, prompts, news, service: list | None = None):
    """All requests arrive at once and are served in turn; ``service`` gets each one's TTFT from its own start."""
    tokens, times = [], []
    started = time.perf_counter()
    with torch.no_grad():
        for prompt, n in zip(prompts, news):
            ids = torch.tensor([prompt])
            stamps, begun = Stamps(), time.perf_counter()
            out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              streamer=stamps)
            tokens.append(out[0, len(prompt):].tolist())
            times.append(stamps.times)
            if service is not None:
                service.append(stamps.times[0] - begun)
    return tokens, times, [started] * len(prompts), time.perf_counter() - started


def median(runs: list) -> tuple[tuple, dict]:
    """The run of median tokens/s and its figures (with every run's tokens/s)."""
    figs = sorted(((summarise(*r), r) for r in runs), key=lambda fr: fr[0]["tokens_per_s"])
    figs[len(figs) // 2][0]["tokens_per_s_runs"] = [f["tokens_per_s"] for f, _ in figs]
    return figs[len(figs) // 2][1], figs[len(figs) // 2][0]


# -- the report --------------------------------------------------------------------------

def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report(f: dict) -> str:
    labels = {"engine": "neuron-serve engine", "transformers_cb": f"transformers continuous batching ({CB_ATTENTION})",
              "sequential": "transformers generate, sequential (eager)"}
    lines = ["| system | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for key, label in labels.items():
        s = f["systems"][key]
        lines.append(f"| {label} | {s['tokens_per_s']:.1f} | {ms(s['ttft_p50_s'])} | {ms(s['ttft_p99_s'])} | "
                     f"{ms(s['tpot_p50_s'])} | {ms(s['tpot_p99_s'])} | {s['wall_s']:.2f} |")
    lines += ["", "| one request (64-token prompt, 64 new) | TPOT p50 ms | TTFT ms |", "|---|---:|---:|"]
    lines += [f"| {labels[k]} | {ms(f['single'][k]['tpot_p50_s'])} | {ms(f['single'][k]['ttft_p50_s'])} |"
              for k in ("engine", "sequential")]
    lines += ["", "| target | measured | met |", "|---|---:|---|"]
    lines += [f"| {text} | {f['ratios'][figure]:.2f}x | {'met' if f['targets'][key] else 'MISSED'} |"
              for key, text, figure, _, _ in TARGETS]
    w, m, load = f["workload"], f["greedy_match"], f["load_average"]
    in_calls = sum(v["seconds"] for v in f["engine_steps"].values())
    by_model = ", ".join(f"{k} {v['seconds'] / in_calls:.0%} ({v['calls']} x {ms(v['seconds'] / v['calls'])} ms)"
                         for k, v in f["engine_steps"].items())
    lines += ["",
              f"Workload: {w['requests']} requests, prompts of {w['prompt_tokens']} tokens, {w['new_tokens']} new "
              f"tokens each ({w['output_tokens']} in all), greedy, EOS off, all arriving at once; each system warmed "
              f"up on it, then {f['repeats']} run(s), the run of median tokens/s shown. torch threads: "
              f"{f['torch_threads']}; {os.cpu_count()} CPU cores; load average {load[0]:.1f} at the start, "
              f"{load[1]:.1f} at the end (other work adds noise: torch's OpenMP threads, one per core, slow down many "
              "times when a core is taken).",
              f"Engine compile (not in the throughput): {f['engine_compile_s']:.1f}s, {f['engine_buckets']} compiled "
              f"models. Its time in compiled calls: {in_calls / f['engine_wall_s']:.0%} of its wall time; by model: "
              f"{by_model}.",
              "TTFT counts from the arrival of all requests: sequential generate's includes waiting for the requests "
              f"before it (alone, its TTFT p50 is {ms(f['systems']['sequential']['service_ttft_p50_s'])} ms). "
              "TPOT pools every gap between two tokens of a request.",
              f"Greedy output: the engine equals sequential generate on {m['engine']}/{w['requests']} requests, "
              f"continuous batching on {m['transformers_cb']}/{w['requests']} (a sanity check: XLA and eager float "
              "sums differ, so a near tie may go the other way)."]
    return "\n".join(lines)


def measure(quick: bool, log) -> dict:
    prompts, news = workload(32, (16, 128))
    single = [[random.Random(2).randrange(VOCAB) for _ in range(64)]], [64]
    repeats = 1 if quick else 3
    load = [os.getloadavg()[0]]
    lm = build_lm()
    from neuron_serve.generation import engine_for  # noqa: PLC0415

    log(f"compiling the engine ({SLOTS} slots of {MAX_MODEL_LEN} positions)")
    started = time.perf_counter()
    engine = engine_for(lm, max_num_seqs=SLOTS, max_model_len=MAX_MODEL_LEN)
    compile_s = time.perf_counter() - started
    try:
        run_engine(engine, prompts, news)  # first calls of each bucket are slower: every system warms up
        run_engine(engine, *single)
        log(f"compiled in {compile_s:.0f}s; engine, {len(prompts)} requests x {repeats}")
        before = engine_steps()  # where the engine's time goes: its compiled calls, by bucket
        runs = {"engine": [run_engine(engine, prompts, news) for _ in range(repeats)]}
        steps = {k: [c - before.get(k, [0, 0.0])[0], t - before.get(k, [0, 0.0])[1]]
                 for k, (c, t) in engine_steps().items() if c > before.get(k, [0, 0.0])[0]}
        singles = {"engine": [run_engine(engine, *single) for _ in range(repeats)]}
    finally:
        engine.close()
    log("transformers continuous batching")
    runs["transformers_cb"] = transformers_cb(lm, prompts, news, repeats)
    log("transformers generate, one request after another")
    run_sequential(lm, *single)  # nothing is compiled per shape: one request warms up
    service: list[float] = []
    runs["sequential"] = [run_sequential(lm, prompts, news, service) for _ in range(repeats)]
    singles["sequential"] = [run_sequential(lm, *single) for _ in range(repeats)]
    load.append(os.getloadavg()[0])

    chosen = {k: median(v) for k, v in runs.items()}
    systems = {k: figs for k, (_, figs) in chosen.items()}
    assert len({s["output_tokens"] for s in systems.values()}) == 1, "the systems generated different token counts"
    systems["sequential"]["service_ttft_p50_s"] = float(np.percentile(service, 50))
    reference = chosen["sequential"][0][0]
    match = {k: sum(a == b for a, b in zip(chosen[k][0][0], reference)) for k in ("engine", "transformers_cb")}
    e, cb, sq = systems["engine"], systems["transformers_cb"], systems["sequential"]
    single_figs = {k: median(v)[1] for k, v in singles.items()}
    ratios = {"tokens_per_s_ratio_cb": e["tokens_per_s"] / cb["tokens_per_s"],
              "tokens_per_s_ratio_seq": e["tokens_per_s"] / sq["tokens_per_s"],
              "single_tpot_ratio": single_figs["engine"]["tpot_p50_s"] / single_figs["sequential"]["tpot_p50_s"],
              "engine_tpot_p99_over_p50": e["tpot_p99_s"] / e["tpot_p50_s"]}
    lengths = sorted(map(len, prompts))
    return {"mode": "quick" if quick else "full", "repeats": repeats, "torch_threads": torch.get_num_threads(),
            "load_average": load, "engine_compile_s": compile_s, "engine_buckets": engine.engines.model.buckets.count,
            "transformers_cb_attention": CB_ATTENTION,
            "workload": {"requests": len(prompts), "prompt_tokens": f"{lengths[0]}-{lengths[-1]}",
                         "new_tokens": f"{min(news)}-{max(news)}", "output_tokens": sum(news)},
            "systems": systems, "single": single_figs, "ratios": ratios, "greedy_match": match,
            "targets": {key: ratios[fig] >= bound if kind == "min" else ratios[fig] <= bound
                        for key, _, fig, bound, kind in TARGETS},
            "engine_steps": {k: {"calls": int(c), "seconds": t} for k, (c, t) in
                             sorted(steps.items(), key=lambda kv: -kv[1][1])},
            "engine_wall_s": sum(r[3] for r in runs["engine"])}  # of the measured runs, as engine_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="each workload once (default: three times, the median)")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    args = parser.parse_args(argv)
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    # Every system runs on this process's threads, the count fixed once for all of them: one per
    # core (torch's default) unless OMP_NUM_THREADS says otherwise. XLA:CPU has its own pool.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    figures = measure(args.quick, lambda message: print(f"[generate] {message}", flush=True))
    markdown = report(figures)
    (out / "generate.md").write_text(markdown + "\n")
    (out / "generate.json").write_text(json.dumps(figures, indent=2))
    print(markdown, flush=True)
    print(f"[generate] wrote {out / 'generate.md'} and {out / 'generate.json'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
