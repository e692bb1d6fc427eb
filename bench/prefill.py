"""Time to first token of long prompts: the compiled prefill against eager transformers, and served.

    python -m bench.prefill [--quick] [--out DIR]    # also a part of python -m bench

The model a new user would try: a transformers Qwen2 with 4 layers, hidden 64 (random
weights, vocabulary 2048, and a byte-level BPE tokenizer of that size), ``max_model_len``
512, the default buckets (prefill 32, 64, 128, 256, 384, 512).

1. **In process**, per prompt length (8 to 500 tokens): ``engine_for(...).generate_batch``
   of one prompt with ``max_tokens: 1`` (the engine's hand-offs, the padded prefill call,
   the cache write and the first token's sampling) against eager transformers' forward of
   the same ids (sdpa, no cache kept), medians of alternating runs in one process. Target:
   at most 1.0x at every length.
2. **Served**, one stream at a time on one keep-alive connection: ``neuron-serve deploy``
   of the model against ``transformers serve --continuous-batching`` of the same directory,
   one server at a time, the same seeded text prompts of 8 to 480 tokens, streamed
   ``/v1/completions`` at temperature 0 with 4 new tokens; time to first token (request
   sent to the first chunk with text), p50 and p99. Target: neuron-serve's p99 at most the
   peer's.

Writes prefill.md (printed too) and prefill.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import servers
from .generate_http import OpenAIServer, make_workload, no_eos_config, run_point, summarise

os.environ.setdefault("PJRT_DEVICE", "CPU")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
VOCAB, MAX_MODEL_LEN = 2048, 512
LENGTHS = (8, 100, 200, 310, 500)
SERVED_PROMPTS, NEW_TOKENS = (8, 480), 4
TARGET_IN_PROCESS, TARGET_SERVED = 1.0, 1.0
PORTS = {"neuron-serve": 18840, "transformers-cb": 18841}


def build_lm():
    import torch  # noqa: PLC0415
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN)
    return Qwen2ForCausalLM(config).eval()


def in_process(runs: int, log) -> dict:
    """Per prompt length: the engine's one-token generate and eager forward, medians (seconds)."""
    import torch  # noqa: PLC0415

    from neuron_serve.generation import engine_for  # noqa: PLC0415
    from neuron_serve.generation.frontend.protocol import SamplingParams  # noqa: PLC0415

    lm = build_lm()
    engine = engine_for(lm, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, name="prefill-bench")
    params = SamplingParams(max_tokens=1, temperature=0)
    generator = torch.Generator().manual_seed(1)
    figures = {}
    try:
        for n in LENGTHS:
            ids = torch.randint(1, VOCAB, (1, n), generator=generator)
            prompt = ids[0].tolist()
            ours, eager = [], []
            with torch.inference_mode():
                for _ in range(runs + 2):  # alternating, so a busy moment costs both; the first two dropped
                    started = time.perf_counter()
                    engine.generate_batch([prompt], params)
                    ours.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    lm(ids)
                    eager.append(time.perf_counter() - started)
            ours_s, eager_s = statistics.median(ours[2:]), statistics.median(eager[2:])
            figures[n] = {"engine_s": ours_s, "eager_forward_s": eager_s, "ratio": ours_s / eager_s,
                          "bucket": next(b for b in engine.engines.executor.model.buckets.prefill if b >= n)}
            log(f"  {n:4d} tokens ({figures[n]['bucket']} bucket): engine {ours_s * 1e3:.2f} ms, eager forward "
                f"{eager_s * 1e3:.2f} ms, {figures[n]['ratio']:.2f}x")
    finally:
        engine.close()
    return figures


def write_model(folder: Path) -> Path:
    from bench.openai_fields import _tokenizer  # noqa: PLC0415

    path = folder / "qwen2"
    lm = build_lm()
    lm.generation_config.eos_token_id = None
    lm.save_pretrained(path)
    _tokenizer(VOCAB).save_pretrained(path)
    return path


def server_specs(model: Path, folder: Path) -> dict[str, tuple]:
    import yaml  # noqa: PLC0415

    bindir = Path(sys.executable).parent
    deployment = folder / "qwen2.yaml"
    deployment.write_text(yaml.safe_dump({"name": "llm", "task": "generate", "model": {"pretrained": str(model)},
                                          "generation": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4}}))
    ours = PORTS["neuron-serve"]
    peer = PORTS["transformers-cb"]
    return {
        "neuron-serve": (servers.ServerSpec(
            "neuron-serve", "neuron-serve (OpenAI API)",
            [str(bindir / "neuron-serve"), "deploy", str(deployment), "--host", "127.0.0.1", "--port", str(ours),
             "--no-grpc"], ours, startup_s=2400, replica_marker="ray::ServeReplica:",
            ready_line=servers.READY_LINE), "llm", {"ignore_eos": True}),
        "transformers-cb": (servers.ServerSpec(
            "transformers-cb", "transformers serve --continuous-batching",
            [str(bindir / "transformers"), "serve", str(model), "--host", "127.0.0.1", "--port", str(peer),
             "--device", "cpu", "--attn-implementation", "sdpa", "--continuous-batching", "--cb-num-blocks", "64"],
            peer, startup_s=300), str(model), {"generation_config": no_eos_config(model)}),
    }


