"""Why each operator runs where it runs: the data behind the HTML partition report.

The planner is run as serving would run it, on a copy of the captured graph, and every
arithmetic operator is given its placement category, the subgraph it lands in, the
reason and its call site. PartitionerConfig's rules (support threshold, subgraph count
and size) never move an operator: they accept or refuse the whole plan, so the plan is
built without them and each rule is then checked on it, naming the subgraphs that break
it. The result is plain JSON-ready data; html.py draws it and suggest.py tries other
configs on the same graph.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import operator
from typing import Any, Iterator

import torch
import torch.fx

from ..api import placement
from ..logs import NEURON_LOGGER
from ..partition.config import PartitionerConfig
from ..partition.plan import REASON_FORCED, REASON_UNSUPPORTED, PartitionPlan, plan_partitions, rule_violations
from ..analysis.capture import CapturedGraph, is_compute_node
from ..analysis.placement import GraphAnalysis
from ..analysis.report import build_report

ACCELERATOR = "accelerator"
CPU_UNSUPPORTED = "cpu-unsupported"
CPU_FORCED = "cpu-forced"
# Category -> (fill colour, legend text). The browser test checks the rendered fills
# against this table, so the page and the JSON cannot disagree.
CATEGORIES = {
    ACCELERATOR: ("#8fd19e", "accelerator"),
    CPU_UNSUPPORTED: ("#f28b82", "CPU: unsupported by the target"),
    CPU_FORCED: ("#fbbc58", "CPU: forced by ops_to_partition"),
}
_REASON_CATEGORY = {REASON_UNSUPPORTED: CPU_UNSUPPORTED, REASON_FORCED: CPU_FORCED}

logger = logging.getLogger("neuron_serve")


@contextlib.contextmanager
def quiet_planner() -> Iterator[None]:
    """Silence the planner's INFO lines while candidate plans are tried."""
    loggers = [logger, logging.getLogger(NEURON_LOGGER)]
    previous = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for log, level in zip(loggers, previous):
            log.setLevel(level)


def relaxed(config: PartitionerConfig) -> PartitionerConfig:
    """``config`` without the rules that only accept or refuse a plan."""
    return PartitionerConfig(model_support_percentage_threshold=0.0, ops_to_partition=config.ops_to_partition)


def plan_on_copy(captured: CapturedGraph, analysis: GraphAnalysis, config: PartitionerConfig) -> PartitionPlan:
    """Plan ``config``'s placement on a copy of the graph; no compile, weights shared."""
    gm = torch.fx.GraphModule(captured.gm, copy.deepcopy(captured.gm.graph))
    return plan_partitions(gm, placement(analysis), relaxed(config))


def _members(plan: PartitionPlan) -> dict[str, int]:
    """Original node name -> 1-based subgraph index (getitems follow their producer)."""
    index = {p.name: p.index for p in plan.partitions}
    members = {}
    for node in plan.gm.graph.nodes:
        if node.op != "call_module":
            continue
        for inner in plan.gm.get_submodule(node.target).graph.nodes:
            if inner.op == "call_function":
                members[inner.name] = index[node.target]
    return members


def _value_source(node: torch.fx.Node) -> str | None:
    """The drawn node a value comes from: getitems collapse onto their producer."""
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    if node.op == "placeholder":
        return f"input:{node.name}"
    if is_compute_node(node):
        return node.name
    return None  # weights and constants are not drawn


def _tensor_info(node: torch.fx.Node) -> dict | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return {"shape": list(val.shape), "dtype": str(val.dtype).replace("torch.", ""),
            "bytes": val.numel() * val.element_size()}


def _site(record) -> dict | None:
    site = record.site
    if site is None:
        return None
    return {"file": site.file, "line": site.line, "code": site.code, "short": site.short}


def _ops(analysis: GraphAnalysis, plan: PartitionPlan, members: dict[str, int], gm: torch.fx.GraphModule) -> list:
    nodes = {n.name: n for n in gm.graph.nodes}
    ops = []
    for record in analysis.records:
        reason = plan.cpu_reasons.get(record.node)
        category = _REASON_CATEGORY.get(reason, ACCELERATOR)
        if category == CPU_UNSUPPORTED:
            detail = record.decision.reason
        elif category == CPU_FORCED:
            detail = f"{record.op} is listed in ops_to_partition (the target supports it)"
        else:
            detail = None
        sources = [_value_source(n) for n in nodes[record.node].all_input_nodes]
        ops.append({
            "node": record.node,
            "op": record.op,
            "category": category,
            "device": "cpu" if reason else analysis.target.name,
            "supported": record.supported,
            "failure_at": record.decision.failure_at,
            "reason": detail,
            "call_site": _site(record),
            "subgraph": members.get(record.node),
            "inputs": list(dict.fromkeys(s for s in sources if s is not None)),
            "tensor": _tensor_info(nodes[record.node]),
        })
    return ops


