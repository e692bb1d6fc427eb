"""The results as Markdown tables and a PNG plot of p99 latency against throughput."""

from __future__ import annotations

from pathlib import Path

from .workloads import WORKLOADS

# (workload, concurrency, peer, wanted ratio of requests/s, p50 slack in ms or None); "fastest-eager"
# is the best eager peer of that point. At concurrency 1 a target also wants neuron-serve's p50
# at most the peer's plus the slack: none against plain Ray Serve + HAProxy (a lone request must
# pay no more serving overhead than Ray Serve's own), 2 ms against the peers that run the
# compiled model inline at batch 1 (they skip batching and the cores' threads altogether).
TARGETS = [
    ("W1", 1, "ray-haproxy", 1.0, 0.0),
    ("W3-mlp", 1, "ray-haproxy", 1.0, 0.0),
    ("W3-enc", 1, "ray-haproxy", 1.0, 0.0),
    ("W1", 16, "fastest-eager", 1.3, None),
    ("W1", 64, "fastest-eager", 1.5, None),
    ("W2", 16, "fastest-eager", 1.5, None),
    ("W1", 1, "ray-neuron", 1.0, 2.0),
    ("W1", 1, "ray-neuron-batch", 1.0, 2.0),
    ("W1", 16, "ray-neuron", 2.0, None),
    ("W1", 16, "ray-neuron-batch", 2.0, None),
]
# Each gRPC point of neuron-serve against its HTTP twin (the same request bodies, over
# wrk) at the same concurrency: at least this ratio of req/s, with a p50 no higher.
GRPC_TWIN_WANTED = 1.0
EFFICIENCY_POINT, EFFICIENCY_WANTED = ("W1", 64), 0.8

# Peers that run neuron_serve's compiled module (Ray Serve's NeuronCore tutorial pattern), not eager PyTorch.
COMPILED_PEERS = {"ray-neuron", "ray-neuron-batch"}


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def serving_table(rows: list[dict], labels: dict[str, str]) -> str:
    """Every (workload, concurrency) point: each server with neuron-serve's ratio to it."""
    out = ["| workload | conc | server | req/s | p50 ms | p99 ms | errors | neuron-serve req/s ratio | p99 ratio (peer/ns) |",
           "|---|---|---|---|---|---|---|---|---|"]
    points = sorted({(r["workload"], r["concurrency"]) for r in rows})
    for workload, conc in points:
        here = [r for r in rows if r["workload"] == workload and r["concurrency"] == conc]
        ours = next((r for r in here if r["server"] == "neuron-serve"), None)
        for r in here:
            if r.get("skipped"):
                out.append(f"| {workload} | {conc} | {labels[r['server']]} | n/a | | | | | {r['skipped']} |")
                continue
            ratio = _ratio(ours["rps"], r["rps"]) if ours and r is not ours and not ours.get("skipped") else ""
            p99 = _ratio(r["p99_ms"], ours["p99_ms"]) if ours and r is not ours and not ours.get("skipped") else ""
            out.append(f"| {workload} | {conc} | {labels[r['server']]} | {r['rps']:.1f} | {r['p50_ms']:.1f} | "
                       f"{r['p99_ms']:.1f} | {r['errors']} | {ratio} | {p99} |")
    return "\n".join(out)


def target_rows(rows: list[dict]) -> list[dict]:
    """Each serving target: the ratio reached and whether it is met (at concurrency 1, with the p50 too)."""
    def find(workload, conc, server):
        return next((r for r in rows if (r["workload"], r["concurrency"], r["server"]) == (workload, conc, server)
                     and not r.get("skipped")), None)

    result = []
    for workload, conc, peer, want, slack in TARGETS:
        ours = find(workload, conc, "neuron-serve")
        if peer == "fastest-eager":
            peers = [r for r in rows if r["workload"] == workload and r["concurrency"] == conc
                     and r["server"] != "neuron-serve" and r["server"] not in COMPILED_PEERS
                     and not r.get("skipped")]
            theirs = max(peers, key=lambda r: r["rps"], default=None)
        else:
            theirs = find(workload, conc, peer)
        if not ours or not theirs:
            continue
        ratio = ours["rps"] / theirs["rps"] if theirs["rps"] else float("inf")
        p50_ok = slack is None or ours["p50_ms"] <= theirs["p50_ms"] + slack
        within = "" if slack is None else " (and p50 no higher)" if not slack else f" (and p50 within {slack:g} ms)"
        result.append({"target": f"{workload} c{conc} vs {theirs['server']}{within}",
                       "want": want, "ratio": ratio, "met": ratio >= want and p50_ok,
                       "p50_ours": ours["p50_ms"], "p50_theirs": theirs["p50_ms"],
                       "p99_ours": ours["p99_ms"], "p99_theirs": theirs["p99_ms"]})
    result += grpc_twin_rows(rows)
    ours = find(*EFFICIENCY_POINT, "neuron-serve")
    if ours and ours.get("cores"):
        cores = ours["cores"]
        result.append({"target": f"{EFFICIENCY_POINT[0]} c{EFFICIENCY_POINT[1]}: rows/s over what the cores compute "
                                 f"back to back at the sizes chosen {cores['chunks_per_size']}",
                       "want": EFFICIENCY_WANTED, "ratio": cores["efficiency"],
                       "met": cores["efficiency"] >= EFFICIENCY_WANTED,
                       "p50_ours": ours["p50_ms"], "p50_theirs": float("nan"),
                       "p99_ours": ours["p99_ms"], "p99_theirs": float("nan")})
    return result