def served(count: int, folder: Path, log) -> dict:
    from transformers import AutoTokenizer  # noqa: PLC0415

    model = write_model(folder)
    workload = make_workload(AutoTokenizer.from_pretrained(model), count, seed=3, prompt_tokens=SERVED_PROMPTS,
                             new_tokens=(NEW_TOKENS, NEW_TOKENS))
    warmup = make_workload(AutoTokenizer.from_pretrained(model), 4, seed=4, prompt_tokens=SERVED_PROMPTS,
                           new_tokens=(NEW_TOKENS, NEW_TOKENS))
    figures = {}
    for key, (spec, name, extra) in server_specs(model, folder).items():
        def body(request: dict, max_tokens: int | None = None) -> dict:
            return {"model": name, "prompt": request["prompt"], "max_tokens": max_tokens or request["max_tokens"],
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **extra}

        server = OpenAIServer(spec, folder / "logs")
        try:
            probe = json.dumps({**body(warmup[0], 2), "stream": False, "stream_options": None}).encode()
            ready = server.wait_ready({name: (probe, {"Content-Type": "application/json"})})
            log(f"  {key}: ready in {ready:.0f}s")
            url = server.url(name)
            asyncio.run(run_point(url, [body(r) for r in warmup], 1))
            results, wall = asyncio.run(run_point(url, [body(r) for r in workload], 1))
            figures[key] = {"label": spec.label, **summarise(results, workload, wall),
                            "ttft_s": [r["ttft_s"] for r in results]}
            point = figures[key]
            log(f"  {key:16s} TTFT p50 {point['ttft_p50_s'] * 1e3:.1f} ms, p99 {point['ttft_p99_s'] * 1e3:.1f} ms, "
                f"errors {point['errors']}" + (f" ({point['first_error']})" if point["first_error"] else ""))
        finally:
            server.stop()
    figures["prompt_tokens"] = [r["prompt_tokens"] for r in workload]
    return figures


def report(result: dict) -> str:
    lines = ["## Long prompts' time to first token", "",
             "In process: one prompt, `max_tokens: 1`, against eager transformers' forward of it (medians).", "",
             "| prompt tokens | bucket | engine ms | eager forward ms | ratio |", "|---:|---:|---:|---:|---:|"]
    for n, f in result["in_process"].items():
        lines.append(f"| {n} | {f['bucket']} | {f['engine_s'] * 1e3:.2f} | {f['eager_forward_s'] * 1e3:.2f} | "
                     f"{f['ratio']:.2f}x |")
    worst = max(f["ratio"] for f in result["in_process"].values())
    lines += ["", f"Worst ratio {worst:.2f}x (target <= {TARGET_IN_PROCESS}: "
                  f"{'met' if worst <= TARGET_IN_PROCESS else 'not met'}).", ""]
    if "served" in result:
        s = result["served"]
        lines += [f"Served, one stream, {len(s['prompt_tokens'])} prompts of {SERVED_PROMPTS[0]} to "
                  f"{SERVED_PROMPTS[1]} tokens, {NEW_TOKENS} new tokens each:", "",
                  "| server | TTFT p50 ms | TTFT p99 ms | errors |", "|---|---:|---:|---:|"]
        for key in PORTS:
            if key in s:
                lines.append(f"| {s[key]['label']} | {s[key]['ttft_p50_s'] * 1e3:.1f} | "
                             f"{s[key]['ttft_p99_s'] * 1e3:.1f} | {s[key]['errors']} |")
        if "p99_ratio" in result:
            lines += ["", f"TTFT p99 {result['p99_ratio']:.2f}x the peer's (target <= {TARGET_SERVED}: "
                          f"{'met' if result['p99_ratio'] <= TARGET_SERVED else 'not met'}).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10 runs per length and 24 served prompts, not 30 and 64")
    parser.add_argument("--no-serve", action="store_true", help="the in-process part only")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    args = parser.parse_args(argv)
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, flush=True)

    log("prefill in process against eager forward:")
    result: dict = {"in_process": in_process(10 if args.quick else 30, log)}
    if not args.no_serve:
        log("served, one stream:")
        with tempfile.TemporaryDirectory() as tmp:
            result["served"] = served(24 if args.quick else 64, Path(tmp), log)
        ours, peer = result["served"].get("neuron-serve"), result["served"].get("transformers-cb")
        if ours and peer and ours["ttft_p99_s"] and peer["ttft_p99_s"]:
            result["p99_ratio"] = ours["ttft_p99_s"] / peer["ttft_p99_s"]
    text = report(result)
    (out / "prefill.md").write_text(text)
    (out / "prefill.json").write_text(json.dumps(result, indent=2, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
