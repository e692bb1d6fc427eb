"""Generation over HTTP: neuron-serve's OpenAI API against peer servers on the same model.

    python -m bench.generate_http [--quick] [--out DIR] [--servers a,b]   # also a part of python -m bench

One model directory, deployments/llm/ (``make llm-example``: SmolLM2-135M-Instruct, 30 layers, float32,
with its own tokenizer), served by five servers, one at a time (each is started, measured and stopped before
the next starts):

1. ``neuron-serve``: ``neuron-serve deploy`` of deployments/llm.yaml as the project ships it (the model
   directory made absolute), written to ``<out>/neuron-serve-llm.yaml``; it must hold 16 sequences of 512
   tokens (200 prompt + 128 new tokens at most), so no request waits for a KV-cache slot (the peers have no
   such bound). Measured once its background compile is done.
1b. ``neuron-serve-defaults``: the model.yaml a newcomer writes (``task: generate``, ``model.pretrained``,
   ``max_num_seqs: 16``, ``max_model_len: 512``, every bucket list by default), ``<out>/neuron-serve-defaults-llm.yaml``.
2. ``transformers-cb``: ``transformers serve --continuous-batching`` with the directory
   as its model (a local path is served as it is, named by that path), sdpa attention,
   a paged cache of 64 pages of 256 tokens (32 sequences x 512, as bench/generate.py; auto-
   sized it takes most of the host's memory).
3. ``transformers``: ``transformers serve`` without continuous batching (``generate`` on
   one inference thread, one request after another).
4. ``ray``: Ray Serve's default HTTP proxy in front of one replica calling eager
   ``model.generate`` per request on a thread of its own (bench/peers/ray_generate_app.py).

Workload: a seeded list of text prompts whose lengths under the model's tokenizer are 8 to
200 tokens, each with 16 to 128 new tokens, the same list for every server; streamed
``/v1/completions`` at temperature 0 (greedy), ``concurrency`` requests in flight (aiohttp,
closed loop) at concurrency 1 and 16; then sampled (temperature 0.8, top_p 0.95, a seed a
request) at concurrency 16. Each point sends its own slice of the list (no
prompt is sent twice to a server, so no prefix cache can help); a few short requests warm
each server up first.

Equal work: every request must return exactly its ``max_tokens``. neuron-serve and the Ray
peer take vLLM's ``ignore_eos: true``. ``transformers serve`` refuses unknown fields (422
for ``ignore_eos``) and has no such flag, but takes a ``generation_config`` JSON string per
request: the model's generation config with ``eos_token_id`` set to the vocabulary size, an
id the model cannot produce (with random weights greedy decoding does reach EOS, about one
request in twenty). Each request's ``usage.completion_tokens`` is checked against its
``max_tokens``; a request that differs is counted (``short``) and its tokens still count.

Figures per (server, concurrency): output tokens/s (completion tokens over the wall time
from the first request sent to the last answer), time to first token (request sent to the
first chunk with text) and time per output token per request ((last token time - first
token time) / (tokens - 1), the last token's time being the chunk that ends the choice),
p50 and p99. Then each neuron-serve configuration against the best peer: tokens/s and TTFT at
concurrency 16, TTFT and TPOT at concurrency 1. Per point, too, the CPU each kind of process used (the engine
process, the replicas, Ray's own, this load generator: bench/cpu_shares.py), and for neuron-serve its engine's
steps and the compiled calls' share of the wall, per bucket (its own metrics). Writes generate_http.md (printed
too) and generate_http.json.

With ``--proposed``, neuron-serve is served again (``neuron-serve-proposed``) on the prefill and decode-rows
buckets ``neuron-serve buckets`` proposes from the sizes its first run recorded in the compile cache (as many as
the first run's, the largest kept: what ``prefill_buckets: auto`` and ``decode_batch_buckets: auto`` start on
after that traffic), and the report compares the two at each concurrency, with each run's padded work over its
real work. docs/guides/shapes.md's figures: ``python -m bench.generate_http --servers neuron-serve --proposed``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from . import cpu_shares, servers

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODEL_DIR = ROOT / "deployments" / "llm"
CONCURRENCY = (1, 16)
REQUESTS = {"full": {1: 8, 16: 64}, "quick": {1: 4, 16: 32}}  # requests per point
SAMPLED = {"full": {16: 64}, "quick": {16: 32}}  # the sampled points' requests
SAMPLING = {"temperature": 0.8, "top_p": 0.95}
WARMUP = 4  # short requests (8 new tokens), all at once, before a server's first point
PROMPT_TOKENS, NEW_TOKENS = (8, 200), (16, 128)
MAX_MODEL_LEN = 512
DEFAULTS_YAML = "neuron-serve-defaults-llm.yaml"
REQUEST_TIMEOUT_S = 600


# -- the workload --

def make_workload(tokenizer, count: int, seed: int = 0, prompt_tokens: tuple[int, int] = PROMPT_TOKENS,
                  new_tokens: tuple[int, int] = NEW_TOKENS) -> list[dict]:
    """``count`` requests: text prompts of an exact token length under ``tokenizer``, and max_tokens."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    words = [i for i in range(len(tokenizer)) if i not in special
             and (t := tokenizer.decode([i])).strip() and t.isascii() and t.isprintable()]
    requests = []
    for _ in range(count):
        n, new = rng.randint(*prompt_tokens), rng.randint(*new_tokens)
        ids = [rng.choice(words) for _ in range(n)]
        for _ in range(20):  # decode and encode again until the text is n tokens
            text = tokenizer.decode(ids)
            again = tokenizer(text)["input_ids"]
            if len(again) == n:
                break
            ids = again[:n] + [rng.choice(words) for _ in range(n - len(again))]
        else:
            raise RuntimeError(f"no text of {n} tokens found")
        requests.append({"prompt": text, "prompt_tokens": n, "max_tokens": new})
    return requests


