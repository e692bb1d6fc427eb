"""Per-operator support decisions for a captured graph."""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch.fx

from ..targets import Decision, Target
from .callsite import CallSite, call_site
from .capture import CapturedGraph, is_compute_node, op_name
from .support import SupportOracle

logger = logging.getLogger("neuron_serve")

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
    """Every arithmetic operator's decision; ``ignored`` operators are decided and placed
    but left out of every count (analyze's ``additional_ignored_ops``)."""

    target: Target
    records: list[OpRecord]
    ignored: frozenset[str] = field(default_factory=frozenset)

    @property
    def counted(self) -> list[OpRecord]:
        return [r for r in self.records if r.op not in self.ignored]

    @property
    def supported_count(self) -> int:
        return sum(r.supported for r in self.counted)

    @property
    def total(self) -> int:
        return len(self.counted)

    @property
    def support_fraction(self) -> float:
        return self.supported_count / self.total if self.total else 1.0

    @property
    def support_percentage(self) -> str:
        return f"{100 * self.support_fraction:.2f}%"

    def supported_counts(self) -> Counter:
        return Counter(r.op for r in self.counted if r.supported)

    def unsupported(self) -> list[OpRecord]:
        return [r for r in self.counted if not r.supported]


def analyze_graph(
    captured: CapturedGraph,
    target: Target,
    *,
    ignored_ops: frozenset[str] = frozenset(),
    max_workers: int = 1,
    compiler_flags: tuple[str, ...] = (),
) -> GraphAnalysis:
    """Decide every arithmetic operator of ``captured`` for ``target``.

    ``ignored_ops`` ("aten::to", ...) are left out of the counts; ``max_workers`` > 1
    runs the support checks on that many threads; ``compiler_flags``
    (``CompilerArgs.cache_key()``) key the support cache.
    """
    oracle = oracle_for(target)
    gm: torch.fx.GraphModule = captured.gm
    nodes = [node for node in gm.graph.nodes if is_compute_node(node)]

    def record(node: torch.fx.Node) -> OpRecord:
        op = op_name(node)
        return OpRecord(node.name, op, oracle.decide(node, op, gm, compiler_flags), call_site(node))

    if max_workers > 1 and len(nodes) > 1:
        logger.debug("checking %d operators' support on %d threads", len(nodes), max_workers)
        with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="neuron-serve-analyze") as pool:
            records = list(pool.map(record, nodes))  # map keeps the graph's order
    else:
        records = [record(node) for node in nodes]
    return GraphAnalysis(target, records, frozenset(ignored_ops))
