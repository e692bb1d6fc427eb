"""The analyze report (torch-neuronx's JSON format) and the support log lines."""

from __future__ import annotations

import logging

from ..targets.pjrt import versions
from .placement import GraphAnalysis

logger = logging.getLogger("neuron_serve")


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
    logger.info("The following operations are currently supported:")
    for op in analysis.supported_counts():
        logger.info("%s", op)
    logger.info("The following operations are currently not supported:")
    for record in analysis.unsupported():
        where = record.site.log_form if record.site else "<unknown call site>"
        logger.info("%s, %s", record.op, where)
    logger.info(
        "%s of arithmetic operations (%d of %d) are supported",
        analysis.support_percentage,
        analysis.supported_count,
        analysis.total,
    )
