"""Configs that would cut the number of subgraphs, and what each costs.

Every candidate is checked by running the partition planner itself on the captured
graph (no compile), so the counts are the ones trace would produce. ops_to_partition
works per operator type, so the candidates are: dropping an entry of ops_to_partition,
adding one operator type, and (as torch-tensorrt's block size does) sending every
operator type of the accelerator subgraphs up to a given size to CPU. The cost is
the number of supported operators that would leave the accelerator; a negative cost
is a gain. min_subgraph_size only accepts or refuses a plan, so each candidate also
says the largest min_subgraph_size it satisfies.
"""

from __future__ import annotations

from ..partition.config import PartitionerConfig
from ..partition.plan import PartitionPlan
from ..analysis.capture import CapturedGraph
from .explain import plan_on_copy, quiet_planner
from ..analysis.placement import GraphAnalysis

MAX_SUGGESTIONS = 8


def _summary(plan: PartitionPlan, analysis: GraphAnalysis) -> dict:
    accel = [p for p in plan.partitions if p.device != "cpu"]
    on_accel = sum(p.size for p in accel)
    return {
        "subgraphs": len(plan.partitions),
        "accelerator_subgraphs": len(accel),
        "accelerator_ops": on_accel,
        "accelerator_percentage": f"{100 * on_accel / analysis.total:.2f}%" if analysis.total else "100.00%",
        # The largest min_subgraph_size this plan passes: its smallest subgraph.
        "min_subgraph_size_max": min((p.size for p in plan.partitions), default=0),
    }


def _candidates(plan: PartitionPlan, analysis: GraphAnalysis, current: frozenset[str]) -> list[tuple[str, frozenset]]:
    placed = {}  # op type -> sizes of the accelerator subgraphs it appears in
    for node in plan.gm.graph.nodes:
        if node.op != "call_module":
            continue
        part = next(p for p in plan.partitions if p.name == node.target)
        if part.device == "cpu":
            continue
        for op in part.op_counts:
            placed.setdefault(op, []).append(part.size)
    found = [(f"remove {op} from ops_to_partition", current - {op}) for op in sorted(current)]
    found += [(f"add {op} to ops_to_partition", current | {op}) for op in sorted(placed)]
    sizes = sorted({p.size for p in plan.partitions if p.device != "cpu"})
    for size in sizes[:-1]:  # the largest size would empty the accelerator
        ops = {op for op, seen in placed.items() if min(seen) <= size}
        found.append((f"send the operator types of accelerator subgraphs of {size} or fewer operators to CPU",
                      current | ops))
    return found


def suggest(captured: CapturedGraph, analysis: GraphAnalysis, config: PartitionerConfig) -> dict:
    """The current plan's figures and the candidate configs with fewer subgraphs.

    Each suggestion has its full ``ops_to_partition``, what changed, its subgraph
    counts, and ``cost``: supported operators moved off the accelerator (negative when
    it moves some back). Candidates that leave nothing on the accelerator are dropped.
    """
    with quiet_planner():
        base_plan = plan_on_copy(captured, analysis, config)
        base = _summary(base_plan, analysis)
        seen = {config.ops_to_partition}
        out = []
        for why, ops in _candidates(base_plan, analysis, config.ops_to_partition):
            if ops in seen:
                continue
            seen.add(ops)
            candidate = PartitionerConfig(ops_to_partition=ops)
            figures = _summary(plan_on_copy(captured, analysis, candidate), analysis)
            if figures["subgraphs"] >= base["subgraphs"] or figures["accelerator_ops"] == 0:
                continue
            out.append({
                "change": why,
                "ops_to_partition": sorted(ops),
                **figures,
                "cost": base["accelerator_ops"] - figures["accelerator_ops"],
            })
    out.sort(key=lambda s: (s["cost"], s["subgraphs"], s["change"]))
    return {"current": base, "suggestions": out[:MAX_SUGGESTIONS]}
