"""Where a pooling model's tokenization and pooling are cheapest: the measurements behind their placement.

    python -m bench.embed_placement [--quick] [--out DIR]   # also a part of python -m bench

In process, on bench/embeddings.py's model (all-MiniLM-L6-v2, mean pooling, normalised; XLA:CPU stands in for
the NeuronCore):

1. Pooling inside the compiled graph against on the host: the same encoder compiled twice,
   once ending in sentence-transformers' Pooling and Normalize (a vector a row comes back),
   once ending in the last hidden state (a vector a token comes back, pooled and normalised on
   the host by the same modules). Each compiled call is timed in turns with the other, which
   goes first changing every round (the fastest of N and the median), the host's pooling
   after it, and the bytes that cross.
2. Tokenization: a text through transformers' fast tokenizer call (what sentence-transformers
   does) against the Rust tokenizer's ``encode_batch`` straight (what neuron_serve.pooling.tokens
   does), and a hand-off of one text to a thread and back; then how far a Python loop on the
   main thread (the event loop's stand-in) gets while a large batch is tokenized on another,
   against the loop alone.

Writes embed_placement.md (printed too) and embed_placement.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import embeddings

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(1, 32), (16, 32), (16, 128)]  # (rows, tokens) of a compiled call


def _graphs(model_dir: Path):
    import torch  # noqa: PLC0415
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415

    from neuron_serve.pooling.graph import PoolingGraph  # noqa: PLC0415

    model = SentenceTransformer(str(model_dir), device="cpu")
    encoder, heads = model[0].auto_model, list(model)[1:]
    names = ("input_ids", "attention_mask")
    pooled = PoolingGraph(encoder, names, "last_hidden_state", "token_embeddings", heads, "sentence_embedding").eval()

    class TokenStates(torch.nn.Module):  # the encoder alone: a hidden state per token
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids, attention_mask):
            return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return pooled, TokenStates().eval(), heads


def pooling(model_dir: Path, calls: int) -> list[dict]:
    """Per shape: each graph's compiled call (fastest, median), the host pooling, and the bytes back."""
    import torch  # noqa: PLC0415

    import neuron_serve  # noqa: PLC0415

    pooled, states, heads = _graphs(model_dir)
    rows = []
    for batch, length in SHAPES:
        ids = torch.randint(5, 3000, (batch, length))
        mask = torch.ones_like(ids)
        mask[:, length * 3 // 4:] = 0  # a quarter of padding, as a length bucket leaves
        compiled = {"graph": neuron_serve.trace(pooled, (ids, mask)), "host": neuron_serve.trace(states, (ids, mask))}
        times = {"graph": [], "host": [], "host_pooling": []}
        for _ in range(2):
            for model in compiled.values():
                model(ids, mask)
        for call in range(calls):
            # In turns, first one then the other, so a burst of other work hits both alike.
            for kind, model in list(compiled.items())[::1 if call % 2 else -1]:
                started = time.perf_counter()
                out = model(ids, mask)
                ended = time.perf_counter()
                times[kind].append(ended - started)
                if kind == "host":
                    features = {"token_embeddings": out, "attention_mask": mask}
                    with torch.no_grad():
                        for head in heads:
                            features = head(features)
                    times["host_pooling"].append(time.perf_counter() - ended)
        hidden = out.shape[-1]
        rows.append({"rows": batch, "tokens": length,
                     **{f"{k}_min_ms": min(v) * 1e3 for k, v in times.items()},
                     **{f"{k}_median_ms": statistics.median(v) * 1e3 for k, v in times.items()},
                     "graph_bytes": batch * hidden * 4, "host_bytes": batch * length * hidden * 4})
    return rows


def tokenization(model_dir: Path, calls: int) -> dict:
    """Microseconds per text of each way of tokenizing, a thread hand-off, and whether encode_batch frees the GIL."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    backend = tokenizer.backend_tokenizer
    backend.no_truncation()
    backend.no_padding()
    texts = embeddings.workload(tokenizer, 64)

    def per_text(fn, batch: int) -> float:
        spent = []
        for i in range(calls):
            chunk = [texts[(i + j) % len(texts)] for j in range(batch)]
            started = time.perf_counter()
            fn(chunk)
            spent.append((time.perf_counter() - started) / batch)
        return statistics.median(spent) * 1e6

    found = {f"{name}_{batch}_us": per_text(fn, batch) for batch in (1, 16)
             for name, fn in (("transformers", tokenizer), ("rust", backend.encode_batch))}
    pool = ThreadPoolExecutor(1)

    async def handoffs() -> float:
        loop, spent = asyncio.get_running_loop(), []
        for i in range(calls):
            started = time.perf_counter()
            await loop.run_in_executor(pool, backend.encode_batch, [texts[i % len(texts)]])
            spent.append(time.perf_counter() - started)
        return statistics.median(spent) * 1e6

    found["thread_handoff_1_us"] = asyncio.run(handoffs())
    big = texts * 64

    def spin(seconds: float) -> int:
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            count += 1
        return count

    started = time.perf_counter()
    backend.encode_batch(big)
    seconds = time.perf_counter() - started
    alone = spin(seconds)
    worker = threading.Thread(target=backend.encode_batch, args=(big,))
    worker.start()
    beside = spin(seconds)
    worker.join()
    found.update(big_batch_texts=len(big), big_batch_ms=seconds * 1e3, loop_progress_beside_encode=beside / alone)
    pool.shutdown()
    return found


def report(figures: dict) -> str:
    lines = ["## Where tokenization and pooling run (bench/embed_placement.py)", "",
             "Pooling in the compiled graph against on the host (XLA:CPU for the core; ms, fastest and median of "
             f"{figures['calls']} calls each, in turns):", "",
             "| rows x tokens | graph with pooling | graph to token states | + host pooling | bytes back: graph / "
             "token states |", "|---|---:|---:|---:|---:|"]
    for r in figures["pooling"]:
        lines.append(f"| {r['rows']} x {r['tokens']} | {r['graph_min_ms']:.2f} / {r['graph_median_ms']:.2f} | "
                     f"{r['host_min_ms']:.2f} / {r['host_median_ms']:.2f} | {r['host_pooling_min_ms']:.3f} / "
                     f"{r['host_pooling_median_ms']:.3f} | {r['graph_bytes']:,} / {r['host_bytes']:,} |")
    t = figures["tokenization"]
    lines += ["", "Tokenization (µs per text, median):", "",
              "| texts a call | transformers' tokenizer call | Rust encode_batch |", "|---:|---:|---:|",
              f"| 1 | {t['transformers_1_us']:.1f} | {t['rust_1_us']:.1f} |",
              f"| 16 | {t['transformers_16_us']:.1f} | {t['rust_16_us']:.1f} |", "",
              f"One text handed to a thread, tokenized and back: {t['thread_handoff_1_us']:.1f} µs. While "
              f"{t['big_batch_texts']} texts ({t['big_batch_ms']:.0f} ms) were tokenized on another thread, a Python "
              f"loop on this one made {t['loop_progress_beside_encode']:.0%} of the progress it makes alone."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.embed_placement", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer calls per figure")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    args = parser.parse_args(argv)
    out = args.out or embeddings.RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    calls = 10 if args.quick else 30
    model_dir = embeddings.real_model()
    figures = {"calls": calls, "pooling": pooling(model_dir, calls), "tokenization": tokenization(model_dir, 200)}
    markdown = report(figures)
    (out / "embed_placement.md").write_text(markdown + "\n")
    (out / "embed_placement.json").write_text(json.dumps(figures, indent=2))
    print(markdown, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
