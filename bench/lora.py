"""LoRA adapters served: streams spread over adapters against streams on the base, one server, one run.

    python -m bench.lora [--quick] [--tensor-parallel-size N] [--out DIR]    # also a part of python -m bench

The generation benchmark's Llama (4 layers, hidden 256, vocabulary 2048; random weights,
bench/generate.py) served by ``neuron-serve deploy`` with ``generation.lora``: four PEFT
adapters of rank 16 (attention and MLP projections, random weights, written here),
``max_loras: 4`` and ``max_lora_rank: 16``, so every compiled call carries the buffers.
Workloads, token-id prompts of 32 tokens asking for 64 (``ignore_eos``), streamed on
``/v1/completions``, 8 at once (closed loop), each in turn on the same server:

- **base**: every request on the base model (its rows take slot 0, the zeros);
- **4 adapters**: the requests spread over the four adapters, two streams each.

Output tokens per second and time per output token p50 of each; the adapters' TPOT is
given against the base's (target: at most 1.3x). Then an adapter's load time at rank 16:
``/v1/load_lora_adapter`` of a fifth adapter (the request, answered once a replica read and
checked it) and the first request on it (its buffers written onto the core). With
``--tensor-parallel-size 2`` the model is split over both cores (one replica; the adapter
buffers kept whole on each). Writes lora.md (printed too) and lora.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from . import servers
from .generate_http import OpenAIServer, run_point, summarise

os.environ.setdefault("PJRT_DEVICE", "CPU")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PORT = 18850
STREAMS, PROMPT, NEW = 8, 32, 64
ADAPTERS = ["a0", "a1", "a2", "a3"]
RANK = 16
TARGET_TPOT = 1.3
GENERATION = {"max_num_seqs": 8, "max_model_len": 128, "prefill_buckets": [32, 128], "decode_batch_buckets": [8],
              "decode_context_buckets": [128], "on_device_sampling": False}


def write_files(folder: Path) -> None:
    """The benchmark's Llama, a tokenizer of its vocabulary, and five rank-16 adapters of it."""
    import torch  # noqa: PLC0415
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415

    from bench.generate import build_lm  # noqa: PLC0415
    from bench.openai_fields import _tokenizer  # noqa: PLC0415

    lm = build_lm()
    lm.save_pretrained(folder / "llm")
    _tokenizer(lm.config.vocab_size).save_pretrained(folder / "llm")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for seed, name in enumerate([*ADAPTERS, "late"]):
        model = get_peft_model(build_lm(), LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets))
        torch.manual_seed(seed)
        with torch.no_grad():
            for key, parameter in model.named_parameters():
                if ".lora_A." in key or ".lora_B." in key:
                    parameter.normal_(0, 0.02)
        model.save_pretrained(folder / "adapters" / name)


def serve(folder: Path, tensor_parallel_size: int = 1) -> OpenAIServer:
    import yaml  # noqa: PLC0415

    path = folder / "lora.yaml"
    path.write_text(yaml.safe_dump({
        "name": "llm", "task": "generate", "model": {"pretrained": str(folder / "llm")},
        "cores_per_replica": tensor_parallel_size,
        "generation": {**GENERATION, "tensor_parallel_size": tensor_parallel_size,
                       "lora": {"max_loras": len(ADAPTERS), "max_lora_rank": RANK, "allow_runtime_updates": True,
                                "lora_modules": {n: f"adapters/{n}" for n in ADAPTERS}}}}))
    cli = str(Path(sys.executable).with_name("neuron-serve"))
    spec = servers.ServerSpec("neuron-serve-lora", "neuron-serve",
                              [cli, "deploy", str(path), "--host", "127.0.0.1", "--port", str(PORT), "--no-grpc"],
                              PORT, startup_s=2400, replica_marker="ray::ServeReplica:", ready_line=servers.READY_LINE)
    return OpenAIServer(spec, folder / "logs")


def bodies(models: list[str], count: int, vocab: int) -> list[dict]:
    import random  # noqa: PLC0415

    rng = random.Random(0)
    return [{"model": models[i % len(models)], "prompt": [rng.randrange(1, vocab) for _ in range(PROMPT)],
             "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "stream": True,
             "stream_options": {"include_usage": True}} for i in range(count)]


