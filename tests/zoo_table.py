"""Render the model zoo matrix's results (build/zoo-results.json) into docs/reference/zoo.md.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/unit/test_zoo.py   # writes build/zoo-results.json
    .venv/bin/python tests/zoo_table.py                                # rewrites the table in the docs

The table goes between the ``<!-- zoo-table:begin -->`` and ``<!-- zoo-table:end -->``
markers; everything else in the page is left as it is.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4  # tests/unit/test_zoo.py's: allowed = TOLERANCE * max(1, largest |eager output|)
BEGIN, END = "<!-- zoo-table:begin -->", "<!-- zoo-table:end -->"


def _partitions(devices: list[str]) -> str:
    accel = sum(d != "cpu" for d in devices)
    return f"{len(devices)} ({accel} neuron, {len(devices) - accel} cpu)"


def _why(error: str) -> str:
    # The first sentence or two: the construct and its line; the table keeps it short.
    text = error.replace("|", "\\|").replace("\n", " ")
    return re.sub(r" \(/[^)]*\)", "", text.split(" The condition")[0])


def render(rows: list[dict]) -> str:
    lines = [
        "| model | kind | operators supported | partitions | largest difference from eager (allowed) "
        "| compile s | why not |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['kind']} | – | – | – | – | {_why(r['error'])} |")
            continue
        supported = f"{r['supported_count']} of {r['operator_count']} ({r['support_percentage']})"
        if r.get("unsupported"):
            supported += f" (CPU: {', '.join(r['unsupported'])})"
        diff = max(r["max_abs_diff"], r.get("reload_max_abs_diff", 0.0))
        lines.append(f"| {r['model']} | {r['kind']} | {supported} | {_partitions(r['partitions'])} | "
                     f"{diff:.1e} ({TOLERANCE * r['output_scale']:.0e}) | {r['compile_seconds']} | |")
    return "\n".join(lines)


def main(results: str = str(ROOT / "build" / "zoo-results.json"),
         readme: str = str(ROOT / "docs" / "reference" / "zoo.md")) -> None:
    rows = json.loads(Path(results).read_text())
    text = Path(readme).read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"{readme} has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    Path(readme).write_text(f"{head}{BEGIN}\n{render(rows)}\n{END}{tail}")


if __name__ == "__main__":
    main(*sys.argv[1:])
