"""The neuron-serve command line."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
from pathlib import Path

from .analysis.capture import capture
from .api import placement
from .analysis.placement import analyze_graph
from .analysis.report import build_report, log_support, write_report
from .compile import cache as compile_cache
from .config.compiler_args import parse_compiler_args
from .config.pooling import POOLING_TASKS
from .config.factory import build_model
from .config.schema import load_config, load_deployment, parse_config
from . import logs
from .errors import NeuronServeError
from .partition.config import PartitionerConfig
from .partition.plan import plan_partitions
from .targets import get_target


def _analyze(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    base_dir = Path(args.config).resolve().parent
    if config.task == "generate":
        return _analyze_generation(args, config, base_dir)
    if config.task in POOLING_TASKS:
        return _pooling_refused("analyze", config.task)
    model = build_model(config, base_dir)
    captured = capture(model, config.example_inputs())
    settings = config.partitioner_config(base_dir)
    params = (settings or PartitionerConfig()).analyze  # model.yaml's partitioner.analyze_parameters
    cc_args = (settings.trace_kwargs.get("compiler_args") if settings else None) \
        or parse_compiler_args(config.compiler_args)
    analysis = analyze_graph(captured, get_target(config.target), ignored_ops=params.additional_ignored_ops,
                             max_workers=params.max_workers, compiler_flags=tuple(cc_args.cache_key()))
    if params.compiler_workdir:
        print(f"wrote {write_report(analysis, params.compiler_workdir)}", file=sys.stderr)
    report = build_report(analysis)
    log_support(analysis)
    if args.html or args.report_json:
        # Written before the plan below can refuse the config: a refused plan is what it helps to see.
        from .report import partition_report  # noqa: PLC0415

        data = partition_report.build(config, model, captured, analysis, profile_runs=args.profile)
        for path in partition_report.write(data, html=args.html, json_path=args.report_json):
            print(f"wrote {path}", file=sys.stderr)
    partitioner = settings or PartitionerConfig(model_support_percentage_threshold=0.0)
    if config.partitioner is None and analysis.unsupported():
        report["partitions"] = None
        logging.getLogger("neuron_serve").warning(
            "Unsupported operators and no 'partitioner' section: trace would refuse this model."
        )
    else:
        plan = plan_partitions(copy.deepcopy(captured.gm), placement(analysis), partitioner)
        report["partitions"] = plan.describe()
    placed = config.model_placement()
    cores = args.pipeline_cores or (placed.cores_per_pipeline if placed.pipelined else 0)
    if cores:
        from .partition.pipeline import plan_graph  # noqa: PLC0415
        from .partition.plan import ACCEL_PREFIX  # noqa: PLC0415

        # The captured graph and names trace compiles: the plan a deployment of this model.yaml runs.
        stages = plan_graph(copy.deepcopy(captured.gm), captured.flat_inputs, cores,
                            args.pipeline_mode or placed.balance_mode, prefix=ACCEL_PREFIX)
        print(stages.describe(), file=sys.stderr)
        report["pipeline"] = stages.to_dict()
    return _print_report(report, args.json)


def _pooling_refused(command: str, task: str) -> int:
    print(f"error: neuron-serve {command} takes task: infer and generate models; a task: {task} model is compiled by "
          f"each replica from its model.pretrained directory when deployed (neuron-serve deploy), and its build "
          f"prints its length buckets and placement", file=sys.stderr)
    return 2


def _print_report(report: dict, path: str | None) -> int:
    """The analyze report as JSON, to ``path`` (--json) or stdout."""
    text = json.dumps(report, indent=2)
    if path:
        Path(path).write_text(text + "\n")
        print(f"wrote {path}", file=sys.stderr)
    else:
        print(text)
    return 0


def _analyze_generation(args: argparse.Namespace, config, base_dir: Path) -> int:
    from .generation.compiling.analyze import forms  # noqa: PLC0415

    if args.pipeline_cores or args.profile:
        print("error: --pipeline-cores and --profile apply to task: infer models; a task: generate model runs each "
              "compiled model on one core, and its times are the engine's step metrics", file=sys.stderr)
        return 2
    reports, pages = {}, {}
    for form in forms(config, base_dir):
        reports[form.label] = build_report(form.analysis)
        if form.split is not None:  # each weight's split and the bytes per core
            reports[form.label]["tensor_parallel"] = form.split
        if form.lora is not None:  # the LoRA adapter buffers every compiled model takes
            reports[form.label]["lora"] = form.lora
        reports[form.label]["memory"] = form.memory  # dtype, quantization, KV cache: bytes a core, slots that fit
        if args.html or args.report_json:
            from .report import partition_report  # noqa: PLC0415

            data = partition_report.build(config, form.model, form.captured, form.analysis)
            data["model"] = f"{config.name} ({form.label})"
            data["tensor_parallel"] = form.split
            data["lora"] = form.lora
            data["memory"] = form.memory
            pages[form.label] = data
    if args.html:  # one page per compiled model, named after its bucket
        html = Path(args.html)
        for label, data in pages.items():
            path = html.with_name(f"{html.stem}-{label}{html.suffix or '.html'}")
            print(f"wrote {partition_report.write(data, html=str(path))[0]}", file=sys.stderr)
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(pages, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.report_json}", file=sys.stderr)
    return _print_report(reports, args.json)


def _build(args: argparse.Namespace) -> int:
    from .assembly import artifact  # noqa: PLC0415
    from .assembly.from_config import build  # noqa: PLC0415

    config = load_config(args.config)
    if config.model.artifact is not None:
        print(f"error: {args.config} already names an artifact ({config.model.artifact}); build from a model.yaml "
              "with a 'factory'.", file=sys.stderr)
        return 2
    if config.task in POOLING_TASKS:
        return _pooling_refused("build", config.task)
    out = Path(args.output)
    # The artifact's own model.yaml serves it as is: its model source is the artifact.
    served = config.model_dump(mode="json", exclude_none=True, exclude_unset=config.task == "generate")
    served["model"] = {"artifact": "."}
    if config.task == "generate":
        return _build_generation(args, config, served, out)
    built = build(config, Path(args.config).resolve().parent)
    # The artifact's weights already are the checkpoint's, when one was swapped in.
    served.pop("weights", None)
    artifact.save(built, out, config=served, source=str(args.config))
    print(f"built {config.name} in {built.build_info.seconds:.1f}s -> {out} (serve it: neuron-serve deploy {out})", file=sys.stderr)
    return 0


def _build_generation(args: argparse.Namespace, config, served: dict, out: Path) -> int:
    from .generation.compiling.artifact import save_generation  # noqa: PLC0415
    from .config.generation import refuse_lora  # noqa: PLC0415
    from .generation.compiling.build import compile_from_config  # noqa: PLC0415

    refuse_lora(config.generation, "neuron-serve build (an artifact)")
    started = time.perf_counter()
    model, eos, tokenizer = compile_from_config(config, Path(args.config).resolve().parent)
    served.pop("tokenizer", None)  # the artifact carries its own copy
    speculative = served.get("generation", {}).get("speculative_config") or {}
    if speculative.get("model") is not None:  # and its draft, compiled, in a folder of its own
        from .generation.compiling.artifact import DRAFT_DIR  # noqa: PLC0415

        speculative["model"] = DRAFT_DIR
    save_generation(model, out, eos_token_ids=eos, tokenizer=tokenizer, config=served, source=str(args.config))
    print(f"built {config.name} ({len(model.shapes)} compiled models) in {time.perf_counter() - started:.1f}s -> "
          f"{out} (serve it: neuron-serve deploy {out})", file=sys.stderr)
    return 0


def _deploy(args: argparse.Namespace) -> int:
    from .serve.ray import ingress  # noqa: PLC0415

    # Before Ray is imported: Ray Serve reads its ingress settings at import.
    chosen = ingress.configure(args.ingress, reserved_ports={p for p in (args.port, args.grpc_port) if p})
    from .serve.http import auth  # noqa: PLC0415 - Ray is only needed to serve
    from .serve import failure  # noqa: PLC0415
    from .serve.ray import cluster, deploy, deployment, haproxy_template, lifecycle  # noqa: PLC0415 - Ray is only needed to serve
    from .serve.ray import grpc_port  # noqa: PLC0415 - Ray is only needed to serve

    configs = [load_deployment(path) for path in args.configs]
    if args.weights:
        if len(configs) != 1:
            print("error: --weights names one checkpoint; deploy one model with it (or give each model.yaml "
                  "its own 'weights')", file=sys.stderr)
            return 2
        config, base_dir = configs[0]
        weights = str(Path(args.weights).expanduser().resolve())
        configs = [(parse_config({**config.model_dump(), "weights": weights}, f"{args.configs[0]} with --weights"),
                    base_dir)]
    from .assembly.from_config import check_weights  # noqa: PLC0415

    for config, base_dir in configs:
        auth.resolve_token(config)  # a missing token fails here, before Ray starts
        check_weights(config, base_dir)  # so does a checkpoint that does not fit its artifact
    names = [c.name for c, _ in configs]
    if len(set(names)) != len(names):
        print(f"error: model names must differ, got {names}", file=sys.stderr)
        return 2
    host = args.host or configs[0][0].http.host
    port = args.port or configs[0][0].http.port
    if args.no_grpc and args.grpc_port:
        print("error: --no-grpc and --grpc-port contradict each other; give one", file=sys.stderr)
        return 2
    grpc = None if args.no_grpc else grpc_port.options([c for c, _ in configs], host, args.grpc_port)
    if grpc and chosen == "haproxy":  # read by the HAProxy of a Ray started here (haproxy_template)
        os.environ[haproxy_template.GRPC_FRONT_ENV] = f"{grpc['host']}:{grpc['port']}"
    if args.no_ray_dashboard and (args.address or os.environ.get("RAY_ADDRESS")):
        print("error: --no-ray-dashboard applies to a Ray started here; a joined cluster keeps its own dashboard",
              file=sys.stderr)
        return 2
    started_here = cluster.connect(args.address, dashboard=not args.no_ray_dashboard)
    if grpc:
        grpc["front"] = grpc_port.front(started_here, chosen)
    life = lifecycle.Lifecycle(deploy, cluster, drain_s=deployment.DRAIN_S)
    if started_here:
        life.install()  # from here on a signal stops the start-up too
    try:
        states = deploy.deploy(configs, host, port, grpc=grpc)
    except lifecycle.Interrupted as exc:
        return life.shutdown(f"{exc} while starting")
    codes = []
    for name, state in states.items():
        if state == "ready":
            print(f"{name}: ready", file=sys.stderr)
        elif state.startswith("failed: "):
            error = state.removeprefix("failed: ")
            print(f"error: model {name!r} failed to start: {error}", file=sys.stderr)
            codes.append(failure.exit_code(error))
        else:
            print(f"error: model {name!r} is not ready: {state}", file=sys.stderr)
            codes.append(1)
    if codes:
        deploy.shutdown(names if not started_here else None)
        return max(codes)
    if grpc:
        print(f"gRPC (OIP v2) on {grpc['host']}:{grpc['port']}", file=sys.stderr)
    if any(c.task == "generate" or c.task in POOLING_TASKS for c, _ in configs):
        print(f"OpenAI API on http://{host}:{port}/v1", file=sys.stderr)
    print(f"serving {', '.join(names)} on http://{host}:{port}/v2 (metrics: /metrics; ingress: {chosen}; "
          f"Ray at {cluster.ray_address()})", file=sys.stderr, flush=True)
    if started_here:
        # This process owns the Ray instance: serve until stopped, then drain.
        return life.serve_forever()
    return 0


def _status(args: argparse.Namespace) -> int:
    from .serve.ray import cluster, deploy  # noqa: PLC0415

    cluster.connect(args.address or "auto")
    found = deploy.status()
    if not args.buckets:
        print(json.dumps(found, indent=2))
        return 0
    from .buckets.usage import describe  # noqa: PLC0415

    models = {name: state for name, state in found.items() if "padding" in state or "compile" in state}
    if not models:
        print("no model is counting its buckets' padding (none deployed, or none has started)")
    for name, state in models.items():
        print(describe(name, state.get("padding", {}), state.get("padding_replicas", 1)))
    return 0


def _buckets(args: argparse.Namespace) -> int:
    from .buckets import proposal, usage  # noqa: PLC0415

    config = load_config(args.config)
    if args.sizes:
        sizes, source = proposal.read_sizes(args.sizes), args.sizes
    else:
        store = compile_cache.current()
        if store is None:
            print("error: --sizes: the compile cache is off, so no replica kept its sizes; pass a file of sizes",
                  file=sys.stderr)
            return 2
        where = usage.traffic_dir(store.root, config.name)
        replicas = usage.replicas_recorded(store.root, config.name)
        sizes, source = usage.recorded(store.root, config.name), f"{where} ({replicas} replica{'s' * (replicas != 1)})"
    min_calls = proposal.MIN_CALLS if args.min_calls is None else args.min_calls
    families = proposal.propose(config, Path(args.config).resolve().parent, sizes, args.max_models, min_calls)
    if not families:
        print(f"error: no sizes recorded for {config.name} in {source}: serve it first (each replica writes its "
              f"sizes {usage.SAVE_DELAY_S:g} s after a call at most, and when it stops), or pass --sizes FILE",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(families, indent=2))
    else:
        print(proposal.report(config.name, families, source))
    return 0


def _shutdown(args: argparse.Namespace) -> int:
    from .serve.ray import cluster, deploy  # noqa: PLC0415

    cluster.connect(args.address or "auto")
    deploy.shutdown(args.names or None)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuron-serve", description=__doc__)
    verbose_help = "debug logging, and the partitioner's operator lists of every compiled model"
    parser.add_argument("-v", "--verbose", action="store_true", help=verbose_help)
    # Also after the command (`neuron-serve deploy x.yaml -v`); not given there, the flag above stands.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose_help)
    parser.add_argument("--cache-dir", metavar="DIR",
                        help=f"persistent compile cache (default: ${compile_cache.CACHE_ENV}, else the user cache dir; "
                             "'off' disables it)")
    sub = parser.add_subparsers(dest="command", required=True)
    analyze = sub.add_parser("analyze", parents=[common],
                             help="report operator support and the partition plan of a model.yaml")
    analyze.add_argument("config", help="path to a model.yaml")
    analyze.add_argument("--json", metavar="PATH", help="write the report (with the plan) to PATH")
    analyze.add_argument("--html", metavar="PATH", help="write the partition report page (one self-contained file; for a task: "
                         "generate model one per compiled model, PATH's stem followed by its bucket)")
    analyze.add_argument("--report-json", metavar="PATH", help="write the partition report's data as JSON")
    analyze.add_argument("--profile", type=int, nargs="?", const=5, default=0, metavar="RUNS",
                         help="with --html/--report-json: compile, run the example inputs RUNS times (default 5) "
                              "and add the measured times")
    analyze.add_argument("--pipeline-cores", type=int, default=0, metavar="N",
                         help="plan the model as a pipeline over N cores (core memory: 16 GiB, or "
                              "$NEURON_SERVE_CORE_MEMORY_BYTES in emulation) and print its stages; default: "
                              "the model.yaml's placement, when it is a pipeline")
    analyze.add_argument("--pipeline-mode", choices=("size_based", "cost_aware", "kl_based", "latency"), default=None,
                         help="split by memory (size_based), torch's latency cost model (cost_aware, kl_based) or "
                              "into stages of even measured latency (latency); default: the model.yaml's "
                              "placement.balance, else size_based")
    analyze.set_defaults(func=_analyze)

    build = sub.add_parser("build", parents=[common],
                           help="compile a model.yaml ahead of time into an artifact directory")
    build.add_argument("config", help="path to a model.yaml")
    build.add_argument("-o", "--output", required=True, metavar="DIR", help="artifact directory to write")
    build.set_defaults(func=_build)

    deploy = sub.add_parser("deploy", parents=[common],
                            help="build and serve one or more model.yaml files (or built artifacts) over HTTP")
    deploy.add_argument("configs", nargs="+", metavar="model.yaml|DIR",
                        help="model.yaml files, or artifact directories written by 'neuron-serve build'")
    deploy.add_argument("--weights", metavar="CHECKPOINT",
                        help="serve this state dict (torch.save(model.state_dict(), path)) instead of the model's own "
                             "weights, without compiling; the one model deployed must be weight-separated "
                             "(inline_weights_to_neff: false), as model.yaml's 'weights'")
    deploy.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS, else start one here)")
    deploy.add_argument("--host", help="HTTP host (default: the first model.yaml's http.host)")
    deploy.add_argument("--port", type=int, help="HTTP port (default: the first model.yaml's http.port)")
    deploy.add_argument("--grpc-port", type=int, metavar="PORT",
                        help="gRPC port of the OIP v2 gRPC service (default: the first model.yaml's grpc.port, 8001)")
    deploy.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    deploy.add_argument("--no-ray-dashboard", action="store_true",
                        help="start the embedded Ray without its dashboard (about 1 GB of memory and its start-up "
                             "time less; neuron-serve status and /metrics do not need it)")
    deploy.add_argument("--ingress", choices=["auto", "haproxy", "proxy"], default="auto",
                        help="HTTP ingress of an embedded Ray: HAProxy straight to the replicas, or Serve's "
                             "Python proxy (default auto: haproxy when its binary is found)")
    deploy.set_defaults(func=_deploy)

    status = sub.add_parser("status", parents=[common], help="show the deployed models and their state")
    status.add_argument("--address", help="Ray cluster (default: the local one)")
    status.add_argument("--buckets", action="store_true",
                        help="what each model's buckets padded: per family and bucket, calls, real and padded work, "
                             "added up over its replicas (neuron-serve buckets proposes better ones)")
    status.set_defaults(func=_status)

    buckets = sub.add_parser("buckets", parents=[common],
                             help="the padding a model's buckets cost on the sizes its replicas recorded, and the "
                                  "bucket lists that would cost least")
    buckets.add_argument("config", help="path to a model.yaml (task: generate, embed, score or classify)")
    buckets.add_argument("--sizes", metavar="FILE",
                         help="sizes to read instead of the compile cache's: {family: {size: requests}}")
    buckets.add_argument("--max-models", type=int, metavar="N",
                         help="buckets a family may have (default: as many as today)")
    buckets.add_argument("--min-calls", type=int, metavar="N", default=None,
                         help="calls of a family recorded before its buckets are proposed (default: 100; fewer "
                              "tell too little of the traffic)")
    buckets.add_argument("--json", action="store_true", help="print the proposal as JSON")
    buckets.set_defaults(func=_buckets)

    shutdown = sub.add_parser("shutdown", parents=[common], help="stop some models, or everything")
    shutdown.add_argument("names", nargs="*", help="model names (default: all, and the server)")
    shutdown.add_argument("--address", help="Ray cluster (default: the local one)")
    shutdown.set_defaults(func=_shutdown)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    verbose = args.verbose or logs.verbose_from_env()
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=logs.FORMAT,
        stream=sys.stderr,
    )
    if verbose:
        # Through the environment, so Ray replicas started from here print their operator lists too.
        os.environ[logs.VERBOSE_ENV] = "1"
    # A progress line per compiled model and a placement summary; the operator lists with -v
    # (analyze prints them: they are its output).
    logs.configure(verbose, operator_lists=args.command == "analyze")
    if args.cache_dir:
        # Through the environment, so Ray replicas started from here use it too.
        os.environ[compile_cache.CACHE_ENV] = str(Path(args.cache_dir).expanduser().resolve()) \
            if args.cache_dir.lower() not in compile_cache.DISABLE_VALUES else "off"
    try:
        return args.func(args)
    except NeuronServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
