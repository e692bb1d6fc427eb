"""Where one request's time goes at concurrency 1: W1 (the example MLP, batch 1, OIP v2 JSON).

    python -m bench.latency [--quick] [--py-spy] [--out DIR]

Three parts, each re-runnable alone on a quiet machine:

1. **In process, layer by layer** (no Ray, no HTTP). The same request is timed through
   ever more of the serving path, each layer adding one stage, so the difference between
   two rows is what that stage costs a lone request: the accelerator stage's transfer in,
   execution and transfer out (on the core's thread), the CPU stage, the pipeline's walk
   on the event loop's thread (where a lone request runs; the hand-out to the core's thread
   and back that a request under load pays is shown beside it), the runner's placement,
   collation and split, the batcher and the data plane's look for other requests, and the
   codec (parse, checks, encode, metrics).
2. **Served**: neuron-serve (`deployments/mlp.yaml`) and plain Ray Serve + HAProxy running
   the eager MLP, one at a time, under wrk at concurrency 1. For neuron-serve the replica's
   own timestamps (Triton's statistics: decode, queue, execute, encode) say how much of the
   client's latency is spent inside the model app; the rest is the ingress (HAProxy, Ray's
   direct-ingress HTTP server, the ASGI app) and the network. CPU time per request of each
   process (the model's replica, HAProxy, the rest), less what it uses idle, says where
   the work is.
3. With ``--py-spy``, a sampling profile of neuron-serve's replica during the served run
   (the thread holding the GIL), summarized as the functions where the replica spends its
   time (``py-spy`` is in the bench extra). The profiler slows the replica: its run's
   latencies are not comparable with the others.

The served part runs first; the in-process part then builds the model in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "2")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deployments" / "mlp.yaml"
IDLE_S = 5.0  # seconds of no load over which each server's own CPU use is measured


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _timed(fn, calls: int) -> float:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return _median_ms(samples)


async def _atimed(factory, calls: int, before=None) -> float:
    """Median ms of ``await factory()``; ``before()``, if given, runs untimed ahead of each call."""
    samples = []
    for _ in range(calls):
        if before is not None:
            before()
        started = time.perf_counter()
        await factory()
        samples.append(time.perf_counter() - started)
    return _median_ms(samples)


def in_process(calls: int) -> list[dict]:
    """Median ms of one batch-1 request through each layer of the serving path, innermost first."""
    import torch  # noqa: PLC0415

    from neuron_serve.assembly.from_config import build  # noqa: PLC0415
    from neuron_serve.compile.subgraph import CompiledSubgraph  # noqa: PLC0415
    from neuron_serve.config.schema import load_config  # noqa: PLC0415
    from neuron_serve.serve.protocols import oip_rest  # noqa: PLC0415
    from neuron_serve.serve.infer.http import infer as rest_infer  # noqa: PLC0415
    from neuron_serve.serve.infer.plane import ModelDataPlane  # noqa: PLC0415

    config = load_config(CONFIG)
    model = build(config, CONFIG.parent)
    x = torch.rand(1, 784, generator=torch.Generator().manual_seed(0))
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 784],
                                   "data": x.flatten().tolist()}]}).encode()
    rows: list[dict] = []

    async def measure() -> None:
        plane = ModelDataPlane(config, model, replica="bench")
        plane.start()
        try:
            runner = plane.runner
            core = runner.cores.cores[0]
            pipeline = runner.pipelines[0][1]
            [(accel_name, accel)] = pipeline.modules[0].items()
            assert isinstance(accel, CompiledSubgraph)
            [(cpu_name, cpu)] = pipeline.cpu_modules.items()
            for _ in range(20):  # warm every path
                await rest_infer(plane, body, {})

            phases: dict[str, list[float]] = {"to_device_s": [], "compute_s": [], "to_cpu_s": []}

            def timed_phases():
                _, times = accel.timed(x)
                for key, value in times.items():
                    phases[key].append(value)

            for _ in range(calls):
                core.submit(timed_phases).result()
            for key, label in (("to_device_s", "transfer in (host to core)"), ("compute_s", "execute (compiled)"),
                               ("to_cpu_s", "transfer out (core to host)")):
                rows.append({"layer": f"accelerator stage `{accel_name}`: {label}", "ms": _median_ms(phases[key]),
                             "kind": "part"})
            hidden = core.submit(accel, x).result()
            with torch.no_grad():
                rows.append({"layer": f"CPU stage `{cpu_name}` (sort)", "kind": "part",
                             "ms": _timed(lambda: cpu(hidden), calls)})
            with torch.no_grad():
                rows.append({"layer": "both stages, called on the core's thread", "kind": "layer",
                             "ms": core.submit(_timed, lambda: cpu(accel(x)), calls).result()})
            rows.append({"layer": "+ the pipeline's walk, on the event loop's thread (Pipeline.run inline: "
                                  "a lone request at concurrency 1)", "kind": "layer",
                         "ms": await _atimed(lambda: pipeline.run([x], core, inline=True), calls)})
            rows.append({"layer": "for comparison: the walk with each stage handed to its thread and back "
                                  "(Pipeline.run, as under load)", "kind": "part",
                         "ms": await _atimed(lambda: pipeline.run([x], core), calls)})
            rows.append({"layer": "+ placement, collation, split, choice of core (ModelRunner.infer inline)",
                         "kind": "layer", "ms": await _atimed(lambda: runner.infer([[x]], inline=True), calls)})
            decoded = oip_rest.parse_infer_request(body, {}, model="mlp")
            # A request's metric updates are applied once its answer is out (DeferredMetrics); served at
            # concurrency 1 that happens while the replica waits for the next request, so here too it is
            # done between calls, untimed.
            flush = plane.observer.deferred.flush
            rows.append({"layer": "+ the batcher (idle, so in the caller's task), the data plane's look for other "
                                  "requests, output selection (ModelDataPlane.infer of a decoded request)",
                         "kind": "layer", "ms": await _atimed(lambda: plane.infer(decoded), calls, flush)})
            rows.append({"layer": "+ JSON parse, checks, encode (the REST route's infer: oip_rest around the plane)",
                         "kind": "layer", "ms": await _atimed(lambda: rest_infer(plane, body, {}), calls, flush)})
        finally:
            await plane.stop()

    asyncio.run(measure())
    from bench.peers.models import EagerModels  # noqa: PLC0415

    eager = EagerModels()
    array = x.numpy()
    rows.append({"layer": "for reference: the peers' eager MLP (EagerModels.run_mlp, same weights)", "kind": "part",
                 "ms": _timed(lambda: eager.run_mlp(array), calls)})
    return rows


def _stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/mlp/stats", timeout=10) as response:
        return json.load(response)["model_stats"][0]["inference_stats"]


def _replica_pids(server) -> list[int]:
    from bench import servers  # noqa: PLC0415

    pids = []
    for pid in servers._pids(server.proc.pid):  # noqa: SLF001
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmdline.startswith("ray::ServeReplica:mlp"):
            pids.append(pid)
    return pids


def _cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each kind of process under ``root``: the model's
    replica, HAProxy, and everything else (Ray's own processes, the server app)."""
    from bench import servers  # noqa: PLC0415

    tick = os.sysconf("SC_CLK_TCK")
    found: dict[str, float] = Counter()
    for pid in servers._pids(root):  # noqa: SLF001
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kind = ("model replica" if cmdline.startswith("ray::ServeReplica:mlp") else
                "HAProxy" if "haproxy" in cmdline.split(" ")[0] else "other processes")
        found[kind] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return found


