"""lm-evaluation-harness's Python API in a process of its own; used by test_lm_eval.py.

    python lm_eval_run.py RUNS.json OUT.json

RUNS.json is ``{"include_path": DIR, "runs": [RUN, ...]}``, each RUN the arguments of one
``lm_eval.simple_evaluate`` call: ``{"model", "model_args", "tasks", "apply_chat_template"}``.
The tasks are looked up in DIR only (no built-in task is indexed). OUT.json is a list with one
``{"results", "samples"}`` a run, as simple_evaluate returns them with ``log_samples=True``
(tuples as lists, NumPy scalars as numbers).

A process of its own because lm-eval seeds Python's, NumPy's and torch's global generators,
datasets reads HF_DATASETS_OFFLINE when first imported, and the warnings of its dependencies
would fail pytest's warnings-as-errors: none of that reaches the test's process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable


def main(runs_path: Path, out_path: Path) -> None:
    """Run every simple_evaluate call of ``runs_path`` in turn and write their results to ``out_path``."""
    spec = json.loads(runs_path.read_text())
    tasks = TaskManager(include_path=spec["include_path"], include_defaults=False)
    answers = []
    for run in spec["runs"]:
        result = lm_eval.simple_evaluate(model=run["model"], model_args=run["model_args"], tasks=run["tasks"],
                                         task_manager=tasks, log_samples=True,
                                         apply_chat_template=run.get("apply_chat_template", False))
        answers.append({"results": result["results"], "samples": result["samples"]})
    out_path.write_text(json.dumps(answers, default=handle_non_serializable))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