# -- one streamed response --

class SSEStream:
    """The figures of one streamed completion, fed its SSE lines with their arrival times."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.first: float | None = None   # the first chunk with text
        self.last: float | None = None    # the last chunk with text or a finish_reason
        self.chunks = 0                   # chunks with text
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, line: bytes | str, now: float) -> None:
        line = (line.decode() if isinstance(line, bytes) else line).strip()
        if not line.startswith("data:"):
            return  # blank lines end events; comments (":") and event:/id: lines carry nothing here
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.error = self.error or f"not JSON: {data[:80]}"
            return
        if not isinstance(event, dict) or "error" in event:
            self.error = self.error or f"error event: {data[:200]}"
            return
        for choice in event.get("choices") or []:
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                self.chunks += 1
                self.first = self.first if self.first is not None else now
                self.last = now
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.last = now
        if event.get("usage"):
            self.usage = event["usage"]

    @property
    def tokens(self) -> int:
        """Output tokens: the server's usage count, else one a chunk with text."""
        return int(self.usage["completion_tokens"]) if self.usage else self.chunks

    def figures(self) -> dict:
        ttft = None if self.first is None else self.first - self.sent
        tpot = (self.last - self.first) / (self.tokens - 1) if self.first is not None and self.tokens > 1 else None
        return {"tokens": self.tokens, "prompt_tokens": (self.usage or {}).get("prompt_tokens"),
                "ttft_s": ttft, "tpot_s": tpot, "finish_reason": self.finish_reason, "error": self.error}


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarise(results: list[dict], requests: list[dict], wall: float) -> dict:
    """A point's figures from its requests' figures (``results[i]`` answers ``requests[i]``)."""
    ok = [r for r in results if not r["error"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(results), "errors": len(results) - len(ok),
            "short": sum(r["tokens"] != q["max_tokens"] for r, q in zip(results, requests) if not r["error"]),
            "prompt_mismatch": sum(r["prompt_tokens"] not in (None, q["prompt_tokens"])
                                   for r, q in zip(results, requests) if not r["error"]),
            "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            "first_error": next((r["error"] for r in results if r["error"]), None)}


# -- the load generator --

async def stream_one(session, url: str, body: dict) -> dict:
    import aiohttp  # noqa: PLC0415

    stream = SSEStream(time.perf_counter())
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                stream.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return stream.figures()
            async for line in response.content:
                stream.feed(line, time.perf_counter())
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"[:200]
    if not stream.error and stream.finish_reason is None:
        stream.error = "the stream ended with no finish_reason"
    return stream.figures()


async def run_point(url: str, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    """Every body streamed, ``concurrency`` at a time (closed loop); (figures per body, wall seconds)."""
    import aiohttp  # noqa: PLC0415

    results: list[dict | None] = [None] * len(bodies)
    pending = iter(range(len(bodies)))
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        async def worker() -> None:
            for i in pending:
                results[i] = await stream_one(session, url, bodies[i])

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - started


# -- the servers --

class OpenAIServer(servers.Server):
    """A server under test probed and measured on /v1/completions."""

    def url(self, model: str) -> str:
        return f"http://127.0.0.1:{self.spec.port}/v1/completions"

    def wait_ready(self, probes: dict[str, tuple[bytes, dict]]) -> float:
        """As servers.Server's, but a probe refused as invalid (400, 422) fails at once, with the answer."""
        import urllib.error  # noqa: PLC0415
        import urllib.request  # noqa: PLC0415

        for body, headers in probes.values():
            while self.proc.poll() is None and time.monotonic() < self.started + self.spec.startup_s:
                try:
                    request = urllib.request.Request(self.url(""), data=body, headers=headers, method="POST")
                    with urllib.request.urlopen(request, timeout=60):
                        break
                except urllib.error.HTTPError as exc:
                    if exc.code in (400, 422):
                        raise RuntimeError(f"probe refused: HTTP {exc.code} {exc.read()[:300]!r}") from None
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    pass
                time.sleep(1)
        return super().wait_ready(probes)  # says why when the server exited or timed out

    def stop(self) -> None:
        # transformers serve --continuous-batching never exits on SIGINT (its batching thread
        # outlives uvicorn), so a server with no Ray under it gets 5 s, not 30, before SIGKILL;
        # the group goes with it. Ray servers keep servers.Server's stop, which finds their daemons.
        if self.spec.replica_marker is None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        super().stop()


def no_eos_config(model_dir: Path) -> str:
    """transformers serve's per-request ``generation_config``: the model's, with an EOS id it cannot produce."""
    config = json.loads((model_dir / "generation_config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return json.dumps({**config, "eos_token_id": vocab, "do_sample": False})


def write_neuron_serve_yaml(model_dir: Path, path: Path, prefill: list[int] | None = None,
                            decode_rows: list[int] | None = None) -> None:
    """deployments/llm.yaml as it is, the model dir absolute (its slots and max_model_len hold the workload); the
    prefill and decode-rows buckets given (the proposed ones) in place of its own."""
    import yaml  # noqa: PLC0415

    config = yaml.safe_load((ROOT / "deployments" / "llm.yaml").read_text())
    config["model"]["pretrained"] = str(model_dir.resolve())
    generation = config.setdefault("generation", {})
    if generation.get("max_num_seqs", 0) < max(CONCURRENCY) or generation.get("max_model_len", 0) < MAX_MODEL_LEN:
        raise SystemExit(f"deployments/llm.yaml must hold {max(CONCURRENCY)} sequences of {MAX_MODEL_LEN} tokens")
    if prefill:
        generation["prefill_buckets"] = prefill
    if decode_rows:
        generation["decode_batch_buckets"] = decode_rows
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def write_defaults_yaml(model_dir: Path, path: Path) -> None:
    """The model.yaml a newcomer writes: the model, a slot for each stream, max_model_len for the workload, and
    every bucket list by default."""
    import yaml  # noqa: PLC0415

    config = {"name": "llm", "task": "generate", "model": {"pretrained": str(model_dir.resolve())},
              "generation": {"max_num_seqs": max(CONCURRENCY), "max_model_len": MAX_MODEL_LEN}}
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def recorded_sizes(model: str, since: float) -> dict:
    """The sizes the model's replicas kept in the compile cache during this run (files written since ``since``),
    merged: {family: {size: calls}}."""
    from neuron_serve.buckets import usage as bucket_usage  # noqa: PLC0415
    from neuron_serve.buckets.traffic import Sizes  # noqa: PLC0415
    from neuron_serve.compile import cache as compile_cache  # noqa: PLC0415

    root = compile_cache.default_dir()
    folder = bucket_usage.traffic_dir(root, model) if root is not None else None
    merged = Sizes()
    for path in sorted(folder.glob("*.json")) if folder is not None and folder.is_dir() else []:
        if path.stat().st_mtime >= since:
            merged = merged.merge([Sizes.from_dict(json.loads(path.read_text())["sizes"])])
    return merged.as_dict()


def proposed_buckets(yaml_path: Path, sizes_path: Path) -> dict:
    """`neuron-serve buckets` on the recorded sizes: {family: {"today", "proposed", ...}}."""
    cli = str(Path(sys.executable).with_name("neuron-serve"))
    done = subprocess.run([cli, "buckets", str(yaml_path), "--sizes", str(sizes_path), "--json"],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def proposed_spec(found: dict, yaml_path: Path, label: str) -> tuple:
    """neuron-serve on ``yaml_path`` (the proposed buckets), as ``neuron-serve-proposed``."""
    spec, model, extra = found["neuron-serve"]
    command = [str(yaml_path) if part.endswith("neuron-serve-llm.yaml") else part for part in spec.command]
    return servers.ServerSpec("neuron-serve-proposed", label, command, spec.port, startup_s=spec.startup_s,
                              replica_marker=spec.replica_marker, ready_line=spec.ready_line), model, extra


def specs(model_dir: Path, llm_yaml: Path, python: str = sys.executable) -> dict[str, tuple]:
    """key -> (spec, the model's name in the API, extra fields of every request)."""
    bindir, model = Path(python).parent, str(model_dir.resolve())
    serve = [str(bindir / "transformers"), "serve", model, "--host", "127.0.0.1", "--device", "cpu",
             "--attn-implementation", "sdpa"]
    ignore_eos, no_eos = {"ignore_eos": True}, {"generation_config": no_eos_config(model_dir)}
    return {spec.key: (spec, name, extra) for spec, name, extra in [
        (servers.ServerSpec("neuron-serve", "neuron-serve, the example's model.yaml (OpenAI API)",
                            [str(bindir / "neuron-serve"), "deploy", str(llm_yaml),
                             "--host", "127.0.0.1", "--port", "18810", "--no-grpc"], 18810, startup_s=2400,
                            replica_marker="ray::ServeReplica:", ready_line=servers.READY_LINE), "llm", ignore_eos),
        (servers.ServerSpec("neuron-serve-defaults", "neuron-serve, the buckets by default (OpenAI API)",
                            [str(bindir / "neuron-serve"), "deploy", str(llm_yaml.with_name(DEFAULTS_YAML)),
                             "--host", "127.0.0.1", "--port", "18814", "--no-grpc"], 18814, startup_s=2400,
                            replica_marker="ray::ServeReplica:", ready_line=servers.READY_LINE), "llm", ignore_eos),
        (servers.ServerSpec("transformers-cb", "transformers serve --continuous-batching",
                            serve + ["--port", "18811", "--continuous-batching", "--cb-num-blocks", "64"], 18811,
                            startup_s=300), model, no_eos),
        (servers.ServerSpec("transformers", "transformers serve (generate, one at a time)",
                            serve + ["--port", "18812"], 18812, startup_s=300), model, no_eos),
        (servers.ServerSpec("ray", "Ray Serve, eager generate per request",
                            [python, "-m", "bench.peers.ray_generate_app", "--model", model, "--name", "llm",
                             "--port", "18813"], 18813, startup_s=300, replica_marker="ray::ServeReplica:"),
         "llm", ignore_eos),
    ]}


def request_body(request: dict, model: str, extra: dict, max_tokens: int | None = None) -> dict:
    """A streamed completion: greedy, or sampled with its own seed when ``request`` says so."""
    sampling = {**SAMPLING, "seed": request["seed"]} if "seed" in request else {"temperature": 0}
    return {"model": model, "prompt": request["prompt"], "max_tokens": max_tokens or request["max_tokens"],
            **sampling, "stream": True, "stream_options": {"include_usage": True}, **extra}


def measure_server(key: str, spec, model: str, extra: dict, slices: dict, warmup: list[dict], out: Path,
                   log, sampled: dict | None = None) -> dict:
    """Start one server, warm it up, take every concurrency point, stop it."""
    server = OpenAIServer(spec, out / "logs")
    entry: dict = {"label": spec.label, "points": {}}
    try:
        probe = {**request_body(warmup[0], model, extra, 2), "stream": False}
        probe = json.dumps({k: v for k, v in probe.items() if k != "stream_options"}).encode()
        try:
            entry["ready_s"] = server.wait_ready({model: (probe, {"Content-Type": "application/json"})})
        except RuntimeError as exc:
            log(f"  {key} failed: {exc}")
            return {**entry, "failed": str(exc)}
        log(f"  {key}: ready in {entry['ready_s']:.0f}s")
        url = server.url(model)
        asyncio.run(run_point(url, [request_body(r, model, extra, 8) for r in warmup], len(warmup)))
        ours = key.startswith("neuron-serve")
        for kind, points in (("points", slices), ("sampled", sampled or {})):
            for conc, requests in points.items():
                before, cpu_before = engine_times(spec.port, model) if ours else {}, cpu_shares.snapshot()
                results, wall = asyncio.run(run_point(url, [request_body(r, model, extra) for r in requests], conc))
                point = entry.setdefault(kind, {})[conc] = summarise(results, requests, wall)
                # Where the CPUs went: the emulated cores, the serving processes and this load share them.
                point["cpu"] = cpu_shares.shares(cpu_before, cpu_shares.snapshot(), wall, server.proc.pid)
                after = engine_times(spec.port, model) if ours else {}
                if before and after:  # where the engine's time went (its process's own figures)
                    point["engine"] = engine_split(before, after, wall)
                log(f"  {key:16s} c{conc:<3d}{' sampled' if kind == 'sampled' else ''} {point['tokens_per_s']:8.1f} "
                    f"tok/s  TTFT p50 {ms(point['ttft_p50_s'])} ms  TPOT p50 {ms(point['tpot_p50_s'])} ms  errors "
                    f"{point['errors']}  short {point['short']}"
                    + (f"  ({point['first_error']})" if point["first_error"] else "")
                    + (f"  engine: {_engine_text(point['engine'])}" if "engine" in point else "")
                    + f"  CPU: {cpu_shares.text(point['cpu'])}")
        entry["memory_mb"] = server.memory_mb()
        if key.startswith("neuron-serve"):
            entry["padding"] = padding(spec.port, model)
    finally:
        server.stop()
    return entry


ENGINE_SERIES = {  # what the engine says of its steps and requests (/metrics): sum and count of each histogram
    "host": "neuron_serve_generation_step_host_seconds", "core_wait": "neuron_serve_generation_step_core_wait_seconds",
    "queue": "neuron_serve_request_queue_time_seconds", "ttft": "neuron_serve_time_to_first_token_seconds",
    "prefill": "neuron_serve_generation_step_seconds"}


def engine_times(port: int, model: str) -> dict[str, list[float]]:
    """Per ENGINE_SERIES key, [sum, count] of ``model``'s histogram now (the prefill calls' only, for "prefill"),
    and under "calls" the same per compiled bucket; {} when unreadable."""
    import urllib.request  # noqa: PLC0415

    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    except OSError:
        return {}
    names = {name: key for key, name in ENGINE_SERIES.items()}
    found: dict = {key: [0.0, 0.0] for key in ENGINE_SERIES}
    calls = found["calls"] = {}
    for family in text_string_to_metric_families(text):
        key = names.get(family.name)
        for sample in family.samples if key else ():
            if sample.labels.get("model_name") != model or not sample.name.endswith(("_sum", "_count")):
                continue
            index = 0 if sample.name.endswith("_sum") else 1
            if key == "prefill":  # the step histogram, per bucket: every call's, and the prefills' summed
                bucket = sample.labels.get("bucket", "")
                calls.setdefault(bucket, [0.0, 0.0])[index] += sample.value
                if not bucket.startswith("prefill_"):
                    continue
            found[key][index] += sample.value
    return found


def engine_split(before: dict, after: dict, wall: float | None = None) -> dict:
    """Between two scrapes: the mean engine step's host and core-wait ms, the mean request's queue time and its
    time to first token as the engine measured them, the mean prefill call's ms; with ``wall`` (the seconds
    between them) the share of it the compiled calls took, and per bucket its calls and their mean ms."""
    def mean(key: str) -> float | None:
        count = after[key][1] - before[key][1]
        return 1000 * (after[key][0] - before[key][0]) / count if count else None

    split = {"steps": after["host"][1] - before["host"][1], "host_ms": mean("host"),
             "core_wait_ms": mean("core_wait"), "queue_ms": mean("queue"), "engine_ttft_ms": mean("ttft"),
             "prefill_call_ms": mean("prefill")}
    calls = {}
    for bucket, (total, count) in after.get("calls", {}).items():
        was = before.get("calls", {}).get(bucket, [0.0, 0.0])
        if count > was[1]:
            calls[bucket] = {"calls": int(count - was[1]), "seconds": total - was[0],
                             "mean_ms": 1000 * (total - was[0]) / (count - was[1])}
    if calls:
        split["calls"] = dict(sorted(calls.items(), key=lambda kv: -kv[1]["seconds"]))
        if wall:
            split["calls_share"] = sum(c["seconds"] for c in calls.values()) / wall
    return split


def _engine_text(split: dict) -> str:
    def f(value):
        return "n/a" if value is None else f"{value:.1f}"
    text = (f"{split['steps']:.0f} steps, host {f(split['host_ms'])} + core wait {f(split['core_wait_ms'])} ms a step; "
            f"queue {f(split['queue_ms'])} ms, prefill call {f(split['prefill_call_ms'])} ms, TTFT in the engine "
            f"{f(split['engine_ttft_ms'])} ms (means)")
    if "calls_share" in split:  # how much of the point the compiled calls took, and the three that took most
        top = ", ".join(f"{bucket} {c['calls']} x {c['mean_ms']:.0f} ms" for bucket, c in
                        list(split["calls"].items())[:3])
        text += f"; compiled calls {100 * split['calls_share']:.0f}% of the wall ({top})"
    return text


def padding(port: int, model: str) -> dict[str, float]:
    """Per family (prefill, decode_rows), the replica's padded work over its real work since it started
    (its metadata's ``parameters.padding``); {} when unreadable."""
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}", timeout=30) as answer:
            found = json.load(answer)["parameters"]["padding"]
    except (OSError, KeyError, ValueError):
        return {}
    return {family: 1 / (1 - entry["padded_fraction"]) for family, entry in found.items()}


# -- the report --

def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}"


OURS = ("neuron-serve", "neuron-serve-defaults")  # the example's model.yaml, and the one a newcomer writes


def ratios(systems: dict) -> dict:
    """Each neuron-serve configuration against the best peer: tokens/s and TTFT p50 at the highest concurrency
    (greedy and sampled), TTFT and TPOT at 1."""
    def point(key, conc, kind="points"):
        p = systems.get(key, {}).get(kind, {}).get(conc)
        return p if p and p["errors"] < p["requests"] else None

    peers, result = [k for k in systems if not k.startswith("neuron-serve")], {}
    top, one = max(CONCURRENCY), min(CONCURRENCY)
    for ours in [k for k in OURS if k in systems]:
        found = result[ours] = {}
        for kind, prefix in (("points", ""), ("sampled", "sampled_")):
            theirs = [(k, p) for k in peers if (p := point(k, top, kind))]
            if point(ours, top, kind) and theirs:
                best, p = max(theirs, key=lambda kp: kp[1]["tokens_per_s"])
                found[f"{prefix}tokens_per_s_c{top}"] = {
                    "peer": best, "ratio": point(ours, top, kind)["tokens_per_s"] / p["tokens_per_s"]}
                best, p = min(theirs, key=lambda kp: kp[1]["ttft_p50_s"] or float("inf"))
                if p["ttft_p50_s"] and point(ours, top, kind)["ttft_p50_s"]:
                    found[f"{prefix}ttft_p50_c{top}"] = {
                        "peer": best, "ratio": point(ours, top, kind)["ttft_p50_s"] / p["ttft_p50_s"]}
        for figure in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
            theirs = [(k, p) for k in peers if (p := point(k, one)) and p[figure]]
            if point(ours, one) and point(ours, one)[figure] and theirs:
                best, p = min(theirs, key=lambda kp: kp[1][figure])
                found[f"{figure[:-2]}_c{one}"] = {"peer": best, "ratio": point(ours, one)[figure] / p[figure]}
    # The proposed buckets against the example's (above 1: the proposed are better).
    for conc in CONCURRENCY:
        default, proposed = point("neuron-serve", conc), point("neuron-serve-proposed", conc)
        if default and proposed:
            result.setdefault("proposed", {})[f"c{conc}"] = {
                "ttft_p50": default["ttft_p50_s"] / proposed["ttft_p50_s"],
                "tpot_p50": default["tpot_p50_s"] / proposed["tpot_p50_s"],
                "tokens_per_s": proposed["tokens_per_s"] / default["tokens_per_s"]}
    return result


def report(figures: dict) -> str:
    systems = figures["systems"]
    lines = ["| server | conc | requests | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | errors | short |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, entry in systems.items():
        if entry.get("failed"):
            lines.append(f"| {entry['label']} | | | failed: {entry['failed'][:80]} | | | | |")
        points = [(str(c), p) for c, p in entry.get("points", {}).items()]
        points += [(f"{c} sampled", p) for c, p in entry.get("sampled", {}).items()]
        for conc, p in points:
            lines.append(f"| {entry['label']} | {conc} | {p['requests']} | {p['tokens_per_s']:.1f} | "
                         f"{ms(p['ttft_p50_s'])} / {ms(p['ttft_p99_s'])} | {ms(p['tpot_p50_s'])} / "
                         f"{ms(p['tpot_p99_s'])} | {p['errors']} | {p['short']} |")
    labels = {k: e["label"] for k, e in systems.items()}
    top, one = max(CONCURRENCY), min(CONCURRENCY)
    for ours, found in figures["ratios"].items():
        if ours == "proposed":
            continue
        lines += ["", f"{labels[ours]} against the best peer of the same run (n/a: a figure is missing):", ""]
        for name, text in [(f"tokens_per_s_c{top}", f"output tok/s at concurrency {top}"),
                           (f"sampled_tokens_per_s_c{top}", f"output tok/s at concurrency {top}, sampled"),
                           (f"ttft_p50_c{top}", f"TTFT p50 at concurrency {top}"),
                           (f"sampled_ttft_p50_c{top}", f"TTFT p50 at concurrency {top}, sampled"),
                           (f"ttft_p50_c{one}", f"TTFT p50 at concurrency {one}"),
                           (f"ttft_p99_c{one}", f"TTFT p99 at concurrency {one}"),
                           (f"tpot_p50_c{one}", f"TPOT p50 at concurrency {one}"),
                           (f"tpot_p99_c{one}", f"TPOT p99 at concurrency {one}")]:
            r = found.get(name)
            lines.append(f"- {text}: " + (f"{r['ratio']:.2f}x {labels[r['peer']]}'s" if r else "n/a"))
    if proposed := figures["ratios"].get("proposed"):
        lines += ["", "neuron-serve with the buckets `neuron-serve buckets` proposes from the sizes the first run "
                      f"recorded ({labels.get('neuron-serve-proposed', 'n/a')}) against the example's (above 1: the "
                      "proposed are better):", ""]
        for conc in CONCURRENCY:
            if r := proposed.get(f"c{conc}"):
                lines.append(f"- concurrency {conc}: TTFT p50 {r['ttft_p50']:.2f}x, TPOT p50 {r['tpot_p50']:.2f}x, "
                             f"output tok/s {r['tokens_per_s']:.2f}x")
    engine = [(e["label"], f"{conc}{' sampled' if kind == 'sampled' else ''}", p["engine"])
              for e in systems.values() for kind in ("points", "sampled")
              for conc, p in e.get(kind, {}).items() if p.get("engine")]
    if engine:
        lines += ["", "Where neuron-serve's engine spent its steps (its own metrics, means over each point):", ""]
        lines += [f"- {label}, concurrency {conc}: {_engine_text(split)}" for label, conc, split in engine]
    cpu = [(e["label"], f"{conc}{' sampled' if kind == 'sampled' else ''}", p["cpu"])
           for e in systems.values() for kind in ("points", "sampled")
           for conc, p in e.get(kind, {}).items() if p.get("cpu")]
    if cpu:
        lines += ["", "The CPU each kind of process used during each point (percent of one CPU; the emulated cores "
                      "compute in the engine process):", ""]
        lines += [f"- {label}, concurrency {conc}: {cpu_shares.text(found_)}" for label, conc, found_ in cpu]
    if padded := {k: e["padding"] for k, e in systems.items() if e.get("padding")}:
        lines += ["", "Padded work over real work (the replica's `parameters.padding` after its run, warm-up "
                      "included): " + "; ".join(f"{labels[k]}: " + ", ".join(f"{family} {x:.2f}x"
                                                                            for family, x in found_.items())
                                                for k, found_ in padded.items())]
    w = figures["workload"]
    lines += ["", f"Workload: {w['requests']} streamed /v1/completions requests per server at temperature 0 (and the "
              f"sampled points at temperature {SAMPLING['temperature']}, top_p {SAMPLING['top_p']}, a seed each), prompts "
              f"{w['prompt_tokens']} tokens, {w['new_tokens']} new tokens each ({figures['mode']} run; requests per "
              f"point {figures['requests_per_point']}); load average {figures['load_average'][0]:.1f} at the start, "
              f"{figures['load_average'][-1]:.1f} at the end on {os.cpu_count()} cores. `short`: requests whose "
              "usage.completion_tokens differs from their max_tokens."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    all_keys = ["neuron-serve", "neuron-serve-defaults", "transformers-cb", "transformers", "ray"]
    parser = argparse.ArgumentParser(prog="python -m bench.generate_http", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests per point (a few seconds each)")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    parser.add_argument("--servers", default=",".join(all_keys),
                        help="comma-separated subset of: " + ", ".join(all_keys))
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR, help="the model directory (make llm-example)")
    parser.add_argument("--proposed", action="store_true",
                        help="after neuron-serve, serve it again on the prefill and decode-rows buckets `neuron-serve "
                             "buckets` proposes from the sizes its replica recorded, and compare the two")
    args = parser.parse_args(argv)
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if not (args.model_dir / "config.json").exists():
        print(f"[generate_http] no model in {args.model_dir}: run `make llm-example`", file=sys.stderr)
        return 1

    from transformers import AutoTokenizer  # noqa: PLC0415

    def log(message: str) -> None:
        print(f"[generate_http] {message}", flush=True)

    mode = "quick" if args.quick else "full"
    counts = REQUESTS[mode]
    requests = make_workload(AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True),
                             WARMUP + sum(counts.values()) + sum(SAMPLED[mode].values()))
    warmup, start, slices, sampled = requests[:WARMUP], WARMUP, {}, {}
    for conc in CONCURRENCY:
        slices[conc], start = requests[start:start + counts[conc]], start + counts[conc]
    for conc, count in SAMPLED[mode].items():
        sampled[conc] = [{**r, "seed": start + i} for i, r in enumerate(requests[start:start + count])]
        start += count
    measured = requests[WARMUP:]
    keys = args.servers.split(",")
    if unknown := set(keys) - set(all_keys):
        parser.error(f"unknown servers: {', '.join(sorted(unknown))}")
    chosen = specs(args.model_dir, out / "neuron-serve-llm.yaml")
    if "neuron-serve" in keys:
        write_neuron_serve_yaml(args.model_dir, out / "neuron-serve-llm.yaml")
    if "neuron-serve-defaults" in keys:
        write_defaults_yaml(args.model_dir, out / DEFAULTS_YAML)
    load, systems = [os.getloadavg()[0]], {}
    log(f"{len(keys)} servers x concurrency {', '.join(map(str, CONCURRENCY))} ({mode}); "
        f"results in {out}")
    for key in keys:
        spec, model, extra = chosen[key]
        started = time.time()
        systems[key] = measure_server(key, spec, model, extra, slices, warmup, out, log, sampled)
        if key == "neuron-serve" and args.proposed and not systems[key].get("failed"):
            # The prefill and decode-rows buckets the recorded sizes call for (as many as today, the largest kept):
            # what `prefill_buckets: auto` and `decode_batch_buckets: auto` start on after this traffic.
            sizes = recorded_sizes(model, started)
            if not sizes.get("prefill"):
                log("  no sizes recorded in the compile cache (NEURON_SERVE_CACHE_DIR=off?): no proposed buckets")
                continue
            (sizes_path := out / "llm-sizes.json").write_text(json.dumps(sizes))
            families = proposed_buckets(out / "neuron-serve-llm.yaml", sizes_path)
            prefill, rows = families["prefill"]["proposed"], families.get("decode_rows", {}).get("proposed")
            log(f"  neuron-serve buckets proposes prefill buckets {prefill}, decode rows {rows}")
            write_neuron_serve_yaml(args.model_dir, out / "neuron-serve-proposed-llm.yaml", prefill, rows)
            spec, model, extra = proposed_spec(chosen, out / "neuron-serve-proposed-llm.yaml",
                                               f"neuron-serve, prefill {prefill}, decode rows {rows}")
            systems["neuron-serve-proposed"] = measure_server("neuron-serve-proposed", spec, model, extra, slices,
                                                              warmup, out, log, sampled)
    load.append(os.getloadavg()[0])
    lengths = sorted(r["prompt_tokens"] for r in measured)
    figures = {"mode": mode, "requests_per_point": counts, "load_average": load, "systems": systems,
               "workload": {"requests": len(measured), "prompt_tokens": f"{lengths[0]}-{lengths[-1]}",
                            "new_tokens": f"{min(r['max_tokens'] for r in measured)}-"
                                          f"{max(r['max_tokens'] for r in measured)}",
                            "output_tokens": sum(r["max_tokens"] for r in measured)}}
    figures["ratios"] = ratios(systems)
    markdown = report(figures)
    (out / "generate_http.md").write_text(markdown + "\n")
    (out / "generate_http.json").write_text(json.dumps(figures, indent=2))
    print(markdown, flush=True)
    log(f"wrote {out / 'generate_http.md'} and {out / 'generate_http.json'}")
    # Non-zero when a server failed to start or answered with errors: the report is written either way.
    return 1 if any(e.get("failed") or any(p["errors"] for p in e["points"].values()) for e in systems.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
