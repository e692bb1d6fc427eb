"""What structured outputs and prompt logprobs cost the engine, in process.

    python -m bench.openai_fields [--quick] [--out DIR]    # also a part of python -m bench

The generation benchmark's Llama (4 layers, hidden 256, vocabulary 2048; random weights)
and a byte-level BPE tokenizer of the same vocabulary trained here, one engine on one
emulated core (one XLA:CPU thread), nothing else running:

- a lone greedy stream of 64 tokens, unconstrained, then held to a JSON schema (an
  object of one free string, which a random model fills to ``max_tokens``): the median
  time per output token of each, and their ratio (target at most 1.2x);
- a 200-token prompt prefilled alone (``max_tokens`` 1), then with ``echo``'s prompt
  logprobs (its prefill keeps every position's logits, compiled at the first request and
  left out of the figures): the median time to the first token of each.

Writes openai_fields.md (printed too) and openai_fields.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
TPOT_TARGET = 1.2


def _tokenizer(vocab: int):
    import tokenizers  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    text = (ROOT / "README.md").read_text()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _times(engine, prompt: list[int], params) -> list[float]:
    """Token arrival times of one request, alone."""
    stamps: list[float] = []
    done = threading.Event()

    def sink(event) -> None:
        if event.token is not None:
            stamps.append(time.perf_counter())
        if event.finished:
            done.set()

    started = time.perf_counter()
    engine.submit(prompt, params, sink)
    done.wait(600)
    return [started, *stamps]


def measure(repeats: int) -> dict:
    from bench.generate import build_lm  # noqa: PLC0415
    from neuron_serve.generation import SamplingParams, engine_for  # noqa: PLC0415
    from neuron_serve.generation.frontend.structured import Constraint  # noqa: PLC0415
    from neuron_serve.targets.pjrt import start_emulated_cores_on_threads  # noqa: PLC0415

    start_emulated_cores_on_threads(1)
    lm = build_lm()
    vocab = lm.config.vocab_size
    engine = engine_for(lm, max_num_seqs=4, max_model_len=512, prefill_buckets=[32, 256, 512],
                        decode_batch_buckets=[1, 4], decode_context_buckets=[128, 512], tokenizer=_tokenizer(vocab))
    prompt = list(range(1, 9))
    long = [(i * 7919) % (vocab - 1) + 1 for i in range(200)]
    free = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    held = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, structured=Constraint("json_schema", SCHEMA))
    first, echo = SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=1, temperature=0,
                                                                               prompt_logprobs=1)
    try:
        for params in (free, held, first, echo):  # warm-up: every bucket's first call, echo's compile
            _times(engine, long if params in (first, echo) else prompt, params)
        tpot = {}
        for name, params in (("unconstrained", free), ("json_schema", held)):
            gaps = []
            for _ in range(repeats):
                stamps = _times(engine, prompt, params)[1:]
                gaps.append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])))
            tpot[name] = statistics.median(gaps)
        ttft = {}
        for name, params in (("prefill", first), ("prefill_with_prompt_logprobs", echo)):
            firsts = []
            for _ in range(repeats):
                started, token = _times(engine, long, params)[:2]
                firsts.append(token - started)
            ttft[name] = statistics.median(firsts)
    finally:
        engine.close()
    return {"tpot_s": tpot, "ttft_s": ttft,
            "json_schema_tpot_ratio": tpot["json_schema"] / tpot["unconstrained"],
            "echo_prefill_ratio": ttft["prefill_with_prompt_logprobs"] / ttft["prefill"]}


def report(result: dict) -> str:
    tpot, ttft = result["tpot_s"], result["ttft_s"]
    met = "met" if result["json_schema_tpot_ratio"] <= TPOT_TARGET else "not met"
    return "\n".join([
        "## Structured outputs and prompt logprobs (engine in process, one emulated core)", "",
        "| figure | without | with | ratio |", "|---|---:|---:|---:|",
        f"| TPOT of a lone stream, json_schema | {tpot['unconstrained'] * 1e3:.2f} ms | "
        f"{tpot['json_schema'] * 1e3:.2f} ms | {result['json_schema_tpot_ratio']:.2f}x (target <= {TPOT_TARGET}: "
        f"{met}) |",
        f"| first token of a 200-token prompt, echo's prompt logprobs | {ttft['prefill'] * 1e3:.2f} ms | "
        f"{ttft['prefill_with_prompt_logprobs'] * 1e3:.2f} ms | {result['echo_prefill_ratio']:.2f}x |", ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.openai_fields", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 9")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    args = parser.parse_args(argv)
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    result = measure(3 if args.quick else 9)
    text = report(result)
    (out / "openai_fields.md").write_text(text)
    (out / "openai_fields.json").write_text(json.dumps(result, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
