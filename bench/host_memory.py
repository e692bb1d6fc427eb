"""Host memory of a deployment whose compiled models grow in number: weights held once, whatever the buckets.

    python -m bench.host_memory [--cases smollm2 smollm2-int8 embedder llama-1b] [--out DIR] [--quick]

Each case is deployed alone with ``neuron-serve deploy`` (a fresh compile cache) and measured once its background
compile has finished: the resident memory of every process of the deployment (sampled twice a second from the
launch, so the peaks are there too), the process that compiles and runs the model (a generate model's engine
process; a pooling model's replica), what the model's metadata says it holds (``parameters.host_memory``) and each
compiled model's compile time (``neuron_serve_compile_seconds``). A greedy completion (or an embedding) is checked
against transformers (or sentence-transformers) on the same weights, and the deploy's log against Ray's memory
monitor ("killed due to memory pressure").

- ``smollm2``: the model.yaml a newcomer writes for SmolLM2-135M-Instruct (``make llm-example``): max_num_seqs 16,
  max_model_len 512, every bucket list left to its defaults (24 compiled models).
- ``smollm2-int8``: the same with ``quantization: int8`` (the weights held once, in int8).
- ``embedder``: deployments/embedder.yaml (all-MiniLM-L6-v2, ``make embed-example``).
- ``llama-1b``: a Llama-3.2-1B-shaped model (its config, random weights, bfloat16; nothing downloaded) with
  ``tensor_parallel_size: 2`` over two emulated cores, max_num_seqs 8, max_model_len 1024, every default bucket.

Ray's dashboard is left out (``--no-ray-dashboard``: about 1.3 GiB of its own processes, whatever is served). The
targets are printed beside each figure: the compiling process at most 1.5 x (weights + KV cache) +
1 GiB, the whole deployment at most 4 GiB, each further compiled model at most 10% of the weights' bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from . import servers
from .startup import Deploy

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENTS = ROOT / "deployments"
GIB = 1 << 30
KILLED = "killed due to memory pressure"
PROMPT, NEW_TOKENS = "The capital of France is", 12

CASES = {
    "smollm2": {"name": "llm", "task": "generate", "model": {"pretrained": str(DEPLOYMENTS / "llm")},
                "generation": {"max_num_seqs": 16, "max_model_len": 512}},
    "smollm2-int8": {"name": "llm-int8", "task": "generate", "model": {"pretrained": str(DEPLOYMENTS / "llm")},
                     "generation": {"max_num_seqs": 16, "max_model_len": 512, "quantization": "int8"}},
    "embedder": None,  # deployments/embedder.yaml as it is
    "llama-1b": {"name": "llama-1b", "task": "generate", "model": {"pretrained": "llama-1b"}, "dtype": "bfloat16",
                 "cores_per_replica": 2,
                 "generation": {"max_num_seqs": 8, "max_model_len": 1024, "tensor_parallel_size": 2}},
}
TIMEOUT_S = {"smollm2": 3600, "smollm2-int8": 3600, "embedder": 1800, "llama-1b": 3 * 3600}


def llama_1b(folder: Path) -> Path:
    """Llama-3.2-1B's config (16 layers, hidden 2048, 32 heads over 8 key/value heads, vocabulary 128256, tied
    embeddings, llama3 RoPE scaling) with random weights in bfloat16, saved with save_pretrained; once."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    if (folder / "config.json").exists():
        return folder
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001, dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # random weights: every completion runs to max_tokens
    model.save_pretrained(folder)
    words_tokenizer(config.vocab_size).save_pretrained(folder)
    print(f"wrote {folder}: a Llama-3.2-1B-shaped model ({sum(p.numel() for p in model.parameters()):,} "
          f"parameters, bfloat16, random weights)", file=sys.stderr, flush=True)
    return folder


def words_tokenizer(vocab_size: int):
    """A tokenizer of ``vocab_size`` words, one a token id ("t123"): no tokenizer of a 128k vocabulary ships here,
    and with this one a completion's text gives back its ids exactly."""
    import tokenizers  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()  # decoded back joined by spaces
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0")


def config_path(case: str, work: Path) -> Path:
    if CASES[case] is None:
        return DEPLOYMENTS / f"{case}.yaml"
    folder = work / case
    folder.mkdir(parents=True, exist_ok=True)
    if case == "llama-1b":
        llama_1b(work / "llama-1b-model")
        (folder / "llama-1b").symlink_to(work / "llama-1b-model")
    path = folder / "model.yaml"
    path.write_text(yaml.safe_dump(CASES[case], sort_keys=False))
    return path


