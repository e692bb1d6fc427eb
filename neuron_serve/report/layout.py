"""A layered layout of the operator graph, one band of rows per subgraph.

Subgraphs run one after another, so each gets its own horizontal band in execution
order and its box never overlaps another's. Inside a band an operator sits one row
below its deepest producer in the same subgraph; a row is ordered by the mean x of
each operator's producers (one barycentre pass), which keeps chains straight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NODE_W = 150
NODE_H = 28
GAP_X = 18
GAP_Y = 18
BOX_PAD = 12
BOX_LABEL = 20  # room above a box for its "#1 neuron" caption
BAND_GAP = 22
MARGIN = 16
MIN_WIDTH = 720  # wide enough for a box caption with its timings


@dataclass
class Box:
    index: int
    x: float
    y: float
    w: float
    h: float


@dataclass
class Layout:
    width: float
    height: float
    positions: dict[str, tuple[float, float]] = field(default_factory=dict)  # node id -> top-left
    boxes: list[Box] = field(default_factory=list)


def _rows(nodes: list[str], preds: dict[str, list[str]]) -> list[list[str]]:
    """Longest-path layering of ``nodes`` (in topological order) over edges inside them."""
    inside = set(nodes)
    depth: dict[str, int] = {}
    for node in nodes:
        depth[node] = 1 + max((depth[p] for p in preds.get(node, []) if p in inside), default=-1)
    rows: list[list[str]] = [[] for _ in range(1 + max(depth.values(), default=-1))]
    for node in nodes:
        rows[depth[node]].append(node)
    return rows


def _order(row: list[str], preds: dict[str, list[str]], xs: dict[str, float]) -> list[str]:
    rank = {node: i for i, node in enumerate(row)}

    def key(node: str) -> tuple[float, int]:
        placed = [xs[p] for p in preds.get(node, []) if p in xs]
        return (sum(placed) / len(placed) if placed else float(rank[node]) * NODE_W, rank[node])

    return sorted(row, key=key)


def layout(bands: list[tuple[int | None, list[str]]], preds: dict[str, list[str]]) -> Layout:
    """Place ``bands`` top to bottom: (subgraph index or None for inputs/outputs, node ids).

    Node ids within a band must be in topological order; ``preds`` maps a node id to
    the ids it reads from.
    """
    band_rows = [(index, _rows(nodes, preds)) for index, nodes in bands]
    widest = max((len(row) for _, rows in band_rows for row in rows), default=1)
    inner = widest * NODE_W + (widest - 1) * GAP_X
    width = max(MIN_WIDTH, inner + 2 * (MARGIN + BOX_PAD))
    result = Layout(width=width, height=0)
    y = MARGIN
    xs: dict[str, float] = {}
    for index, rows in band_rows:
        top = y
        if index is not None:
            y += BOX_LABEL + BOX_PAD
        for row in rows:
            row = _order(row, preds, xs)
            span = len(row) * NODE_W + (len(row) - 1) * GAP_X
            x = (width - span) / 2
            for node in row:
                result.positions[node] = (x, y)
                xs[node] = x
                x += NODE_W + GAP_X
            y += NODE_H + GAP_Y
        if index is not None:
            y += BOX_PAD - GAP_Y
            result.boxes.append(Box(index, MARGIN, top, width - 2 * MARGIN, y - top))
        y += BAND_GAP
    result.height = y - BAND_GAP + MARGIN
    return result