def grpc_twin_rows(rows: list[dict]) -> list[dict]:
    """neuron-serve's gRPC points beside their HTTP twins of the same run: req/s ratio, p50 no higher."""
    result = []
    ours = {(r["workload"], r["concurrency"]): r for r in rows
            if r["server"] == "neuron-serve" and not r.get("skipped")}
    for (workload, conc), grpc_row in sorted(ours.items()):
        spec = WORKLOADS.get(workload)
        http_row = ours.get((spec.bodies, conc)) if spec is not None and spec.grpc else None
        if http_row is None:
            continue
        ratio = grpc_row["rps"] / http_row["rps"] if http_row["rps"] else float("inf")
        result.append({"target": f"{workload} c{conc} vs its HTTP twin {spec.bodies} (and p50 no higher)",
                       "want": GRPC_TWIN_WANTED, "ratio": ratio,
                       "met": ratio >= GRPC_TWIN_WANTED and grpc_row["p50_ms"] <= http_row["p50_ms"],
                       "p50_ours": grpc_row["p50_ms"], "p50_theirs": http_row["p50_ms"],
                       "p99_ours": grpc_row["p99_ms"], "p99_theirs": http_row["p99_ms"]})
    return result


def targets_table(targets: list[dict]) -> str:
    out = ["| target | wanted | reached | p50 ms ours / peer | p99 ms ours / peer | met |", "|---|---|---|---|---|---|"]
    for t in targets:
        out.append(f"| {t['target']} | >= {t['want']:.1f}x | {t['ratio']:.2f}x ({t['ratio'] / t['want']:.0%} of target) | "
                   f"{t['p50_ours']:.1f} / {t['p50_theirs']:.1f} | {t['p99_ours']:.1f} / {t['p99_theirs']:.1f} | "
                   f"{'yes' if t['met'] else 'no'} |")
    return "\n".join(out)


def internal_tables(internal: list[dict]) -> str:
    out = ["### Pipeline efficiency (target >= 0.9)", "",
           "| model | partitions | accel s/chunk | cpu s/chunk | cores | cpu workers | bound chunks/s | measured chunks/s | efficiency |",
           "|---|---|---|---|---|---|---|---|---|"]
    for m in internal:
        p = m["pipeline"]
        out.append(f"| {m['model']} (largest batch {max(m['batch_sizes'])}) | {'+'.join(m['partitions'])} | {p['accel_s'] * 1e3:.2f} ms | "
                   f"{p['cpu_s'] * 1e3:.2f} ms | {p['cores']} | {p['cpu_workers']} | {p['bound_chunks_per_s']:.1f} | "
                   f"{p['measured_chunks_per_s']:.1f} | {p['efficiency']:.2f} |")
    out += ["", "### Dynamic batch scaling (target: within 15% of the chosen sizes' measured costs / cores)", "",
            "| model | batch | compiled sizes run | measured ms | formula ms | measured / formula |",
            "|---|---|---|---|---|---|"]
    for m in internal:
        for r in m["batch_scaling"]:
            out.append(f"| {m['model']} | {r['batch']} | {'+'.join(map(str, r['plan']))} | {r['measured_s'] * 1e3:.1f} | "
                       f"{r['formula_s'] * 1e3:.1f} | {r['ratio']:.2f} |")
    out += ["", "### Compiled subgraph against the same subgraph in eager PyTorch", "",
            "| model | subgraph | compiled ms | eager ms | eager / compiled |", "|---|---|---|---|---|"]
    for m in internal:
        for r in m["compiled_vs_eager"]:
            out.append(f"| {m['model']} | {r['subgraph']} | {r['compiled_s'] * 1e3:.2f} | {r['eager_s'] * 1e3:.2f} | "
                       f"{r['speedup']:.2f}x |")
    return "\n".join(out)


def memory_table(memory: dict[str, dict[str, float]], labels: dict[str, str]) -> str:
    out = ["| server | process | RSS MiB |", "|---|---|---|"]
    for server, processes in memory.items():
        for name, rss in processes.items():
            out.append(f"| {labels[server]} | {name} | {rss:.0f} |")
    return "\n".join(out)


def plot(rows: list[dict], labels: dict[str, str], path: Path) -> None:
    """p99 latency against throughput, one line per server over W1's concurrencies, W2/W3 as points."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for color, server in enumerate(labels):
            points = sorted((r["concurrency"], r["rps"], r["p99_ms"]) for r in rows
                            if r["workload"] == workload and r["server"] == server and not r.get("skipped"))
            if not points:
                continue
            ax.plot([p[1] for p in points], [p[2] for p in points], marker="o", label=labels[server],
                    color=f"C{color}")  # one colour per server in every panel
            for conc, x, y in points:
                ax.annotate(f"c{conc}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.set_title(workload)
        ax.set_xlabel("requests/s")
        ax.set_ylabel("p99 latency (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
