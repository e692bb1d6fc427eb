"""bench: neuron-serve against peer servers, side by side in one run.

    python -m bench            # full run (about 20 minutes on 2 cores)
    python -m bench --quick    # a shorter run for development (about 10 minutes)
    python -m bench --generate-only [--quick]   # only the generation benchmark (bench/generate.py)

Each server is started alone, measured at every (workload, concurrency) point with the
same request files by wrk, and stopped before the next starts: an idle Ray cluster
beside the one measured is not idle enough (with all seven servers up, Ray Serve behind
HAProxy served W1 at concurrency 1 at 145 req/s; alone, at 299). ``--all-up`` starts
every server first and takes each point on each in turn (order rotated per point). Results go to
bench/results/<timestamp>/: results.md, raw.json and PNG charts (latency_throughput.png, and from
bench/charts.py throughput.png, latency.png and generation.png). The generation
benchmark (bench/generate.py: the engine against transformers, in one process, after the
servers are stopped) adds generate.md and generate.json there; generation over HTTP
(bench/generate_http.py: neuron-serve's OpenAI API against transformers serve and Ray Serve,
one server at a time) adds generate_http.md and generate_http.json; tensor parallelism
(bench/tensor_parallel.py: a 110M-parameter Llama at TP 1, TP 2 and DP 2) adds
tensor_parallel.md and tensor_parallel.json; guidellm (bench/guidellm.py: vLLM's load generator
against the LLM example served, exiting non-zero on any errored request) adds guidellm.md and
guidellm.json; prefix caching (bench/prefix_caching.py: time to first token of prompts sharing
a 300-token prefix, served with and without caching) adds prefix_caching.md and
prefix_caching.json; sampling on the core (bench/sampling.py: greedy against temperature 1 and
top-p 0.9, a 32k vocabulary) adds sampling.md and sampling.json; speculative decoding (bench/speculative.py: n-gram proposals on a
repetitive workload, served with and without) adds speculative.md and speculative.json; LoRA
adapters (bench/lora.py: 8 streams over 4 adapters against 8 on the base, one server, and an
adapter's load time) adds lora.md and lora.json; quantization (bench/quantization.py: what each dtype,
weight quantization and KV cache dtype costs in accuracy on SmolLM2, teacher-forced, and saves per core) adds
quantization.md and quantization.json; chunked prefill (bench/chunked_prefill.py: 16 streams decoding while long
prompts arrive, neuron-serve with and without chunked prefill and transformers serve, one at a time) adds
chunked_prefill.md and chunked_prefill.json; long
prompts (bench/prefill.py: a prefill against eager transformers' forward in process, and time
to first token at one stream served beside transformers serve) adds prefill.md and prefill.json;
embeddings (bench/embeddings.py: neuron-serve's /v1/embeddings against infinity-emb and
sentence-transformers on Ray Serve, one server at a time, then bench/embed_placement.py: where
tokenization and pooling run) adds embeddings.md, embeddings.json, embed_placement.md and
embed_placement.json; start-up (bench/startup.py: from deploy's launch to the first correct
answer, ready on the first compiled models against after the whole compile, and an autoscaling
step from one replica to two) adds startup.md and startup.json; host memory (bench/host_memory.py: SmolLM2 with every
default bucket, in int8, the embedder and a Llama-3.2-1B-shaped model at tensor_parallel_size 2, each deployed alone and
measured once fully compiled) adds host_memory.md and host_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import charts, efficiency, grpc_load, loadgen, report, servers, workloads

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

# (workload, concurrency) points measured on every server.
FULL_POINTS = [("W1", 1), ("W1", 16), ("W1", 64), ("W2", 16), ("W3-mlp", 1), ("W3-enc", 1), ("W3-mlp", 16),
               ("W3-enc", 16), ("W1-grpc", 16), ("W3-mlp-grpc", 16), ("W3-enc-grpc", 16)]
QUICK_POINTS = [("W1", 1), ("W1", 16), ("W2", 16), ("W3-mlp", 1), ("W3-mlp", 16), ("W3-enc", 16), ("W1-grpc", 16),
                ("W3-mlp-grpc", 16)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter measurements and fewer points")
    parser.add_argument("--servers", default=",".join(servers.specs()),
                        help="comma-separated subset of: " + ", ".join(servers.specs()))
    parser.add_argument("--seconds", type=float, help="seconds of load per point (default 4 quick, 10 full)")
    parser.add_argument("--points", help="workload:concurrency list, e.g. W1:16,W2:16 (default: by mode)")
    together = parser.add_mutually_exclusive_group()
    together.add_argument("--one-at-a-time", dest="all_up", action="store_false",
                          help="start, measure and stop each server alone (the default)")
    together.add_argument("--all-up", dest="all_up", action="store_true",
                          help="start every server first, then take each point on each in turn")
    parser.set_defaults(all_up=False)
    parser.add_argument("--no-internal", action="store_true", help="skip the internal figures")
    parser.add_argument("--no-cold-warm", action="store_true", help="skip the cold/warm start figures")
    parser.add_argument("--no-startup", action="store_true",
                        help="skip start-up from deploy's launch and the autoscaling step (bench/startup.py)")
    generation = parser.add_mutually_exclusive_group()
    generation.add_argument("--no-generate", action="store_true", help="skip the generation benchmark")
    generation.add_argument("--generate-only", action="store_true",
                            help="run only the generation benchmark (as python -m bench.generate)")
    parser.add_argument("--no-generate-http", action="store_true",
                        help="skip generation over HTTP (bench/generate_http.py)")
    parser.add_argument("--no-tensor-parallel", action="store_true",
                        help="skip tensor parallelism (bench/tensor_parallel.py)")
    parser.add_argument("--no-guidellm", action="store_true", help="skip guidellm (bench/guidellm.py)")
    parser.add_argument("--no-host-memory", action="store_true",
                        help="skip host memory as compiled models grow in number (bench/host_memory.py)")
    parser.add_argument("--no-embeddings", action="store_true",
                        help="skip embeddings over HTTP and their placement (bench/embeddings.py, embed_placement.py)")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    return parser.parse_args(argv)


def measure_point(server: servers.Server, workload: str, conc: int, manifest: Path, seconds: float, log) -> dict:
    wl = workloads.WORKLOADS[workload]
    row = {"server": server.spec.key, "workload": workload, "concurrency": conc}
    if wl.grpc and server.spec.grpc_port is None:
        row["skipped"] = "no OIP v2 gRPC"
        return row
    if wl.binary and not server.spec.binary:
        row["skipped"] = "no binary tensor extension"
        return row
    if wl.grpc:
        address = f"127.0.0.1:{server.spec.grpc_port}"
        grpc_load.wait_ready(address)
        # h2load (C, as wrk) when the manifest's requests are all one shape (it sends only the
        # first); else grpcio's asyncio client, which takes cores from the server.
        if shutil.which("h2load") and grpc_load.one_shape(grpc_load.requests_of(wl.model, manifest)):
            row["loadgen"] = "h2load"
            try:
                row.update(grpc_load.run_h2load(address, wl.model, manifest, conc, seconds, warm_up_s=1).as_dict())
            except grpc_load.GrpcPreflightError as exc:  # h2load would count gRPC errors as successes
                log(f"  {server.spec.key:13s} {workload} c{conc}: not measured: {exc}")
                row["skipped"] = f"failed: {exc}"[:80]
                return row
        else:
            row["loadgen"] = "grpcio-asyncio"
            grpc_load.run_grpc_load(address, wl.model, manifest, conc, 1)  # warm-up, as below
            row.update(grpc_load.run_grpc_load(address, wl.model, manifest, conc, seconds).as_dict())
    else:
        row["loadgen"] = "wrk"
        # A short warm-up at the same concurrency, so first-call costs are not measured.
        loadgen.run_load(server.url(wl.model), manifest, conc, 1)
        ours = server.spec.key == "neuron-serve" and wl.model == "mlp"  # one shape bucket: costs per size apply
        before = efficiency.scrape(server.spec.port, wl.model) if ours else None
        row.update(loadgen.run_load(server.url(wl.model), manifest, conc, seconds).as_dict())
        if ours:
            row["cores"] = efficiency.efficiency(before, efficiency.scrape(server.spec.port, wl.model), row["seconds"])
    log(f"  {server.spec.key:13s} {workload} c{conc}: {row['rps']:7.1f} req/s  p50 {row['p50_ms']:7.1f} ms  "
        f"p99 {row['p99_ms']:7.1f} ms  errors {row['errors']}")
    return row


def measure_all(chosen, points, manifests, seconds: float, out: Path, log, together: bool):
    """Every (server, point): one server at a time, or with ``together`` all servers up at
    once and each point taken on every server in turn (order rotated per point)."""
    rows, memory = [], {}
    probes = {workloads.WORKLOADS[w].model: workloads.first_body(manifests[w])
              for w, _ in points if not workloads.WORKLOADS[w].binary}

    def start(spec) -> servers.Server | None:
        server = servers.Server(spec, out / "logs")
        try:
            log(f"  {spec.key}: ready in {server.wait_ready(probes):.0f}s")
            return server
        except RuntimeError as exc:
            log(f"  {spec.key} failed: {exc}")
            server.stop()
            rows.extend({"server": spec.key, "workload": w, "concurrency": c, "skipped": f"failed: {exc}"[:80]}
                        for w, c in points)
            return None

    groups = [chosen] if together else [[spec] for spec in chosen]
    for group in groups:
        running = [s for s in (start(spec) for spec in group) if s is not None]
        try:
            for index, (workload, conc) in enumerate(points):
                for server in running[index % max(1, len(running)):] + running[:index % max(1, len(running))]:
                    rows.append(measure_point(server, workload, conc, manifests[workload], seconds, log))
            for server in running:
                memory[server.spec.key] = server.memory_mb()
        finally:
            for server in running:
                server.stop()
    return rows, memory


def run_internal(quick: bool, out: Path, log) -> list[dict] | None:
    path = out / "internal.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
           "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    command = [sys.executable, "-m", "bench.internal", "--json", str(path)] + (["--quick"] if quick else [])
    with open(out / "logs" / "internal.log", "w") as handle:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=900)
    if proc.returncode != 0:
        log(f"  internal figures failed (rc {proc.returncode}); see {out / 'logs' / 'internal.log'}")
        return None
    return json.loads(path.read_text())


def run_cold_warm(quick: bool, out: Path, log) -> str | None:
    """bench/cold_warm.py, when present, measures cold, warm (compile cache) and artifact
    starts; its standard output (a Markdown table) goes into the report as is."""
    if not (ROOT / "bench" / "cold_warm.py").exists():
        return None
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    models = ["mlp", "encoder"] if quick else ["mlp", "encoder", "convnet", "mlp@1", "mlp@6"]
    command = [sys.executable, "bench/cold_warm.py", "--models", *models, "--runs", "1" if quick else "2",
               "--out", str(out / "cold_warm")]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    (out / "logs" / "cold_warm.log").write_text(proc.stderr)
    if proc.returncode != 0:
        log(f"  cold/warm start failed (rc {proc.returncode}); see {out / 'logs' / 'cold_warm.log'}")
        return None
    return proc.stdout


def run_startup(quick: bool, out: Path, log) -> str | None:
    """bench/startup.py: from deploy's launch to the first correct answer, ready on the first compiled
    models against after the whole compile, and an autoscaling step (it starts each deploy itself)."""
    return _run_module("startup", quick, out, log, "start-up from deploy's launch and an autoscaling step (one "
                       "deploy at a time)", 3600)


def run_host_memory(quick: bool, out: Path, log) -> str | None:
    """bench/host_memory.py: each case deployed alone, measured once fully compiled (it starts each deploy)."""
    return _run_module("host_memory", quick, out, log, "host memory as compiled models grow in number (SmolLM2 "
                       "with every default bucket, in int8, the embedder, a 1B-class model at TP 2; one deploy at a "
                       "time)", 6 * 3600)


def run_generate(quick: bool, out: Path, log) -> str | None:
    """bench/generate.py in its own process (its torch threads and XLA client, nothing else
    running): returns its Markdown tables; the figures are in generate.json."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PJRT_DEVICE": "CPU"}
    command = [sys.executable, "-m", "bench.generate", "--out", str(out)] + (["--quick"] if quick else [])
    log(f"generation benchmark ({'quick' if quick else 'full'}, a few minutes: the engine compiles first)")
    with open(out / "logs" / "generate.log", "w") as handle:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=1800)
    if proc.returncode != 0:
        log(f"  generation benchmark failed (rc {proc.returncode}); see {out / 'logs' / 'generate.log'}")
        return None
    return (out / "generate.md").read_text()


