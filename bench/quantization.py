"""What each precision setting costs in accuracy and saves in memory, on a real model, as neuron-serve serves it.

    python -m bench.quantization [--quick] [--out DIR]    # also a part of python -m bench

SmolLM2-135M-Instruct (``make llm-example``: deployments/llm/, float32 weights read from its GGUF) compiled for
every ``dtype`` x ``quantization`` x ``kv_cache_dtype`` served (float32 and bfloat16; none, int8 and fp8 weights per
channel; the model's dtype and fp8 for the cache): 12 settings, 6 with ``--quick`` (float32 only). Each is the
compiled model, called as the engine calls it, on the fixed texts of bench/accuracy_texts.py (8 texts, 72 to 110
tokens), teacher-forced: every position's next-token distribution from the prefill that keeps every position's
logits (the one prompt logprobs run), compared with float32's unquantized:

- **top-1**: how often its most likely next token is float32's;
- **KL mean, p99**: KL(float32 || setting) of the next-token distributions, in nats, over every position;
- **perplexity** of the texts under the setting (float32's beside it);
- **greedy**: each text's first sentence continued greedily for 48 tokens; how many continuations equal float32's,
  and the first token where the others part (median);
- **memory**: the weights one core holds and the KV cache bytes of one slot of 2,048 positions (SmolLM2's, and
  Llama 3 8B's by the same arithmetic), and the slots of 2,048 positions that fit a 16 GiB core beside Llama 3 8B.

Writes quantization.md (printed too) and quantization.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LLM = ROOT / "deployments" / "llm"
MAX_MODEL_LEN = 128
GREEDY_TOKENS = 48
SLOT_POSITIONS = 2048
CORE_BYTES = 16 << 30
# Llama 3 8B: 32 layers, 8 key/value heads of 128, 8.03 B parameters of which 7.0 B in linear layers (the rest the
# embeddings and the LM head, kept unconverted).
LLAMA3_8B = {"layers": 32, "kv_heads": 8, "head_dim": 128, "linear": 6.98e9, "other": 1.05e9}


def settings(quick: bool) -> list[tuple[str, str | None, str]]:
    dtypes = ("float32",) if quick else ("float32", "bfloat16")
    return [(d, q, kv) for d in dtypes for q in (None, "int8", "fp8") for kv in ("auto", "fp8")]


def label(setting: tuple[str, str | None, str]) -> str:
    dtype, quantization, kv = setting
    return f"{dtype} / {quantization or 'none'} / {'fp8' if kv == 'fp8' else dtype}"


class Compiled:
    """One setting's compiled model (the prefill that keeps every position's logits) and what it holds."""

    def __init__(self, setting: tuple[str, str | None, str], tokenizer) -> None:
        from neuron_serve.config.schema import parse_config  # noqa: PLC0415
        from neuron_serve.generation.compiling.compile import GenerationBuild  # noqa: PLC0415
        from neuron_serve.generation.compiling.loading import load_lm  # noqa: PLC0415

        dtype, quantization, kv = setting
        generation = {"max_num_seqs": 1, "max_model_len": MAX_MODEL_LEN, "prefill_buckets": [MAX_MODEL_LEN],
                      "decode_batch_buckets": [1], "decode_context_buckets": [MAX_MODEL_LEN],
                      "on_device_sampling": False, "kv_cache_dtype": kv,
                      **({"quantization": quantization} if quantization else {})}
        config = parse_config({"name": "accuracy", "task": "generate", "model": {"pretrained": str(LLM)},
                               "dtype": dtype, "generation": generation})
        started = time.perf_counter()
        self.lm = load_lm(config, tokenizer=tokenizer)
        self.model = GenerationBuild(self.lm, config.generation.to_buckets(self.lm.config),
                                     name=label(setting)).start_scoring()
        self.compile_seconds = time.perf_counter() - started

    def logits(self, ids: list[int]):
        """Every position's logits (len(ids), vocab), float32, through the compiled prefill."""
        return self.model.prefill_scored(ids, 0)[2]

    def greedy(self, ids: list[int], new: int) -> list[int]:
        """``new`` greedy tokens after ``ids``, each from a prefill of everything before it."""
        out: list[int] = []
        for _ in range(new):
            out.append(int(self.logits(ids + out)[-1].argmax()))
        return out

    def parts_from(self, ids: list[int], continuation: list[int]) -> int | None:
        """Where this model's greedy continuation of ``ids`` first differs from ``continuation`` (None: nowhere):
        up to there both are the same sequence, so one teacher-forced pass over ``ids + continuation`` finds the
        first position whose argmax is not the continuation's token."""
        chosen = self.logits(ids + continuation)[len(ids) - 1:-1].argmax(-1).tolist()
        return next((i for i, (a, b) in enumerate(zip(continuation, chosen)) if a != b), None)


