"""The neuron-serve command line."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
from pathlib import Path

from .analyze.capture import capture
from .analyze.placement import analyze_graph
from .analyze.report import build_report, log_support
from .config import build_model, load_config
from .errors import NeuronServeError
from .partition.config import PartitionerConfig
from .partition.plan import plan_partitions
from .targets import get_target


def _analyze(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    model = build_model(config, Path(args.config).resolve().parent)
    captured = capture(model, config.example_inputs())
    analysis = analyze_graph(captured, get_target(config.target))
    report = build_report(analysis)
    log_support(analysis)
    partitioner = config.partitioner_config() or PartitionerConfig(model_support_percentage_threshold=0.0)
    if config.partitioner is None and analysis.unsupported():
        report["partitions"] = None
        logging.getLogger("neuron_serve").warning(
            "Unsupported operators and no 'partitioner' section: trace would refuse this model."
        )
    else:
        plan = plan_partitions(copy.deepcopy(captured.gm), analysis, partitioner)
        report["partitions"] = plan.describe()
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    else:
        print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuron-serve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    analyze = sub.add_parser("analyze", help="report operator support and the partition plan of a model.yaml")
    analyze.add_argument("config", help="path to a model.yaml")
    analyze.add_argument("--json", metavar="PATH", help="write the report (with the plan) to PATH")
    analyze.set_defaults(func=_analyze)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except NeuronServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