def post(path: str, body: dict) -> tuple[float, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as answer:
        data = answer.read()
    return time.perf_counter() - started, data


def measure(folder: Path, rounds: int, log, tensor_parallel_size: int = 1) -> dict:
    from bench.generate import VOCAB  # noqa: PLC0415

    server = serve(folder, tensor_parallel_size)
    url = f"http://127.0.0.1:{PORT}/v1/completions"
    try:
        probe = json.dumps({"model": "llm", "prompt": [1, 2, 3], "max_tokens": 1}).encode()
        ready = server.wait_ready({"llm": (probe, {"Content-Type": "application/json"})})
        log(f"  served with 4 adapters: ready in {ready:.0f}s")
        warm = bodies(["llm", *ADAPTERS], STREAMS, VOCAB)
        asyncio.run(run_point(url, warm, STREAMS))  # every adapter read once, each bucket's first call made
        figures = {}
        for key, models in (("base", ["llm"]), ("adapters", ADAPTERS)):
            requests = bodies(models, STREAMS * rounds, VOCAB)
            results, wall = asyncio.run(run_point(url, requests, STREAMS))
            figures[key] = summarise(results, [{"max_tokens": NEW, "prompt_tokens": PROMPT}] * len(requests), wall)
            if figures[key]["errors"]:
                raise RuntimeError(f"{key}: {figures[key]['first_error']}")
            log(f"    {key:9s} {figures[key]['tokens_per_s']:8.1f} tok/s  TPOT p50 "
                f"{figures[key]['tpot_p50_s'] * 1e3:.2f} ms")
        load_s, answer = post("/v1/load_lora_adapter", {"lora_name": "late",
                                                        "lora_path": str(folder / "adapters" / "late")})
        first_s, _ = post("/v1/completions", {"model": "late", "prompt": [5] * PROMPT, "max_tokens": 1,
                                              "temperature": 0})
        again_s, _ = post("/v1/completions", {"model": "late", "prompt": [6] * PROMPT, "max_tokens": 1,
                                              "temperature": 0})
        figures["load"] = {"load_s": load_s, "first_request_s": first_s, "next_request_s": again_s,
                           "answer": answer.decode()}
        log(f"    load of a rank-{RANK} adapter {load_s * 1e3:.0f} ms; its first request {first_s * 1e3:.0f} ms "
            f"(the next {again_s * 1e3:.0f} ms)")
    finally:
        server.stop()
    figures["tensor_parallel_size"] = tensor_parallel_size
    figures["tpot_ratio"] = figures["adapters"]["tpot_p50_s"] / figures["base"]["tpot_p50_s"]
    figures["tokens_per_s_ratio"] = figures["adapters"]["tokens_per_s"] / figures["base"]["tokens_per_s"]
    return figures


def report(figures: dict) -> str:
    base, lora, load = figures["base"], figures["adapters"], figures["load"]
    verdict = "met" if figures["tpot_ratio"] <= TARGET_TPOT else "not met"
    return "\n".join([
        "## LoRA adapters (served over HTTP, one server)", "",
        f"{STREAMS} streams at once, {PROMPT}-token prompts, {NEW} new tokens each; rank-{RANK} adapters on every "
        f"attention and MLP projection, max_loras {len(ADAPTERS)}, tensor_parallel_size "
        f"{figures.get('tensor_parallel_size', 1)}.", "",
        "| workload | output tok/s | TPOT p50 |", "|---|---:|---:|",
        f"| {STREAMS} streams on the base | {base['tokens_per_s']:.1f} | {base['tpot_p50_s'] * 1e3:.2f} ms |",
        f"| {STREAMS} streams over {len(ADAPTERS)} adapters | {lora['tokens_per_s']:.1f} "
        f"({figures['tokens_per_s_ratio']:.2f}x) | {lora['tpot_p50_s'] * 1e3:.2f} ms "
        f"({figures['tpot_ratio']:.2f}x; target <= {TARGET_TPOT}: {verdict}) |", "",
        f"Loading a rank-{RANK} adapter while serving: `/v1/load_lora_adapter` answered in "
        f"{load['load_s'] * 1e3:.0f} ms (a replica read and checked it); its first request took "
        f"{load['first_request_s'] * 1e3:.0f} ms (its buffers written onto the core), the next "
        f"{load['next_request_s'] * 1e3:.0f} ms.", ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 8 streams a workload instead of 6")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, choices=(1, 2),
                        help="cores the model is split over (2: both of this machine's, one replica)")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    args = parser.parse_args(argv)
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_files(folder)
        figures = measure(folder, 2 if args.quick else 6, log, args.tensor_parallel_size)
    text = report(figures)
    (out / "lora.md").write_text(text)
    (out / "lora.json").write_text(json.dumps(figures, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
