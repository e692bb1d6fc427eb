"""What automatic prefix caching saves a prompt that repeats a long prefix, served over HTTP.

    python -m bench.prefix_caching [--quick] [--out DIR]    # also a part of python -m bench

The generation benchmark's Llama (4 layers, hidden 256, vocabulary 2048; random weights,
bench/generate.py) and a byte-level BPE tokenizer of that vocabulary, saved to one
directory and served by ``neuron-serve deploy`` twice, one server at a time: without
``generation.enable_prefix_caching`` and with it, every other setting the same
(``max_model_len`` 512; prefill buckets 32, 128, 512).

Workloads, token-id prompts on ``/v1/completions``, one request at a time on one
keep-alive connection, one new token each (time to first token: the request sent to its
answer read, which is the prefill and the first token's way back):

- **shared prefix**: rounds of 8 prompts sharing a 300-token prefix (a new prefix each
  round), each followed by its own 12 tokens: the first prompt of a round computes the
  prefix, the other 7 find it cached. Target: TTFT p50 with caching at most 0.4x without.
- **no hits**: 300-token prompts sharing nothing. Target: TTFT p50 with caching within
  1.05x of without (the lookup, the hashing and the slot choice cost next to nothing).

Writes prefix_caching.md (printed too) and prefix_caching.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import servers
from .generate_http import OpenAIServer

os.environ.setdefault("PJRT_DEVICE", "CPU")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PREFIX, SUFFIX, ROUND = 300, 12, 8
TARGET_HIT, TARGET_MISS = 0.4, 1.05
PORT = 18830
GENERATION = {"max_num_seqs": 4, "max_model_len": 512, "prefill_buckets": [32, 128, 512],
              "decode_batch_buckets": [1, 4], "decode_context_buckets": [128, 512]}


def write_model(folder: Path) -> None:
    """The benchmark's Llama and a tokenizer of its vocabulary, as one save_pretrained directory."""
    from bench.generate import build_lm  # noqa: PLC0415
    from bench.openai_fields import _tokenizer  # noqa: PLC0415

    lm = build_lm()
    lm.save_pretrained(folder / "llm")
    _tokenizer(lm.config.vocab_size).save_pretrained(folder / "llm")


def workloads(rounds: int, misses: int, vocab: int) -> dict[str, list[list[int]]]:
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    shared = []
    for _ in range(rounds):
        prefix = tokens(PREFIX)
        shared += [prefix + tokens(SUFFIX) for _ in range(ROUND)]
    return {"shared_prefix": shared, "no_hits": [tokens(PREFIX + SUFFIX) for _ in range(misses)]}


def serve(folder: Path, key: str, generation: dict, port: int) -> OpenAIServer:
    """``neuron-serve deploy`` of the model in ``folder`` as "llm" with ``generation``, started (not yet ready)."""
    import yaml  # noqa: PLC0415

    path = folder / f"llm-{key}.yaml"
    path.write_text(yaml.safe_dump({"name": "llm", "task": "generate", "model": {"pretrained": str(folder / "llm")},
                                    "generation": generation}))
    cli = str(Path(sys.executable).with_name("neuron-serve"))
    spec = servers.ServerSpec(f"neuron-serve-{key}", "neuron-serve",
                              [cli, "deploy", str(path), "--host", "127.0.0.1", "--port", str(port), "--no-grpc"],
                              port, startup_s=2400, replica_marker="ray::ServeReplica:",
                              ready_line=servers.READY_LINE)
    return OpenAIServer(spec, folder / "logs")


def measure(caching: bool, prompts: dict[str, list[list[int]]], folder: Path, log) -> dict:
    server = serve(folder, "cached" if caching else "plain", {**GENERATION, "enable_prefix_caching": caching}, PORT)

    def body(prompt: list[int]) -> bytes:
        return json.dumps({"model": "llm", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                           "ignore_eos": True}).encode()

    try:
        ready = server.wait_ready({"llm": (body([1, 2, 3]), {"Content-Type": "application/json"})})
        log(f"  {'with' if caching else 'without'} prefix caching: ready in {ready:.0f}s")
        connection = http.client.HTTPConnection("127.0.0.1", PORT, timeout=120)

        def timed(prompt: list[int]) -> float:
            started = time.perf_counter()
            connection.request("POST", "/v1/completions", body(prompt), {"Content-Type": "application/json"})
            answer = connection.getresponse()
            data = answer.read()
            if answer.status != 200:
                raise RuntimeError(f"HTTP {answer.status}: {data[:200]!r}")
            return time.perf_counter() - started

        for prompt in ([7] * (PREFIX + SUFFIX), [7] * (PREFIX + SUFFIX), [9] * 20):  # each bucket's first call
            timed(prompt)
        figures = {}
        for name, batch in prompts.items():
            firsts = [timed(p) for p in batch]
            figures[name] = {"ttft_p50_s": statistics.median(firsts), "ttft_s": firsts}
            log(f"    {name:14s} TTFT p50 {figures[name]['ttft_p50_s'] * 1e3:.2f} ms over {len(firsts)} requests")
    finally:
        server.stop()
    return figures


def report(result: dict) -> str:
    plain, cached = result["without"], result["with"]
    rows = []
    for name, target in (("shared_prefix", TARGET_HIT), ("no_hits", TARGET_MISS)):
        ratio = result["ratios"][name]
        verdict = "met" if ratio <= target else "not met"
        rows.append(f"| {name.replace('_', ' ')} | {plain[name]['ttft_p50_s'] * 1e3:.2f} ms | "
                    f"{cached[name]['ttft_p50_s'] * 1e3:.2f} ms | {ratio:.2f}x (target <= {target}: {verdict}) |")
    return "\n".join(["## Prefix caching (served over HTTP, one request at a time)", "",
                      f"Prompts of {PREFIX} + {SUFFIX} tokens; time to first token, p50.", "",
                      "| workload | without caching | with caching | ratio |", "|---|---:|---:|---:|", *rows, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_caching", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 8 and 8 misses instead of 4 and 24")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    args = parser.parse_args(argv)
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_model(folder)
        from bench.generate import VOCAB  # noqa: PLC0415

        prompts = workloads(2 if args.quick else 4, 8 if args.quick else 24, VOCAB)
        result = {"without": measure(False, prompts, folder, log), "with": measure(True, prompts, folder, log)}
    result["ratios"] = {name: result["with"][name]["ttft_p50_s"] / result["without"][name]["ttft_p50_s"]
                        for name in result["with"]}
    text = report(result)
    (out / "prefix_caching.md").write_text(text)
    (out / "prefix_caching.json").write_text(json.dumps(result, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
