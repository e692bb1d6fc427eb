"""Chunked prefill: long prompts arriving while streams decode, with and without, against transformers serve.

    python -m bench.chunked_prefill [--quick] [--out DIR] [--servers a,b]   # also a part of python -m bench

One model, SmolLM2-135M-Instruct (deployments/llm/, ``make llm-example``): 30 layers, deep enough that a long
prompt's prefill costs many decode steps. Three servers, one at a time (each started, measured and stopped
before the next):

1. ``chunked``: ``neuron-serve deploy`` with ``enable_chunked_prefill: true``: each step decodes every stream and
   writes up to 128 tokens of a waiting prompt in the same call (``max_num_batched_tokens`` 152: a token for each
   of the 24 slots, and a chunk of 128).
2. ``whole``: the same model.yaml without it: a long prompt is prefilled whole, in a call of its own, and every
   stream waits for it (``max_num_batched_tokens`` 152 too: one prompt a step, as every longer one goes alone).
3. ``transformers-cb``: ``transformers serve --continuous-batching`` (the peer of bench/generate_http.py).

Both neuron-serve servers: one replica on one core, 24 slots of 512 positions, prompts bucketed at 128, 256 and 512
tokens, a decode of 24 rows, greedy. Measured once the background compile is done.

Workload, the same for every server: 16 streams (32-token prompts, 512 - 32 new tokens asked for, ``ignore_eos``)
start together; once each has its first token, long prompts arrive one every ``interval`` seconds (128 to 480
tokens, a quarter to all but 32 of ``max_model_len``, 16 new tokens each) for ``window`` seconds. Figures:

- **ITL p50 / p99**: the time between two text chunks of a stream, over the streams' chunks that arrived inside the
  window (a stall while a long prompt is prefilled lands in the tail);
- **TTFT p50 / p99** of the long prompts;
- **output tok/s**: every completion token (streams and long prompts) that arrived inside the window, over it.

Ratios: chunked against whole (ITL p99 at most 0.5x, TTFT p50 at most 1.2x, tokens/s at least 1.0x), and chunked
against transformers serve (ITL p99, tokens/s). Writes chunked_prefill.md (printed too) and chunked_prefill.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from . import servers
from .generate_http import MODEL_DIR, OpenAIServer, make_workload, no_eos_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MAX_MODEL_LEN, SLOTS, STREAMS, CHUNK = 512, 24, 16, 128
STREAM_PROMPT = 32
LONG_NEW = 16
MODES = {"full": {"window": 40.0, "interval": 2.0}, "quick": {"window": 20.0, "interval": 2.0}}
TARGETS = {"itl_p99": 0.5, "ttft_p50": 1.2, "tokens_per_s": 1.0}


def neuron_yaml(path: Path, chunked: bool) -> Path:
    import yaml  # noqa: PLC0415

    generation = {"max_num_seqs": SLOTS, "max_model_len": MAX_MODEL_LEN, "prefill_buckets": [128, 256, MAX_MODEL_LEN],
                  "decode_batch_buckets": [SLOTS], "decode_context_buckets": [MAX_MODEL_LEN],
                  "on_device_sampling": False, "max_num_batched_tokens": SLOTS + CHUNK}
    if chunked:
        generation.update(enable_chunked_prefill=True, prefill_chunk_buckets=[CHUNK])
    path.write_text(yaml.safe_dump({"name": "llm", "task": "generate", "model": {"pretrained": str(MODEL_DIR)},
                                    "generation": generation}, sort_keys=False))
    return path


def specs(out: Path, python: str = sys.executable) -> dict[str, tuple]:
    """key -> (spec, model name in the API, extra request fields)."""
    bindir = Path(python).parent
    deploy = [str(bindir / "neuron-serve"), "deploy", "--host", "127.0.0.1", "--no-grpc"]
    serve = [str(bindir / "transformers"), "serve", str(MODEL_DIR), "--host", "127.0.0.1", "--device", "cpu",
             "--attn-implementation", "sdpa", "--continuous-batching", "--cb-num-blocks", "64"]
    ignore_eos = {"ignore_eos": True}
    return {
        "chunked": (servers.ServerSpec("chunked", "neuron-serve, chunked prefill",
                                       [*deploy, str(neuron_yaml(out / "chunked.yaml", True)), "--port", "18860"],
                                       18860, startup_s=3600, replica_marker="ray::ServeReplica:",
                                       ready_line=servers.READY_LINE), "llm", ignore_eos),
        "whole": (servers.ServerSpec("whole", "neuron-serve, whole prefills",
                                     [*deploy, str(neuron_yaml(out / "whole.yaml", False)), "--port", "18861"],
                                     18861, startup_s=3600, replica_marker="ray::ServeReplica:",
                                     ready_line=servers.READY_LINE), "llm", ignore_eos),
        "transformers-cb": (servers.ServerSpec("transformers-cb", "transformers serve --continuous-batching",
                                               [*serve, "--port", "18862"], 18862, startup_s=600),
                            str(MODEL_DIR.resolve()), {"generation_config": no_eos_config(MODEL_DIR)}),
    }


def workload(tokenizer, mode: str, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """The streams' requests and the long prompts', each with its prompt text and max_tokens."""
    shape = MODES[mode]
    longs = int(shape["window"] / shape["interval"])
    streams = make_workload(tokenizer, STREAMS, seed, (STREAM_PROMPT, STREAM_PROMPT),
                            (MAX_MODEL_LEN - STREAM_PROMPT, MAX_MODEL_LEN - STREAM_PROMPT))
    rng = random.Random(seed + 1)
    lengths = [rng.randint(MAX_MODEL_LEN // 4, MAX_MODEL_LEN - 32) for _ in range(longs)]
    long = [make_workload(tokenizer, 1, seed + 2 + i, (n, n), (LONG_NEW, LONG_NEW))[0] for i, n in enumerate(lengths)]
    return streams, long


async def _stream(session, url: str, body: dict, record: dict) -> None:
    """One streamed completion; ``record`` gets its send time and every text chunk's arrival time."""
    record.update(sent=time.perf_counter(), chunks=[], tokens=0, error=None)
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                record["error"] = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    record["error"] = str(event["error"])[:200]
                    return
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        record["chunks"].append(time.perf_counter())
                if event.get("usage"):
                    record["tokens"] = event["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, the run goes on
        record["error"] = f"{type(exc).__name__}: {exc}"[:200]


def _body(request: dict, model: str, extra: dict) -> dict:
    return {"model": model, "prompt": request["prompt"], "max_tokens": request["max_tokens"], "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}


async def run(url: str, model: str, extra: dict, streams: list[dict], long: list[dict], interval: float) -> dict:
    """The workload against one server: the streams, then a long prompt every ``interval`` seconds."""
    import aiohttp  # noqa: PLC0415

    stream_records = [{} for _ in streams]
    long_records = [{} for _ in long]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        running = [asyncio.create_task(_stream(session, url, _body(r, model, extra), rec))
                   for r, rec in zip(streams, stream_records)]
        while not all(rec.get("chunks") or rec.get("error") for rec in stream_records):
            await asyncio.sleep(0.05)
        start = time.perf_counter()
        arrivals = []
        for i, (request, record) in enumerate(zip(long, long_records)):
            await asyncio.sleep(max(0.0, start + i * interval - time.perf_counter()))
            arrivals.append(asyncio.create_task(_stream(session, url, _body(request, model, extra), record)))
        await asyncio.gather(*arrivals)
        end = time.perf_counter()
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    return figures(stream_records, long_records, start, end)


def figures(streams: list[dict], long: list[dict], start: float, end: float) -> dict:
    """ITL of the streams inside [start, end], TTFT of the long prompts, tokens/s inside the window."""
    gaps = []
    in_window = 0
    for record in streams:
        times = record.get("chunks", [])
        inside = [t for t in times if start <= t <= end]
        in_window += len(inside)
        gaps += [b - a for a, b in zip(times, times[1:]) if start <= b <= end]
    ttft = [r["chunks"][0] - r["sent"] for r in long if r.get("chunks")]
    in_window += sum(len(r.get("chunks", [])) for r in long)
    errors = sum(1 for r in [*streams, *long] if r.get("error"))
    pct = lambda values, q: float(np.percentile(values, q)) if values else None  # noqa: E731
    return {"itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99), "gaps": len(gaps),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "long_prompts": len(long),
            "tokens_per_s": in_window / (end - start), "window_s": end - start, "errors": errors,
            "first_error": next((r["error"] for r in [*streams, *long] if r.get("error")), None)}


def ratios(systems: dict) -> dict:
    found = {}
    chunked, whole, peer = (systems.get(k, {}).get("figures") for k in ("chunked", "whole", "transformers-cb"))
    for name, key in (("itl_p99", "itl_p99_s"), ("ttft_p50", "ttft_p50_s"), ("tokens_per_s", "tokens_per_s")):
        if chunked and whole and chunked[key] and whole[key]:
            found[f"{name}_vs_whole"] = chunked[key] / whole[key]
    for name, key in (("itl_p99", "itl_p99_s"), ("tokens_per_s", "tokens_per_s")):
        if chunked and peer and chunked[key] and peer[key]:
            found[f"{name}_vs_transformers"] = chunked[key] / peer[key]
    return found


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}"


def report(result: dict) -> str:
    lines = ["| server | ITL p50 / p99 ms | long prompts' TTFT p50 / p99 ms | output tok/s | errors |",
             "|---|---:|---:|---:|---:|"]
    for entry in result["systems"].values():
        f = entry.get("figures")
        if f is None:
            lines.append(f"| {entry['label']} | failed: {entry.get('failed', '')[:80]} | | | |")
            continue
        lines.append(f"| {entry['label']} | {_ms(f['itl_p50_s'])} / {_ms(f['itl_p99_s'])} | {_ms(f['ttft_p50_s'])} / "
                     f"{_ms(f['ttft_p99_s'])} | {f['tokens_per_s']:.1f} | {f['errors']} |")
    r = result["ratios"]

    def said(name: str, target: str = "") -> str:
        return f"{r[name]:.2f}x{target}" if name in r else "n/a"
    lines += ["", "Chunked against whole prefills, same run: ITL p99 " + said("itl_p99_vs_whole", " (target <= 0.5x)")
              + ", long prompts' TTFT p50 " + said("ttft_p50_vs_whole", " (target <= 1.2x)") + ", output tok/s "
              + said("tokens_per_s_vs_whole", " (target >= 1.0x)") + "; against transformers serve "
              "--continuous-batching: ITL p99 " + said("itl_p99_vs_transformers") + ", output tok/s "
              + said("tokens_per_s_vs_transformers") + ".",
              "", f"Workload: {STREAMS} streams of {STREAM_PROMPT}-token prompts decoding throughout; "
              f"{result['long_prompts']} long prompts of {MAX_MODEL_LEN // 4}-{MAX_MODEL_LEN - 32} tokens "
              f"({LONG_NEW} new tokens each), one every {result['interval']:g} s ({result['mode']} run; SmolLM2-135M-"
              f"Instruct). Load average {result['load_average'][0]:.1f} at the start, "
              f"{result['load_average'][-1]:.1f} at the end on {os.cpu_count()} cores."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    keys = ["chunked", "whole", "transformers-cb"]
    parser = argparse.ArgumentParser(prog="python -m bench.chunked_prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 20 s window instead of 40")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    parser.add_argument("--servers", default=",".join(keys), help="comma-separated subset of: " + ", ".join(keys))
    args = parser.parse_args(argv)
    if not (MODEL_DIR / "config.json").is_file():
        print("bench.chunked_prefill: deployments/llm/ is missing; run `make llm-example` first", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer  # noqa: PLC0415

    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    mode = "quick" if args.quick else "full"
    streams, long = workload(AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True), mode)
    found = specs(out)
    systems, load = {}, [os.getloadavg()[0]]
    for key in args.servers.split(","):
        spec, model, extra = found[key]
        server = OpenAIServer(spec, out / "logs")
        entry = systems[key] = {"label": spec.label}
        try:
            probe = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0,
                                **extra}).encode()
            entry["ready_s"] = server.wait_ready({model: (probe, {"Content-Type": "application/json"})})
            entry["figures"] = asyncio.run(run(server.url(model), model, extra, streams, long,
                                               MODES[mode]["interval"]))
            f = entry["figures"]
            print(f"[chunked_prefill] {key}: ITL p99 {_ms(f['itl_p99_s'])} ms, TTFT p50 {_ms(f['ttft_p50_s'])} ms, "
                  f"{f['tokens_per_s']:.1f} tok/s, errors {f['errors']}", flush=True)
        except RuntimeError as exc:
            entry["failed"] = str(exc)
        finally:
            server.stop()
    load.append(os.getloadavg()[0])
    result = {"mode": mode, "interval": MODES[mode]["interval"], "long_prompts": len(long), "load_average": load,
              "systems": systems}
    result["ratios"] = ratios(systems)
    markdown = report(result)
    (out / "chunked_prefill.md").write_text(markdown + "\n")
    (out / "chunked_prefill.json").write_text(json.dumps(result, indent=2))
    print(markdown, flush=True)
    return 1 if any(e.get("failed") or e.get("figures", {}).get("errors") for e in systems.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
