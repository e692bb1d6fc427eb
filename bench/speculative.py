"""What speculative decoding does to time per output token, served over HTTP.

    python -m bench.speculative [--quick] [--out DIR] [--method ngram|draft|both]   # both: a part of python -m bench

The generation benchmark's Llama (4 layers, hidden 256, vocabulary 2048; random weights,
bench/generate.py) with a tokenizer of its vocabulary, served by ``neuron-serve deploy``
twice, one server at a time: without ``generation.speculative_config`` and with
``{method: ngram, num_speculative_tokens: 4}``, every other setting the same.

Workload: repetitive prompts (a random phrase of 6 tokens repeated to 60 tokens), greedy,
``ignore_eos``, 96 new tokens. A random model's greedy output falls into loops of its own,
which n-gram lookup then proposes; the acceptance rate is reported from the server's
metrics. Figures:

- a lone stream: time per output token, p50 over the requests ((last chunk - first chunk)
  / (tokens - 1)). Target with speculation: at most 0.7x without;
- 32 streams at once: output tokens/s (reported beside no speculation; it may be lower).

The draft method (``--method draft``): the same workload shape on random prompts, a
target and a draft built to agree often (:func:`write_draft_pair` says how, and at what
rate), served without speculation and with ``{model: draft, num_speculative_tokens: 4}``.
Target: a lone stream's time per output token at most 0.5x without.

Writes speculative.md (printed too) and speculative.json.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from .generate_http import run_point
from .prefix_caching import serve, write_model

os.environ.setdefault("PJRT_DEVICE", "CPU")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PORT = 18840
K = 4
NEW_TOKENS = 96
TARGETS = {"ngram": 0.7, "draft": 0.5}
GENERATION = {"max_num_seqs": 32, "max_model_len": 512, "prefill_buckets": [32, 128, 512],
              "decode_batch_buckets": [1, 8, 32], "decode_context_buckets": [128, 512]}


DAMPING = 0.02  # how little each layer adds to the residual stream, in the target and in the draft
DRAFT_HIDDEN = 64


def write_draft_pair(folder: Path) -> None:
    """A target and a much smaller draft that agree often, in ``folder``/llm and ``folder``/draft.

    Random weights agree rarely, so the pair is built. The draft is a 1-layer Llama of
    hidden size 64 (about a twentieth of the target's work a token); the target is the
    benchmark's 4-layer, hidden-256 Llama whose embedding and LM head are the draft's
    mapped into a 64-dimensional subspace of its hidden space (E P and W P, P with
    orthonormal rows), so the two compute the same logits up to a positive scale from
    the embeddings alone. Both models' layers have their output projections (attention's
    o_proj, the MLP's down_proj) scaled by DAMPING: they add little to the residual
    stream, and the greedy choices differ where they tip it. Measured with eager
    transformers on random prompts (each model's next token along the target's greedy
    output): 89% agree at DAMPING 0.02, 69% at 0.05, 94% at 0.01 (whose output loops
    over 7 tokens)."""
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    from bench.generate import build_lm  # noqa: PLC0415
    from bench.openai_fields import _tokenizer  # noqa: PLC0415

    target = build_lm()
    hidden = target.config.hidden_size
    generator = torch.Generator().manual_seed(5)
    subspace = torch.linalg.qr(torch.randn(hidden, DRAFT_HIDDEN, generator=generator))[0].T  # (64, 256)
    config = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1, "hidden_size": DRAFT_HIDDEN,
                            "intermediate_size": 4 * DRAFT_HIDDEN, "num_attention_heads": 2,
                            "num_key_value_heads": 2, "head_dim": DRAFT_HIDDEN // 2})
    torch.manual_seed(1)
    draft = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(draft.model.embed_tokens.weight @ subspace)
        target.lm_head.weight.copy_(draft.lm_head.weight @ subspace)
        for layer in [*target.model.layers, *draft.model.layers]:
            layer.self_attn.o_proj.weight.mul_(DAMPING)
            layer.mlp.down_proj.weight.mul_(DAMPING)
    tokenizer = _tokenizer(target.config.vocab_size)
    for name, model in (("llm", target), ("draft", draft)):
        model.generation_config.eos_token_id = None
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        phrase = [rng.randrange(1, vocab) for _ in range(6)]
        out.append((phrase * 10)[:60])
    return out


def stream_tpot(prompt: list[int]) -> tuple[float, int]:
    """(time per output token, tokens) of one streamed request on its own connection."""
    body = json.dumps({"model": "llm", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", PORT, timeout=300)
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    if answer.status != 200:
        raise RuntimeError(f"HTTP {answer.status}: {answer.read()[:200]!r}")
    stamps, tokens = [], 0
    for line in answer:
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[5:])
        if event.get("choices"):
            stamps.append(time.perf_counter())
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    connection.close()
    return (stamps[-1] - stamps[0]) / (tokens - 1), tokens


def metric(name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def measure(speculate: bool, lone: list[list[int]], many: list[list[int]], folder: Path, log,
            draft: bool = False) -> dict:
    generation = dict(GENERATION)
    if speculate:
        generation["speculative_config"] = {"model": str(folder / "draft"), "num_speculative_tokens": K} if draft \
            else {"method": "ngram", "num_speculative_tokens": K}
    server = serve(folder, "speculative" if speculate else "plain", generation, PORT)
    probe = json.dumps({"model": "llm", "prompt": [1, 2, 3], "max_tokens": 2}).encode()
    try:
        ready = server.wait_ready({"llm": (probe, {"Content-Type": "application/json"})})
        log(f"  {'with' if speculate else 'without'} speculation: ready in {ready:.0f}s")
        stream_tpot(lone[0])  # warm-up: the buckets' first calls
        drafted, accepted = metric("neuron_serve_spec_decode_num_draft_tokens_total"), \
            metric("neuron_serve_spec_decode_num_accepted_tokens_total")
        tpots = [stream_tpot(p)[0] for p in lone]
        drafted = metric("neuron_serve_spec_decode_num_draft_tokens_total") - drafted
        accepted = metric("neuron_serve_spec_decode_num_accepted_tokens_total") - accepted
        bodies = [{"model": "llm", "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                   "stream": True, "stream_options": {"include_usage": True}} for p in many]
        results, wall = asyncio.run(run_point(f"http://127.0.0.1:{PORT}/v1/completions", bodies, 32))
        errors = [r["error"] for r in results if r["error"]]
        if errors:
            raise RuntimeError(f"32 streams: {len(errors)} errors, the first: {errors[0]}")
        figures = {"tpot_p50_s": statistics.median(tpots), "tpot_s": tpots,
                   "tokens_per_s_32": sum(r["tokens"] for r in results) / wall,
                   "acceptance": accepted / drafted if drafted else None}
        log(f"    lone TPOT p50 {figures['tpot_p50_s'] * 1e3:.2f} ms; 32 streams {figures['tokens_per_s_32']:.0f} "
            f"tok/s" + (f"; {accepted:.0f} of {drafted:.0f} proposals accepted" if drafted else ""))
    finally:
        server.stop()
    return figures


def report(method: str, result: dict) -> str:
    plain, spec = result["without"], result["with"]
    ratio = spec["tpot_p50_s"] / plain["tpot_p50_s"]
    target = TARGETS[method]
    verdict = "met" if ratio <= target else "not met"
    throughput = spec["tokens_per_s_32"] / plain["tokens_per_s_32"]
    title, prompts = (("n-gram", "Repetitive prompts") if method == "ngram" else
                      (f"a draft model (hidden {DRAFT_HIDDEN}, 1 layer)", "Random prompts"))
    return "\n".join([
        f"## Speculative decoding, {title}, k = {K} (served over HTTP)", "",
        f"{prompts}, greedy, {NEW_TOKENS} new tokens; {spec['acceptance'] or 0:.0%} of proposals accepted.",
        "", "| figure | without | with | ratio |", "|---|---:|---:|---:|",
        f"| lone stream, TPOT p50 | {plain['tpot_p50_s'] * 1e3:.2f} ms | {spec['tpot_p50_s'] * 1e3:.2f} ms | "
        f"{ratio:.2f}x (target <= {target}: {verdict}) |",
        f"| 32 streams, output tokens/s | {plain['tokens_per_s_32']:.0f} | {spec['tokens_per_s_32']:.0f} | "
        f"{throughput:.2f}x |", ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 lone streams and 32 at once instead of 8 and 64")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    parser.add_argument("--method", choices=["ngram", "draft", "both"], default="both",
                        help="n-gram proposals on repetitive prompts, a draft model (write_draft_pair) on random "
                             "ones, or one after the other (default)")
    args = parser.parse_args(argv)
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, flush=True)

    from bench.generate import VOCAB  # noqa: PLC0415

    results, texts = {}, []
    for method in (["ngram", "draft"] if args.method == "both" else [args.method]):
        log(f"{method}:")
        lone = prompts(4 if args.quick else 8, VOCAB, seed=1)
        many = prompts(32 if args.quick else 64, VOCAB, seed=2)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            if method == "draft":  # random prompts: what the draft proposes is all the help there is
                write_draft_pair(folder)
                rng = random.Random(3)
                lone = [[rng.randrange(1, VOCAB) for _ in range(60)] for _ in lone]
                many = [[rng.randrange(1, VOCAB) for _ in range(60)] for _ in many]
            else:
                write_model(folder)
            results[method] = {"without": measure(False, lone, many, folder, log),
                               "with": measure(True, lone, many, folder, log, draft=method == "draft")}
        texts.append(report(method, results[method]))
    text = "\n".join(texts)
    (out / "speculative.md").write_text(text)
    (out / "speculative.json").write_text(json.dumps(results, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