def _run_module(module: str, quick: bool, out: Path, log, what: str, timeout: int,
                env: dict | None = None, args: list[str] | None = None) -> str | None:
    """``python -m bench.<module> [args]`` in its own process, writing <module>.md in ``out``: that file's text, or
    None (its log says why)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    command = [sys.executable, "-m", f"bench.{module}", "--out", str(out)] + (["--quick"] if quick else []) + \
        (args or [])
    log(what)
    (out / f"{module}.md").unlink(missing_ok=True)
    with open(out / "logs" / f"{module}.log", "w") as handle:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        log(f"  {module}: rc {proc.returncode}; see {out / 'logs' / f'{module}.log'}")
    path = out / f"{module}.md"
    return path.read_text() if path.exists() else None


def run_openai_fields(quick: bool, out: Path, log) -> str | None:
    """bench/openai_fields.py: what structured outputs and prompt logprobs cost the engine."""
    return _run_module("openai_fields", quick, out, log, "structured outputs and prompt logprobs (the engine in "
                       "process)", 1800, {"PJRT_DEVICE": "CPU"})


def run_tensor_parallel(quick: bool, out: Path, log) -> str | None:
    """bench/tensor_parallel.py (it starts one process per layout itself)."""
    return _run_module("tensor_parallel", quick, out, log, "tensor parallelism (TP 1, TP 2 and DP 2 in turn, each "
                       "compiles a 110M-parameter Llama first)", 5400)


def run_generate_http(quick: bool, out: Path, log) -> str | None:
    """bench/generate_http.py in its own process (it starts and stops each server itself): its Markdown table
    whenever it wrote one (a server that failed is a row of it)."""
    return _run_module("generate_http", quick, out, log, f"generation over HTTP ({'quick' if quick else 'full'}: five "
                       "servers in turn, neuron-serve compiles first, twice)", 7200)


def run_sampling(quick: bool, out: Path, log) -> str | None:
    """bench/sampling.py: sampled requests against greedy ones, on one engine in process."""
    return _run_module("sampling", quick, out, log, "sampling on the core against greedy (the engine in process)",
                       1800, {"PJRT_DEVICE": "CPU"})


def run_prefix_caching(quick: bool, out: Path, log) -> str | None:
    """bench/prefix_caching.py (it serves the same model without and with caching, in turn)."""
    return _run_module("prefix_caching", quick, out, log, "prefix caching (two servers in turn)", 2400)


def run_speculative(quick: bool, out: Path, log) -> str | None:
    """bench/speculative.py (n-gram, then a draft model: each serves its model without and with, in turn)."""
    return _run_module("speculative", quick, out, log, "speculative decoding (n-gram, then a draft model: two servers "
                       "each, in turn)", 3600)


def run_lora(quick: bool, out: Path, log) -> str | None:
    """bench/lora.py (one server with four adapters: streams on the base, then over the adapters)."""
    return _run_module("lora", quick, out, log, "LoRA adapters (one server)", 2400)


def run_chunked_prefill(quick: bool, out: Path, log) -> str | None:
    """bench/chunked_prefill.py (neuron-serve with and without chunked prefill, then transformers serve)."""
    return _run_module("chunked_prefill", quick, out, log, "chunked prefill: long prompts beside decoding streams "
                       "(three servers in turn)", 5400)


def run_quantization(quick: bool, out: Path, log) -> str | None:
    """bench/quantization.py (SmolLM2 compiled in each precision setting, in process)."""
    return _run_module("quantization", quick, out, log, "quantization's accuracy and memory (SmolLM2, in process)",
                       5400, {"PJRT_DEVICE": "CPU"})


def run_prefill(quick: bool, out: Path, log) -> str | None:
    """bench/prefill.py (in process, then neuron-serve and transformers serve in turn)."""
    return _run_module("prefill", quick, out, log, "long prompts' time to first token (two servers in turn)", 2400)


def run_embeddings(quick: bool, out: Path, log) -> str | None:
    """bench/embeddings.py on log-normal text lengths, one text and 32 texts a request (neuron-serve packed, then one
    text a row with the default and the auto length buckets, infinity-emb and sentence-transformers on Ray Serve in
    turn), then bench/embed_placement.py (where tokenization and pooling run, in process)."""
    served = _run_module("embeddings", quick, out, log, "embeddings over HTTP (five servers in turn, neuron-serve "
                         "compiles first)", 7200, args=["--lengths", "lognormal", "--texts-per-request", "1,32",
                                                        "--servers", "neuron-serve,padded,auto,infinity,ray"])
    placed = _run_module("embed_placement", quick, out, log, "where tokenization and pooling run (in process)", 1800,
                         {"PJRT_DEVICE": "CPU"})
    return "\n\n".join(part.strip() for part in (served, placed) if part) or None


def run_guidellm(quick: bool, out: Path, log) -> str | None:
    """bench/guidellm.py (it serves the LLM example itself): its Markdown table, errors counted in it."""
    return _run_module("guidellm", quick, out, log, "guidellm against the LLM example (neuron-serve compiles first)",
                       1800)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if args.generate_only:
        generation = run_generate(args.quick, out, print)
        if generation:
            print(generation)
            print(f"wrote {', '.join(str(p) for p in charts.charts_of(out, out))}")
        return 0 if generation else 1
    seconds = args.seconds or (4 if args.quick else 10)
    points = QUICK_POINTS if args.quick else FULL_POINTS
    if args.points:
        points = [(w, int(c)) for w, c in (p.split(":") for p in args.points.split(","))]
    all_specs = servers.specs()
    chosen = [all_specs[k] for k in args.servers.split(",")]
    labels = {s.key: s.label for s in chosen}
    loadgen.wrk_binary()

    def log(message: str) -> None:
        print(message, flush=True)

    # gRPC workloads send the request files of their HTTP twin, converted per message.
    sources = {w: workloads.WORKLOADS[w].bodies or w for w in {p[0] for p in points}}
    written = {s: workloads.write_bodies(workloads.WORKLOADS[s], out / "bodies" / s) for s in set(sources.values())}
    manifests = {w: written[s] for w, s in sources.items()}
    log(f"bench: {len(chosen)} servers x {len(points)} points, {seconds:g}s each; results in {out}")
    rows, memory = measure_all(chosen, points, manifests, seconds, out, log, together=args.all_up)
    internal = None if args.no_internal else run_internal(args.quick, out, log)
    cold_warm = None if args.no_cold_warm else run_cold_warm(args.quick, out, log)
    startup = None if args.no_startup else run_startup(args.quick, out, log)
    generation = None if args.no_generate else run_generate(args.quick, out, log)
    generation_http = None if args.no_generate_http else run_generate_http(args.quick, out, log)
    tensor_parallel = None if args.no_tensor_parallel else run_tensor_parallel(args.quick, out, log)
    openai_fields = None if args.no_generate else run_openai_fields(args.quick, out, log)
    sampling = None if args.no_generate else run_sampling(args.quick, out, log)
    prefix_caching = None if args.no_generate else run_prefix_caching(args.quick, out, log)
    speculation = None if args.no_generate else run_speculative(args.quick, out, log)
    lora = None if args.no_generate else run_lora(args.quick, out, log)
    quantization = None if args.no_generate else run_quantization(args.quick, out, log)
    chunked = None if args.no_generate else run_chunked_prefill(args.quick, out, log)
    prefill = None if args.no_generate else run_prefill(args.quick, out, log)
    guidellm = None if args.no_guidellm else run_guidellm(args.quick, out, log)
    embedding = None if args.no_embeddings else run_embeddings(args.quick, out, log)
    host = None if args.no_host_memory else run_host_memory(args.quick, out, log)

    targets = report.target_rows(rows)
    sections = [
        f"# neuron-serve benchmarks ({'quick' if args.quick else 'full'} run, {time.strftime('%Y-%m-%d %H:%M %Z')})",
        "",
        f"Load: wrk, one thread, concurrency = open connections, {seconds:g}s per point after a 1s warm-up; "
        f"{os.cpu_count()} CPU cores; "
        + ("all servers up at once, each point taken on every server in turn. " if args.all_up else
           "each server alone on the machine, started and stopped in turn. ")
        + f"Load average at the end: {os.getloadavg()[0]:.1f} (other work on the machine adds noise). "
        "Ratios compare figures taken in this same run.",
        "", "## Serving", "", report.serving_table(rows, labels),
        "", "## Targets", "", report.targets_table(targets),
        "", "## Memory per replica", "", report.memory_table(memory, labels),
    ]
    if internal:
        sections += ["", "## Internal figures", "", report.internal_tables(internal)]
    if cold_warm:
        sections += ["", "## Cold and warm start", "", cold_warm.strip()]
    if startup:
        sections += ["", startup.strip()]
    if host:
        sections += ["", host.strip()]
    if generation:
        sections += ["", "## Generation (in process, bench/generate.py)", "", generation.strip()]
    if generation_http:
        sections += ["", "## Generation over HTTP (bench/generate_http.py)", "", generation_http.strip()]
    if tensor_parallel:
        sections += ["", tensor_parallel.strip()]
    if openai_fields:
        sections += ["", openai_fields.strip()]
    if sampling:
        sections += ["", sampling.strip()]
    if prefix_caching:
        sections += ["", prefix_caching.strip()]
    if speculation:
        sections += ["", speculation.strip()]
    if lora:
        sections += ["", lora.strip()]
    if quantization:
        sections += ["", "## Quantization (bench/quantization.py)", "", quantization.strip()]
    if chunked:
        sections += ["", "## Chunked prefill (bench/chunked_prefill.py)", "", chunked.strip()]
    if prefill:
        sections += ["", prefill.strip()]
    if guidellm:
        sections += ["", guidellm.strip()]
    if embedding:
        sections += ["", embedding]
    markdown = "\n".join(sections) + "\n"
    (out / "results.md").write_text(markdown)
    (out / "raw.json").write_text(json.dumps({"rows": rows, "memory": memory, "internal": internal,
                                              "targets": targets,
                                              "generation": json.loads((out / "generate.json").read_text())
                                              if generation else None,
                                              "generation_http": json.loads((out / "generate_http.json").read_text())
                                              if generation_http else None}, indent=2))
    report.plot([r for r in rows], labels, out / "latency_throughput.png")
    pictures = [out / "latency_throughput.png", *charts.charts_of(out, out, labels)]
    print()
    print(markdown)
    log(f"wrote {out / 'results.md'} and {', '.join(p.name for p in pictures)} in {time.monotonic() - started:.0f}s")
    return 0
