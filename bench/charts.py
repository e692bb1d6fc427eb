"""PNG charts of a benchmark run, from the figures its raw.json and generate.json hold.

    python -m bench.charts                      # the latest bench/results/<timestamp>/ with a raw.json
    python -m bench.charts RESULTS_DIR --out docs/assets/bench   # the charts the documentation shows

Serving (raw.json's ``rows``): ``throughput.png``, requests/s against concurrency, and
``latency.png``, p50 and p99 latency against concurrency; one panel per workload, one line
per server, in the same colour in every panel. Generation (generate.json, also raw.json's
``generation``): ``generation.png``, output tokens/s and time per output token (p50, p99)
of each system. ``python -m bench`` writes them next to results.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GENERATION_LABELS = {"engine": "neuron-serve engine", "transformers_cb": "transformers continuous batching",
                     "sequential": "transformers generate, sequential"}


def _pyplot():
    import matplotlib  # noqa: PLC0415 - the bench extra; nothing else in bench needs it at import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r.get("skipped") and "rps" in r]


def _panels(plt, workloads: list[str], ylabel: str):
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.2 * len(workloads) + 2.4, 3.6), squeeze=False,
                             layout="constrained")
    for ax, workload in zip(axes[0], workloads):
        ax.set_title(workload)
        ax.set_xlabel("concurrency (open connections)")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    return fig, axes[0]


def _axes_ticks(ax, rows: list[dict], workload: str, log_y: bool) -> None:
    """Concurrencies as plain numbers on x; on a log y axis, plain numbers too."""
    from matplotlib.ticker import LogFormatter, NullLocator  # noqa: PLC0415

    concurrencies = sorted({r["concurrency"] for r in rows if r["workload"] == workload})
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    if len(concurrencies) == 1:
        ax.set_xlim(concurrencies[0] / 2, concurrencies[0] * 2)
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(LogFormatter())
        ax.yaxis.set_minor_formatter(LogFormatter(minor_thresholds=(2, 0.4)))


def _series(rows: list[dict], workload: str, server: str, key: str) -> tuple[list[int], list[float]]:
    points = sorted((r["concurrency"], r[key]) for r in rows if r["workload"] == workload and r["server"] == server)
    return [p[0] for p in points], [p[1] for p in points]


def serving_charts(rows: list[dict], out: Path, labels: dict[str, str] | None = None) -> list[Path]:
    """throughput.png and latency.png in ``out``; nothing when no point was measured."""
    rows = _measured(rows)
    if not rows:
        return []
    plt = _pyplot()
    servers = list(dict.fromkeys(r["server"] for r in rows))  # first-seen order: the run's
    labels = {s: (labels or {}).get(s, s) for s in servers}
    workloads = sorted({r["workload"] for r in rows})
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, axes = _panels(plt, workloads, "requests/s")
    for ax, workload in zip(axes, workloads):
        _axes_ticks(ax, rows, workload, log_y=False)
        for color, server in enumerate(servers):
            x, y = _series(rows, workload, server, "rps")
            if x:
                ax.plot(x, y, marker="o", color=f"C{color}", label=labels[server])
        ax.set_ylim(bottom=0)
    fig.legend(*_handles(axes), loc="outside right center", fontsize=7)
    fig.suptitle("Throughput against concurrency")
    written.append(_save(plt, fig, out / "throughput.png"))

    fig, axes = _panels(plt, workloads, "latency (ms)")
    for ax, workload in zip(axes, workloads):
        _axes_ticks(ax, rows, workload, log_y=True)
        for color, server in enumerate(servers):
            x, p99 = _series(rows, workload, server, "p99_ms")
            if x:
                _, p50 = _series(rows, workload, server, "p50_ms")
                ax.plot(x, p99, marker="o", color=f"C{color}", label=f"{labels[server]} p99")
                ax.plot(x, p50, marker=".", linestyle="--", color=f"C{color}", label=f"{labels[server]} p50")
    fig.legend(*_handles(axes), loc="outside right center", fontsize=7)
    fig.suptitle("Latency against concurrency (p99 solid, p50 dashed)")
    written.append(_save(plt, fig, out / "latency.png"))
    return written


def _handles(axes) -> tuple[list, list]:
    """Each label once, over every panel (a server missing from one panel is in another)."""
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    return list(seen.values()), list(seen)


def _save(plt, fig, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def generation_chart(figures: dict, out: Path) -> Path | None:
    """generation.png: output tokens/s, and TPOT p50 and p99, of each system in generate.json."""
    systems = {k: v for k, v in (figures or {}).get("systems", {}).items() if "tokens_per_s" in v}
    if not systems:
        return None
    plt = _pyplot()
    names = [GENERATION_LABELS.get(k, k) for k in systems]
    positions = range(len(systems))
    fig, (tps, tpot) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    tps.barh(positions, [s["tokens_per_s"] for s in systems.values()], color=[f"C{i}" for i in positions])
    tps.set_yticks(list(positions), names, fontsize=8)
    tps.invert_yaxis()
    tps.set_xlabel("output tokens/s (higher is better)")
    width = 0.4
    tpot.barh([p - width / 2 for p in positions], [s["tpot_p50_s"] * 1e3 for s in systems.values()], width,
              label="p50", color="C0")
    tpot.barh([p + width / 2 for p in positions], [s["tpot_p99_s"] * 1e3 for s in systems.values()], width,
              label="p99", color="C3")
    tpot.set_yticks(list(positions), [""] * len(systems))
    tpot.invert_yaxis()
    tpot.set_xlabel("time per output token, ms (lower is better)")
    tpot.legend(fontsize=8)
    for ax in (tps, tpot):
        ax.grid(True, axis="x", alpha=0.3)
    workload = figures.get("workload") or {}
    fig.suptitle("Generation" + (f": {workload['requests']} requests at once" if "requests" in workload else ""))
    out.mkdir(parents=True, exist_ok=True)
    return _save(plt, fig, out / "generation.png")


def latest_results(root: Path = RESULTS) -> Path | None:
    """The newest results directory holding a raw.json or a generate.json."""
    runs = sorted(p for p in root.glob("*") if (p / "raw.json").is_file() or (p / "generate.json").is_file())
    return runs[-1] if runs else None


def charts_of(results: Path, out: Path, labels: dict[str, str] | None = None) -> list[Path]:
    """Every chart the run in ``results`` has figures for."""
    written, generation = [], None
    if (results / "raw.json").is_file():
        raw = json.loads((results / "raw.json").read_text())
        written += serving_charts(raw.get("rows") or [], out, labels)
        generation = raw.get("generation")
    if generation is None and (results / "generate.json").is_file():
        generation = json.loads((results / "generate.json").read_text())
    chart = generation_chart(generation, out) if generation else None
    return written + ([chart] if chart else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.charts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, help="a bench/results/<timestamp> directory (default: latest)")
    parser.add_argument("--out", type=Path, help="where the PNGs go (default: the results directory)")
    args = parser.parse_args(argv)
    results = args.results or latest_results()
    if results is None:
        print(f"no results in {RESULTS}: run make bench (or python -m bench --quick) first", file=sys.stderr)
        return 1
    written = charts_of(results, args.out or results)
    for path in written:
        print(path)
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