def _io(gm: torch.fx.GraphModule) -> tuple[list[dict], list[dict]]:
    inputs = [{"id": f"input:{n.name}", "name": n.name, "tensor": _tensor_info(n)}
              for n in gm.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = torch.fx.node.map_aggregate(out_node.args[0], lambda x: x)
    flat = leaves if isinstance(leaves, (list, tuple)) else [leaves]
    outputs = []
    for i, leaf in enumerate(flat):
        source = _value_source(leaf) if isinstance(leaf, torch.fx.Node) else None
        outputs.append({"id": f"output:{i}", "name": f"output_{i}", "inputs": [source] if source else []})
    return inputs, outputs


def _boundaries(plan: PartitionPlan, members: dict[str, int], gm: torch.fx.GraphModule) -> dict[int, dict]:
    """Per subgraph, the tensors that cross into and out of it (what a transfer moves)."""
    crossing: dict[int, dict] = {p.index: {"in": {}, "out": {}} for p in plan.partitions}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        home = members.get(node.name)
        for user in node.users:
            there = members.get(user.name)  # None for the graph's output
            if there is None or there == home:
                if there is None and home is not None and user.op == "output":
                    crossing[home]["out"][node.name] = _tensor_info(node)
                continue
            crossing[there]["in"][node.name] = _tensor_info(node)
            if home is not None:
                crossing[home]["out"][node.name] = _tensor_info(node)
    return crossing


def _subgraphs(plan: PartitionPlan, members: dict[str, int], gm: torch.fx.GraphModule, violations: list) -> list:
    crossing = _boundaries(plan, members, gm)
    compute = {n.name for n in gm.graph.nodes if is_compute_node(n)}
    out = []
    for p in plan.partitions:
        broken = [v["rule"] for v in violations if p.index in v["subgraphs"]]
        values_in = [v for v in crossing[p.index]["in"].values() if v]
        values_out = [v for v in crossing[p.index]["out"].values() if v]
        out.append({
            **p.describe(),
            "name": p.name,
            "device_label": p.device_label,
            "nodes": [name for name, index in members.items() if index == p.index and name in compute],
            "inputs": list(crossing[p.index]["in"]),
            "outputs": list(crossing[p.index]["out"]),
            "bytes_in": sum(v["bytes"] for v in values_in),
            "bytes_out": sum(v["bytes"] for v in values_out),
            "breaks": broken,
        })
    return out


def _op_counts(ops: list[dict]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for op in ops:
        row = counts.setdefault(op["op"], {"total": 0, ACCELERATOR: 0, "cpu": 0})
        row["total"] += 1
        row[ACCELERATOR if op["category"] == ACCELERATOR else "cpu"] += 1
    return counts


def config_dict(config: PartitionerConfig) -> dict:
    """The PartitionerConfig fields a model.yaml can set, as JSON."""
    return {
        "model_support_percentage_threshold": config.model_support_percentage_threshold,
        "min_subgraph_size": config.min_subgraph_size,
        "max_subgraph_count": config.max_subgraph_count,
        "ops_to_partition": sorted(config.ops_to_partition),
    }


def explain(captured: CapturedGraph, analysis: GraphAnalysis, config: PartitionerConfig | None,
            *, name: str = "model", buckets: dict | None = None) -> dict[str, Any]:
    """Everything the partition report shows, as JSON-ready data.

    ``config`` None means the model.yaml has no ``partitioner`` section: the plan shown
    is the default one, and ``status.refused`` says trace would refuse the model if any
    operator is unsupported.
    """
    effective = config or PartitionerConfig()
    plan = plan_on_copy(captured, analysis, effective)
    violations = [dataclasses.asdict(v) for v in rule_violations(placement(analysis), plan.partitions, effective)]
    if config is None and analysis.unsupported():
        violations.insert(0, {
            "rule": "partitioner", "subgraphs": [],
            "message": "The model has unsupported operators and the model.yaml has no 'partitioner' section, so "
                       "trace refuses it; add 'partitioner: {}' to run them on CPU as shown here.",
        })
    gm = captured.gm
    members = _members(plan)
    ops = _ops(analysis, plan, members, gm)
    inputs, outputs = _io(gm)
    return {
        "model": name,
        "report": build_report(analysis),
        "supported_count": analysis.supported_count,
        "operator_count": analysis.total,
        "config": config_dict(effective),
        "partitioner_section": config is not None,
        "categories": {key: {"fill": fill, "label": label} for key, (fill, label) in CATEGORIES.items()},
        "ops": ops,
        "inputs": inputs,
        "outputs": outputs,
        "subgraphs": _subgraphs(plan, members, gm, violations),
        "op_counts": _op_counts(ops),
        "violations": violations,
        "accepted": not violations,
        "buckets": buckets,
        "suggestions": None,
        "profile": None,
    }