class Sampler(threading.Thread):
    """Every process of the deployment's resident memory, twice a second: now, and each kind's peak."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self.peak_total = root, {}, 0.0
        self.stopped = threading.Event()

    def sample(self) -> dict[str, float]:
        kinds: dict[str, float] = {}
        for cmdline, mib in servers._tree(self.root):  # noqa: SLF001 - the deploy's own process tree
            kind = _kind(cmdline)
            kinds[kind] = kinds.get(kind, 0.0) + mib * (1 << 20)
        return kinds

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            kinds = self.sample()
            for kind, value in kinds.items():
                self.peak[kind] = max(self.peak.get(kind, 0.0), value)
            self.peak_total = max(self.peak_total, sum(kinds.values()))


def _kind(cmdline: str) -> str:
    if "neuron_serve.generation.process.worker" in cmdline:
        return "engine process"
    if cmdline.startswith("ray::ServeReplica:"):
        return "replica"
    if "neuron-serve deploy" in cmdline or "neuron_serve.cli" in cmdline:
        return "deploy (Ray driver)"
    return "Ray's own processes"


def _compiled(deploy: Deploy, name: str) -> dict | None:
    meta = deploy.get(f"/v2/models/{name}")
    if meta is None:
        return None
    state = meta["parameters"]["compile"]
    return meta if not state.get("pending") else None


def _compile_seconds(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("neuron_serve_compile_seconds{"):
            labels, value = line.rsplit(" ", 1)
            bucket = labels.split('bucket="', 1)[1].split('"', 1)[0]
            found[bucket] = max(found.get(bucket, 0.0), float(value))
    return found


def _check_answer(deploy: Deploy, config: Path) -> str:
    """A greedy completion against transformers' on the same weights, or an embedding against encode."""
    from neuron_serve.config.schema import load_deployment  # noqa: PLC0415

    parsed, base = load_deployment(config)
    if parsed.task == "generate":
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415

        folder = Path(base) / parsed.model.pretrained
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        words = tok.decode([0]) == "t0"  # the 1B-shaped model's words: one a token id
        ids = list(range(100, 116)) if words else tok(PROMPT).input_ids
        body = {"model": parsed.name, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        answer = deploy.post(json.dumps(body).encode(), timeout=600)
        if answer is None or parsed.generation.quantization is not None:  # int8 is held to its own reference
            return "answered" if answer is not None else "no answer"
        served = answer["choices"][0]["text"]
        dtype = torch.bfloat16 if parsed.dtype == "bfloat16" else torch.float32
        lm = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
        with torch.no_grad():
            out = lm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)
        want = out[0, len(ids):].tolist()
        if not words:
            text = tok.decode(want, skip_special_tokens=True)
            return "equal to transformers" if served == text else f"differs: {served!r} against {text!r}"
        got = [int(w[1:]) for w in served.split()]
        if got == want:
            return "equal to transformers"
        # bfloat16 rounds differently in XLA:CPU (elementwise steps kept in float32) and in eager PyTorch: where they
        # part, how far apart the two tokens were in transformers' own logits says whether it is a near tie
        at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        with torch.no_grad():
            logits = lm(torch.tensor([ids + want[:at]])).logits[0, -1].float()
        gap = float(logits[want[at]] - logits[got[at]])
        return (f"first {at} of {NEW_TOKENS} tokens equal to transformers; then a near tie in bfloat16 "
                f"(transformers' logit of its token {gap:.3f} above ours)")
    body = {"model": parsed.name, "input": ["neuron-serve holds the weights once"]}
    request = urllib.request.Request(f"http://127.0.0.1:{deploy.port}/v1/embeddings", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as reply:
        served = json.load(reply)["data"][0]["embedding"]
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415

    want = SentenceTransformer(str(Path(base) / parsed.model.pretrained), device="cpu").encode(body["input"])[0]
    worst = max(abs(a - b) for a, b in zip(served, want.tolist()))
    return f"equal to encode within {worst:.1e}"


def measure(case: str, work: Path, logs: Path) -> dict:
    config = config_path(case, work)
    cache = work / f"cache-{case}"
    # Without Ray's dashboard (deploy's --no-ray-dashboard): its dozen processes take about 1.3 GiB whatever is
    # served; the figures are the deployment's own.
    deploy = Deploy(config, cache, logs, extra=("--no-ray-dashboard",))
    sampler = Sampler(deploy.server.proc.pid)
    sampler.start()
    name = deploy.name
    try:
        deadline = time.monotonic() + TIMEOUT_S[case]
        meta = None
        while meta is None:
            if deploy.server.proc.poll() is not None:
                raise RuntimeError(f"{case}: the deploy exited ({deploy.server.proc.returncode}); see "
                                   f"{deploy.server.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{case}: still compiling after {TIMEOUT_S[case]} s; see {deploy.server.log_path}")
            time.sleep(5)
            meta = _compiled(deploy, name)
        ready_s = deploy.seconds
        time.sleep(5)  # the last compile's memory settles (the engine process trims its heap after each)
        meta = _compiled(deploy, name) or meta
        now = sampler.sample()
        answer = _check_answer(deploy, config)
        seconds = _compile_seconds(deploy.port)
        killed = KILLED in deploy.log()
    finally:
        sampler.stopped.set()
        deploy.stop()
    host = meta["parameters"].get("host_memory", {})
    compiled = host.get("compiled_models_bytes", {})
    # The first compiled model also starts the runtime and touches what every later one shares: the further ones
    # are what a compiled model joining costs.
    ordered = [v for k, v in compiled.items() if not k.startswith("copy onto")]
    first = ordered[0] if ordered else 0
    each = sorted(ordered[1:])
    compiling = "engine process" if "engine process" in now else "replica"
    weights = host.get("weights_bytes", 0)
    cache_bytes = host.get("kv_cache_bytes", 0)
    return {
        "case": case, "model": name, "compiled_models": meta["parameters"]["compile"].get("compiled"),
        "failed": meta["parameters"]["compile"].get("failed"), "all_compiled_s": ready_s,
        "processes_now_bytes": now, "processes_peak_bytes": sampler.peak, "total_now_bytes": sum(now.values()),
        "total_peak_bytes": sampler.peak_total, "compiling_process": compiling, "host_memory": host,
        "weights_bytes": weights, "kv_cache_bytes": cache_bytes,
        "further_model_median_bytes": each[len(each) // 2] if each else None,
        "further_model_max_bytes": max(each) if each else None, "first_model_bytes": first,
        "compile_seconds": seconds, "answer": answer, "killed_by_memory_monitor": killed,
        "targets": {
            "compiling process <= 1.5 x (weights + KV) + 1 GiB":
                now.get(compiling, 0) <= 1.5 * (weights + cache_bytes) + GIB,
            "deployment <= 4 GiB": sum(now.values()) <= 4 * GIB,
            "each further compiled model <= 10% of the weights": bool(each) and max(each) <= 0.1 * weights,
        },
    }


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f} GiB"


def table(rows: list[dict]) -> str:
    lines = ["| case | compiled models | all compiled after | compiling process now (peak) | deployment now (peak) | "
             "weights + KV | each further compiled model (median / max) | compile s per model (median) | answer |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        seconds = sorted(r["compile_seconds"].values())
        median = seconds[len(seconds) // 2] if seconds else None
        compiling = r["compiling_process"]
        lines.append(
            f"| {r['case']} | {r['compiled_models']} ({r['failed']} failed) | {r['all_compiled_s']:.0f} s | "
            f"{gib(r['processes_now_bytes'].get(compiling))} ({gib(r['processes_peak_bytes'].get(compiling))}) | "
            f"{gib(r['total_now_bytes'])} ({gib(r['total_peak_bytes'])}) | "
            f"{gib(r['weights_bytes'])} + {gib(r['kv_cache_bytes'])} | "
            f"{(r['further_model_median_bytes'] or 0) / (1 << 20):.0f} / {(r['further_model_max_bytes'] or 0) / (1 << 20):.0f} MiB "
            f"({100 * (r['further_model_max_bytes'] or 0) / max(r['weights_bytes'], 1):.0f}% of the weights) | "
            f"{'-' if median is None else f'{median:.1f}'} | {r['answer']}{'; KILLED' if r['killed_by_memory_monitor'] else ''} |")
    lines += ["", "Targets (issue): " + "; ".join(
        f"{r['case']}: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in r["targets"].items())
        for r in rows)]
    lines += ["", "Processes now, by kind: " + "; ".join(
        f"{r['case']}: " + ", ".join(f"{k} {gib(v)}" for k, v in sorted(r["processes_now_bytes"].items()))
        for r in rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="SmolLM2 and the embedder only")
    args = parser.parse_args(argv)
    cases = args.cases or (["smollm2", "embedder"] if args.quick else list(CASES))
    out = args.out or Path(tempfile.mkdtemp(prefix="host-memory-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="host-memory-work-"))
    rows = []
    for case in cases:
        print(f"host memory: {case} (deployed alone, measured once everything has compiled)", file=sys.stderr,
              flush=True)
        try:
            rows.append(measure(case, work, out / "logs"))
        except Exception as exc:  # noqa: BLE001 - one case's failure is reported, the others still run
            print(f"  {case} failed: {exc}", file=sys.stderr, flush=True)
            rows.append({"case": case, "error": str(exc)})
    good = [r for r in rows if "error" not in r]
    text = "## Host memory: weights held once, whatever the number of compiled models\n\n" + table(good)
    text += "".join(f"\n\n{r['case']}: {r['error']}" for r in rows if "error" in r)
    (out / "host_memory.md").write_text(text + "\n")
    (out / "host_memory.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)
    return 0 if good and len(good) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
