"""The analyze report (torch-neuronx's JSON format) and the support log lines."""

from __future__ import annotations

import json
from pathlib import Path

from ..logs import partitioner_info
from ..targets.pjrt import versions
from .placement import GraphAnalysis


def build_report(analysis: GraphAnalysis) -> dict:
    """A JSON-serialisable report in the format of torch-neuronx's ``analyze``."""
    unsupported = []
    for record in analysis.unsupported():
        entry = {
            "kind": record.op,
            "failureAt": record.decision.failure_at,
            "call": record.site.short if record.site else "<unknown>",
            "reason": record.decision.reason,
        }
        unsupported.append(entry)
    return {
        **versions(),
        "target": analysis.target.name,
        "emulated": analysis.target.emulated,
        "support_percentage": analysis.support_percentage,
        "supported_operators": {"aten": dict(analysis.supported_counts())},
        "unsupported_operators": {"aten": unsupported},
    }


def log_support(analysis: GraphAnalysis) -> None:
    """The lines torch-neuronx's partitioner prints before it partitions."""
    partitioner_info("The following operations are currently supported:")
    for op in analysis.supported_counts():
        partitioner_info("%s", op)
    partitioner_info("The following operations are currently not supported:")
    for record in analysis.unsupported():
        where = record.site.log_form if record.site else "<unknown call site>"
        partitioner_info("%s, %s", record.op, where)
    partitioner_info(
        "%s of arithmetic operations (%d of %d) are supported",
        analysis.support_percentage,
        analysis.supported_count,
        analysis.total,
    )


REPORT_FILE = "analyze.json"


def write_report(analysis: GraphAnalysis, workdir: str) -> Path:
    """Write the analyze report to ``workdir``/analyze.json (analyze's ``compiler_workdir``)."""
    folder = Path(workdir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / REPORT_FILE
    path.write_text(json.dumps(build_report(analysis), indent=2) + "\n")
    return path