def compare(reference: dict, measured: dict) -> dict:
    """Top-1 agreement, KL (mean, p99) against the reference's distributions, perplexity, greedy divergence."""
    import torch  # noqa: PLC0415

    agree, kls, nll = [], [], []
    for ref_logits, logits, ids in zip(reference["logits"], measured["logits"], measured["ids"]):
        p, q = torch.log_softmax(ref_logits[:-1], -1), torch.log_softmax(logits[:-1], -1)
        agree.append((p.argmax(-1) == q.argmax(-1)).float())
        kls.append((p.exp() * (p - q)).sum(-1))
        nll.append(-q.gather(1, torch.tensor(ids[1:])[:, None])[:, 0])
    agree, kls, nll = torch.cat(agree), torch.cat(kls).clamp(min=0), torch.cat(nll)
    parted = measured["parted"]
    differing = sorted(i for i in parted if i is not None)
    return {"top1": float(agree.mean()), "kl_mean": float(kls.mean()), "kl_p99": float(kls.quantile(0.99)),
            "perplexity": float(nll.mean().exp()), "greedy_equal": sum(i is None for i in parted),
            "greedy_first_divergence_median": differing[len(differing) // 2] if differing else None,
            "positions": int(agree.numel())}


def memory(compiled: Compiled, setting: tuple[str, str | None, str]) -> dict:
    """Bytes a core holds for SmolLM2 (measured: the model's own account) and for Llama 3 8B (by arithmetic)."""
    from neuron_serve.generation.runner.slots import cache_element_bytes, kv_cache_bytes  # noqa: PLC0415

    dtype, quantization, kv = setting
    element = cache_element_bytes(compiled.lm)
    compute = 4 if dtype == "float32" else 2
    linear = 1 if quantization else compute
    big = LLAMA3_8B
    big_weights = big["linear"] * linear + big["other"] * compute
    big_slot = 2 * big["layers"] * big["kv_heads"] * big["head_dim"] * SLOT_POSITIONS * (1 if kv == "fp8" else compute)
    return {"weights": compiled.model.weight_bytes, "kv_slot": kv_cache_bytes(compiled.lm.config, 1, SLOT_POSITIONS,
                                                                               element),
            "llama3_8b_weights": int(big_weights), "llama3_8b_kv_slot": big_slot,
            "llama3_8b_slots": max(0, int((CORE_BYTES - big_weights) // big_slot))}


def run(quick: bool) -> list[dict]:
    from transformers import AutoTokenizer  # noqa: PLC0415

    from bench.accuracy_texts import PROMPTS, TEXTS  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(LLM)
    texts = [tokenizer(t)["input_ids"][:MAX_MODEL_LEN] for t in TEXTS]
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    rows, reference = [], None
    for setting in settings(quick):
        compiled = Compiled(setting, tokenizer)
        started = time.perf_counter()
        if reference is None:  # float32 unquantized: the continuations every other setting is held to
            continuations = [compiled.greedy(ids, GREEDY_TOKENS) for ids in prompts]
        measured = {"ids": texts, "logits": [compiled.logits(ids) for ids in texts],
                    "parted": [compiled.parts_from(ids, c) for ids, c in zip(prompts, continuations)]}
        seconds = time.perf_counter() - started
        reference = reference or measured
        row = {"setting": label(setting), "dtype": setting[0], "quantization": setting[1],
               "kv_cache_dtype": setting[2], **compare(reference, measured), **memory(compiled, setting),
               "compile_s": compiled.compile_seconds, "score_s": seconds}
        print(f"  {row['setting']:28s} top-1 {row['top1']:.4f}  KL {row['kl_mean']:.5f} (p99 {row['kl_p99']:.4f})  "
              f"ppl {row['perplexity']:.3f}  greedy equal {row['greedy_equal']}/{len(prompts)}", flush=True)
        rows.append(row)
    return rows


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB" if n < (1 << 30) else f"{n / (1 << 30):,.2f} GiB"


def markdown(rows: list[dict]) -> str:
    lines = ["| dtype / weights / KV cache | top-1 | KL mean | KL p99 | perplexity | greedy equal (first divergence) "
             "| SmolLM2 weights a core | KV a slot (2,048) | Llama 3 8B: weights, slots that fit 16 GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        parted = f" ({r['greedy_first_divergence_median']})" if r["greedy_first_divergence_median"] is not None else ""
        lines.append(f"| {r['setting']} | {r['top1']:.4f} | {r['kl_mean']:.5f} | {r['kl_p99']:.4f} | "
                     f"{r['perplexity']:.3f} | {r['greedy_equal']}/8{parted} | {_mib(r['weights'])} | "
                     f"{_mib(r['kv_slot'])} | {_mib(r['llama3_8b_weights'])}, {r['llama3_8b_slots']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quantization", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="float32 only: 6 settings")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    args = parser.parse_args(argv)
    if not (LLM / "config.json").is_file():
        print("bench.quantization: deployments/llm/ is missing; run `make llm-example` first", file=sys.stderr)
        return 2
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    rows = run(args.quick)
    table = markdown(rows)
    head = (f"Quantization on SmolLM2-135M-Instruct, teacher-forced on {rows[0]['positions']} positions of 8 texts "
            f"against float32 unquantized; greedy: 8 prompts, {GREEDY_TOKENS} tokens each (python -m "
            f"bench.quantization{' --quick' if args.quick else ''}).")
    (out / "quantization.md").write_text(head + "\n\n" + table + "\n")
    (out / "quantization.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(head + "\n\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