def _specs():
    """neuron-serve with only the MLP, and Ray Serve + HAProxy, on ports of their own (so a
    breakdown can run beside `make bench`'s servers)."""
    from bench import servers  # noqa: PLC0415

    known = servers.specs()
    ours = known["neuron-serve"]
    cli = ours.command[0]
    return [
        dataclasses.replace(ours, command=[cli, "deploy", "deployments/mlp.yaml", "--host", "127.0.0.1",
                                           "--port", "18800"], port=18800, grpc_port=None),
        dataclasses.replace(known["ray-haproxy"], command=[*known["ray-haproxy"].command[:-3], "--port", "18900",
                                                           "--haproxy"], port=18900),
    ]


def served(seconds: float, out: Path, py_spy: bool) -> dict:
    """wrk at concurrency 1 on W1 against neuron-serve and Ray Serve + HAProxy, one at a time."""
    from bench import loadgen, servers, workloads  # noqa: PLC0415

    manifest = workloads.write_bodies(workloads.WORKLOADS["W1"], out / "bodies" / "W1")
    probe = {"mlp": workloads.first_body(manifest)}
    results: dict = {}
    for spec in _specs():
        key = spec.key
        server = servers.Server(spec, out / "logs")
        try:
            server.wait_ready(probe)
            url = server.url("mlp")
            loadgen.run_load(url, manifest, 1, 2)  # warm-up
            before = _stats(spec.port) if key == "neuron-serve" else None
            profiler = None
            if py_spy and key == "neuron-serve":
                [pid] = _replica_pids(server)
                profiler = subprocess.Popen(
                    [str(Path(sys.executable).with_name("py-spy")), "record", "-p", str(pid), "-d", str(round(seconds)),
                     "-r", "1000", "--gil", "-f", "raw", "-o", str(out / "py-spy.txt")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # What the processes burn with no request at all (Ray's own work), taken off below.
            idle_before, idle_started = _cpu_seconds(server.proc.pid), time.perf_counter()
            time.sleep(IDLE_S)
            idle = {kind: (used - idle_before.get(kind, 0.0)) / (time.perf_counter() - idle_started)
                    for kind, used in _cpu_seconds(server.proc.pid).items()}
            cpu_before = _cpu_seconds(server.proc.pid)
            load = loadgen.run_load(url, manifest, 1, seconds)
            cpu_after = _cpu_seconds(server.proc.pid)
            if profiler is not None:
                profiler.wait(timeout=60)
            row = load.as_dict()
            # Idle use is itself measured, so a process that did little under load can come out
            # below zero; it is shown as 0.
            row["cpu_ms_per_request"] = {
                kind: max(0.0, (cpu_after[kind] - cpu_before.get(kind, 0.0) - idle.get(kind, 0.0) * load.seconds)
                          * 1e3 / max(load.requests, 1)) for kind in cpu_after}
            if before is not None:
                after = _stats(spec.port)
                count = after["success"]["count"] - before["success"]["count"]
                row["replica_ms"] = {stat: (after[stat]["ns"] - before[stat]["ns"]) / max(count, 1) / 1e6
                                     for stat in ("compute_input", "queue", "compute_infer", "compute_output",
                                                  "success")}
            results[key] = row
        finally:
            server.stop()
    return results


def profile_summary(path: Path, top: int = 25) -> str:
    """The functions py-spy saw the replica in most (own samples), from its raw (collapsed) output."""
    own: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        total += int(count)
        own[frames[-1]] += int(count)
    out = [f"{total} samples of the thread holding the GIL", "", "| share | function (file:line) |", "|---|---|"]
    for frame, count in own.most_common(top):
        out.append(f"| {count / total:.1%} | `{frame}` |")
    return "\n".join(out)


def report(layers: list[dict], serving: dict | None) -> str:
    out = ["### In process: W1 batch 1, median of sequential calls", "",
           "| stage | ms | adds |", "|---|---|---|"]
    previous = None
    for row in layers:
        adds = "" if row["kind"] == "part" or previous is None else f"{row['ms'] - previous:+.3f}"
        out.append(f"| {row['layer']} | {row['ms']:.3f} | {adds} |")
        if row["kind"] == "layer":
            previous = row["ms"]
    if serving:
        out += ["", "### Served: wrk, concurrency 1", "",
                "| server | req/s | p50 ms | p99 ms | inside the model app ms (decode / queue / execute / encode) |",
                "|---|---|---|---|---|"]
        for key, row in serving.items():
            inside = row.get("replica_ms")
            split = (f"{inside['success']:.3f} ({inside['compute_input']:.3f} / {inside['queue']:.3f} / "
                     f"{inside['compute_infer']:.3f} / {inside['compute_output']:.3f})" if inside else "")
            out.append(f"| {key} | {row['rps']:.0f} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {split} |")
        kinds = sorted({kind for row in serving.values() for kind in row["cpu_ms_per_request"]})
        out += ["", "CPU ms per request, by process (user + system, less what the process uses idle; at "
                "concurrency 1 most of it is on the request's path):", "", "| server | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
        for key, row in serving.items():
            cpu = row["cpu_ms_per_request"]
            out.append(f"| {key} | " + " | ".join(f"{cpu.get(kind, 0.0):.3f}" for kind in kinds) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer calls and shorter load")
    parser.add_argument("--in-process-only", action="store_true", help="skip the served part")
    parser.add_argument("--served-only", action="store_true", help="skip the in-process part")
    parser.add_argument("--py-spy", action="store_true", help="profile neuron-serve's replica while it serves")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / time.strftime("latency-%Y%m%d-%H%M%S"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # Served first: the in-process part leaves this process holding the compiled model and
    # XLA's threads, and a server measured beside that ran measurably slower.
    serving = None if args.in_process_only else served(5 if args.quick else 15, args.out, args.py_spy)
    layers = [] if args.served_only else in_process(300 if args.quick else 1000)
    markdown = report(layers, serving)
    if args.py_spy and (args.out / "py-spy.txt").exists():
        markdown += "\n\n### Where neuron-serve's replica spends its time (py-spy)\n\n" + \
                    profile_summary(args.out / "py-spy.txt")
    (args.out / "latency.md").write_text(markdown + "\n")
    (args.out / "latency.json").write_text(json.dumps({"in_process": layers, "served": serving}, indent=2))
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
