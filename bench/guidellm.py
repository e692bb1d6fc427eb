"""guidellm, vLLM's load generator for OpenAI servers, against the served LLM example.

    python -m bench.guidellm [--quick] [--out DIR]    # also a part of python -m bench

Serves deployments/llm.yaml (``make llm-example``: a small Llama with random weights and its
byte-level BPE tokenizer; the model directory made absolute in ``<out>/guidellm-llm.yaml``,
nothing else changed) and runs ``guidellm run`` against it with guidellm's defaults where
there is one: its OpenAI HTTP backend (streamed ``/v1/chat/completions``, ``ignore_eos``,
``stream_options.continuous_usage_stats``; it checks ``GET /health`` and reads the model's
name from ``GET /v1/models`` first), synthetic text prompts of 128 tokens asking for 64 (the
chat template adds 3, so the longest request fits the example's 256 positions), and a
concurrent profile of 4 streams for 30 seconds (10 with ``--quick``). The tokenizer is the
local model directory and the Hugging Face hub is switched off (HF_HUB_OFFLINE), so nothing
is downloaded.

Prints guidellm's own report, then its figures (requests successful, errored and incomplete;
requests/s, output tokens/s; TTFT, ITL and TPOT p50 and p99); writes guidellm.md,
guidellm.json (the figures) and guidellm-report.json (guidellm's whole report). Exits 1 when
guidellm reports any errored request, or failed, or the server did not start; requests still
in flight when the time is up are guidellm's ``incomplete``, not errors.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import servers
from .generate_http import OpenAIServer

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODEL_DIR = ROOT / "deployments" / "llm"
PORT = 18820
STREAMS = 4
PROMPT_TOKENS, OUTPUT_TOKENS = 128, 64
SECONDS = {"full": 30, "quick": 10}


def write_yaml(model_dir: Path, path: Path) -> None:
    """deployments/llm.yaml with the model directory absolute (the file is written elsewhere)."""
    import yaml  # noqa: PLC0415

    config = yaml.safe_load((ROOT / "deployments" / "llm.yaml").read_text())
    config["model"]["pretrained"] = str(model_dir.resolve())
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def spec(llm_yaml: Path) -> servers.ServerSpec:
    neuron_serve = str(Path(sys.executable).with_name("neuron-serve"))
    return servers.ServerSpec("neuron-serve", "neuron-serve (OpenAI API)",
                              [neuron_serve, "deploy", str(llm_yaml), "--host", "127.0.0.1", "--port", str(PORT),
                               "--no-grpc"], PORT, startup_s=2400, replica_marker="ray::ServeReplica:",
                              ready_line=servers.READY_LINE)


def guidellm_command(model_dir: Path, seconds: float, report: Path) -> list[str]:
    """``guidellm run`` against the server: its defaults but for the target, profile, length, data and tokenizer."""
    return [str(Path(sys.executable).with_name("guidellm")), "run",
            "--backend", f"kind=openai_http,target=http://127.0.0.1:{PORT}",
            "--profile", f"kind=concurrent,streams={STREAMS}",
            "--constraint", f"kind=max_duration,seconds={seconds:g}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
            "--tokenizer", f"kind=huggingface_auto,model={model_dir.resolve()}",
            "--output", f"kind=json,path={report}",
            "--disable-progress"]


def figures(report: dict) -> dict:
    """The run's figures from guidellm's report (its one benchmark), as guidellm computes them."""
    [benchmark] = report["benchmarks"]
    metrics = benchmark["metrics"]

    def successful(name: str) -> dict:
        return metrics[name]["successful"]

    errored = benchmark["requests"].get("errored") or []
    return {
        "requests": metrics["request_totals"], "duration_s": benchmark["duration"],
        "first_error": next((r["info"].get("error") for r in errored if r.get("info", {}).get("error")), None),
        "requests_per_s": successful("requests_per_second")["mean"],
        "output_tokens_per_s": successful("output_tokens_per_second")["mean"],
        "output_tokens": successful("output_token_count")["total_sum"],
        **{f"{key}_{p}_ms": successful(name)["percentiles"][p] for key, name in
           (("ttft", "time_to_first_token_ms"), ("itl", "inter_token_latency_ms"), ("tpot", "time_per_output_token_ms"))
           for p in ("p50", "p99")},
    }


def markdown(result: dict) -> str:
    requests = result["requests"]
    lines = [
        "## guidellm against the LLM example", "",
        f"`guidellm run` ({result['guidellm']}): {STREAMS} concurrent streams of chat completions for "
        f"{result['seconds']:g} s, synthetic prompts of {PROMPT_TOKENS} tokens asking for {OUTPUT_TOKENS}; "
        "figures as guidellm computes them.", "",
        "| requests ok / errored / incomplete | req/s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
        "TPOT p50 / p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
        f"| {requests['successful']} / {requests['errored']} / {requests['incomplete']} | "
        f"{result['requests_per_s']:.1f} | {result['output_tokens_per_s']:.1f} | "
        f"{result['ttft_p50_ms']:.1f} / {result['ttft_p99_ms']:.1f} | "
        f"{result['itl_p50_ms']:.2f} / {result['itl_p99_ms']:.2f} | "
        f"{result['tpot_p50_ms']:.2f} / {result['tpot_p99_ms']:.2f} |", ""]
    if result["first_error"]:
        lines += [f"First error: `{result['first_error'][:300]}`", ""]
    return "\n".join(lines)


def guidellm_version() -> str:
    from importlib.metadata import version  # noqa: PLC0415

    return f"guidellm {version('guidellm')}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.guidellm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{SECONDS['quick']} s of load instead of "
                                                             f"{SECONDS['full']}")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR, help="the model directory (make llm-example)")
    args = parser.parse_args(argv)
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if not (args.model_dir / "config.json").exists():
        print(f"[guidellm] no model in {args.model_dir}: run `make llm-example`", file=sys.stderr)
        return 1
    seconds = SECONDS["quick" if args.quick else "full"]
    write_yaml(args.model_dir, out / "guidellm-llm.yaml")
    report_path = out / "guidellm-report.json"
    report_path.unlink(missing_ok=True)
    server = OpenAIServer(spec(out / "guidellm-llm.yaml"), out / "logs")
    try:
        probe = json.dumps({"model": "llm", "prompt": "Hello", "max_tokens": 2}).encode()
        try:
            ready = server.wait_ready({"llm": (probe, {"Content-Type": "application/json"})})
        except RuntimeError as exc:
            print(f"[guidellm] neuron-serve failed: {exc}", file=sys.stderr)
            return 1
        print(f"[guidellm] neuron-serve ready in {ready:.0f}s; guidellm for {seconds}s", flush=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        proc = subprocess.run(guidellm_command(args.model_dir, seconds, report_path), cwd=out, env=env,
                              timeout=seconds + 600)
    finally:
        server.stop()
    if proc.returncode != 0 or not report_path.exists():
        print(f"[guidellm] guidellm exited {proc.returncode}", file=sys.stderr)
        return 1
    result = {**figures(json.loads(report_path.read_text())), "seconds": seconds, "guidellm": guidellm_version()}
    (out / "guidellm.json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    (out / "guidellm.md").write_text(text + "\n")
    print(text, flush=True)
    requests = result["requests"]
    print(f"[guidellm] {requests['successful']} requests ok, {requests['errored']} errored, "
          f"{requests['incomplete']} incomplete; wrote {out / 'guidellm.md'}", flush=True)
    return 1 if requests["errored"] or not requests["successful"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
