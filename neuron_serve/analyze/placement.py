"""Per-operator support decisions for a captured graph."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch.fx

from ..targets import Decision, Target
from .callsite import CallSite, call_site
from .capture import CapturedGraph, is_compute_node, op_name
from .support import SupportOracle

_ORACLES: dict[str, SupportOracle] = {}


def oracle_for(target: Target) -> SupportOracle:
    """One oracle per target per process, so its cache spans every model analysed."""
    if target.name not in _ORACLES:
        _ORACLES[target.name] = SupportOracle(target)
    return _ORACLES[target.name]


@dataclass(frozen=True)
class OpRecord:
    node: str
    op: str
    decision: Decision
    site: CallSite | None

    @property
    def supported(self) -> bool:
        return self.decision.supported


@dataclass
class GraphAnalysis:
    target: Target
    records: list[OpRecord]

    @property
    def supported_count(self) -> int:
        return sum(r.supported for r in self.records)

    @property
    def total(self) -> int:
        return len(self.records)

    @property
    def support_fraction(self) -> float:
        return self.supported_count / self.total if self.total else 1.0

    @property
    def support_percentage(self) -> str:
        return f"{100 * self.support_fraction:.2f}%"

    def supported_counts(self) -> Counter:
        return Counter(r.op for r in self.records if r.supported)

    def unsupported(self) -> list[OpRecord]:
        return [r for r in self.records if not r.supported]


def analyze_graph(captured: CapturedGraph, target: Target) -> GraphAnalysis:
    """Decide every arithmetic operator of ``captured`` for ``target``."""
    oracle = oracle_for(target)
    gm: torch.fx.GraphModule = captured.gm
    records = []
    for node in gm.graph.nodes:
        if not is_compute_node(node):
            continue
        op = op_name(node)
        records.append(OpRecord(node.name, op, oracle.decide(node, op, gm), call_site(node)))
    return GraphAnalysis(target, records)
