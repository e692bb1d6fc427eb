"""One self-contained HTML page for the partition report: inline CSS, SVG and script.

The page loads nothing from the network, so it can be mailed, attached to a CI run or
opened from disk. Every operator node carries data-op, data-node, data-placement and
data-subgraph attributes; the report's JSON is embedded as well (#report-data).
"""

from __future__ import annotations

import json
from html import escape

from .layout import BOX_PAD, NODE_H, NODE_W, Layout, layout
from .stages import section as pipeline_section

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#1f2328;background:#fafafa}
header{padding:16px 24px;background:#24292f;color:#fff}header h1{margin:0 0 4px;font-size:20px}
header .sub{opacity:.8}main{padding:16px 24px}section{margin:0 0 24px}
h2{font-size:16px;margin:0 0 8px}.cards{display:flex;flex-wrap:wrap;gap:12px;margin:0 0 16px}
.card{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:8px 14px;min-width:120px}
.card b{display:block;font-size:20px}.bad{color:#b3261e}.good{color:#1a7f37}
.legend span{display:inline-block;margin-right:16px}.legend i{display:inline-block;width:14px;height:14px;
border:1px solid #555;border-radius:3px;vertical-align:-2px;margin-right:4px}
.graph{overflow:auto;max-height:80vh;background:#fff;border:1px solid #d0d7de;border-radius:6px}
table{border-collapse:collapse;background:#fff;font-size:13px}td,th{border:1px solid #d0d7de;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f0f3f6}td.n{text-align:right;font-variant-numeric:tabular-nums}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;background:#f0f3f6;padding:1px 4px;border-radius:3px}
.violation{background:#fdecea;border:1px solid #f5c2c0;border-radius:6px;padding:8px 12px;margin:0 0 8px}
svg text{font:11px ui-monospace,SFMono-Regular,Menlo,monospace;pointer-events:none}
.op rect{stroke:#333;stroke-width:1;cursor:pointer}.op.selected rect{stroke-width:3;stroke:#0969da}
.io rect{fill:#e8eaed;stroke:#888;stroke-dasharray:3 2}
.box{fill:none;stroke-width:1.5;rx:8}.box.dev-cpu{stroke:#8a6d3b;fill:#fff8ee}.box.dev-accel{stroke:#2f6f3e;fill:#f1faf3}
.box.breaks{stroke:#b3261e;stroke-width:3;stroke-dasharray:6 3}
.boxlabel{font-weight:bold;font-size:12px;paint-order:stroke;stroke:#fff;stroke-width:4px;stroke-linejoin:round}.edge{fill:none;stroke:#777;stroke-width:1.2}
.edge.transfer{stroke:#0969da;stroke-width:1.8;stroke-dasharray:5 3}
#detail{position:sticky;top:0;background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:8px 12px;
margin:0 0 8px;min-height:1.5em}tr.selected td{background:#ddf4ff}
"""

_JS = """
const data = JSON.parse(document.getElementById('report-data').textContent);
const byNode = Object.fromEntries(data.ops.map(o => [o.node, o]));
const detail = document.getElementById('detail');
function select(name) {
  document.querySelectorAll('.selected').forEach(e => e.classList.remove('selected'));
  document.querySelectorAll(`[data-node="${name}"]`).forEach(e => e.classList.add('selected'));
  const o = byNode[name];
  if (!o) return;
  const site = o.call_site ? `${o.call_site.short}: ${o.call_site.code}` : 'unknown call site';
  detail.textContent = `${o.node} (${o.op}) in subgraph #${o.subgraph} on ${o.device}` +
    (o.reason ? ` because ${o.reason}` : '') + ` | ${site}`;
}
document.querySelectorAll('[data-node]').forEach(e => e.addEventListener('click', () => select(e.dataset.node)));
"""


def _fit(label: str, room: int = 21) -> str:
    """Cut a label to what a node box holds at the page's monospace size."""
    return label if len(label) <= room else label[: room - 1] + "…"


def _svg_nodes(data: dict, lay: Layout) -> list[str]:
    out = []
    for op in data["ops"]:
        x, y = lay.positions[op["node"]]
        short = op["op"].split("::")[-1]
        label = short if short == op["node"] else f"{short} ({op['node']})"
        site = op["call_site"]["short"] if op["call_site"] else "unknown call site"
        tip = f"{op['node']}: {op['op']} on {op['device']}" + (f" because {op['reason']}" if op["reason"] else "")
        out.append(
            f'<g class="op cat-{op["category"]}" data-op="{escape(op["op"])}" data-node="{escape(op["node"])}" '
            f'data-placement="{op["category"]}" data-subgraph="{op["subgraph"]}">'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{NODE_W}" height="{NODE_H}" rx="5"/>'
            f'<text x="{x + NODE_W / 2:.1f}" y="{y + NODE_H / 2 + 4:.1f}" text-anchor="middle">{escape(_fit(label))}</text>'
            f"<title>{escape(tip)} ({escape(site)})</title></g>"
        )
    for io in data["inputs"] + data["outputs"]:
        x, y = lay.positions[io["id"]]
        kind = io["id"].split(":")[0]
        out.append(
            f'<g class="io" data-io="{kind}"><rect x="{x:.1f}" y="{y:.1f}" width="{NODE_W}" height="{NODE_H}" rx="14"/>'
            f'<text x="{x + NODE_W / 2:.1f}" y="{y + NODE_H / 2 + 4:.1f}" text-anchor="middle">{kind} {escape(io["name"])}'
            f"</text></g>"
        )
    return out


def _svg_edges(data: dict, lay: Layout, preds: dict[str, list[str]]) -> list[str]:
    # Inputs and outputs live on CPU; an edge whose ends are on different devices is a transfer.
    device = {op["node"]: op["device"] for op in data["ops"]}
    out = []
    for dst, sources in preds.items():
        for src in sources:
            if src not in lay.positions:
                continue
            (x1, y1), (x2, y2) = lay.positions[src], lay.positions[dst]
            x1, x2, y1 = x1 + NODE_W / 2, x2 + NODE_W / 2, y1 + NODE_H
            bend = max(12.0, (y2 - y1) / 2)
            kind = "edge transfer" if device.get(src, "cpu") != device.get(dst, "cpu") else "edge"
            out.append(f'<path class="{kind}" d="M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 + bend:.1f} {x2:.1f},{y2 - bend:.1f} '
                       f'{x2:.1f},{y2:.1f}" marker-end="url(#arrow)"/>')
    return out


def _box_caption(sub: dict, timing: dict | None) -> str:
    text = f"#{sub['index']} {sub['device_label']} · {sub['size']} op{'s' if sub['size'] != 1 else ''}"
    if timing:
        text += f" · {timing['compute_ms']:.3f} ms"
        if "to_device_ms" in timing:
            text += f" (in {timing['to_device_ms']:.3f} ms, out {timing['to_cpu_ms']:.3f} ms)"
    if sub["breaks"]:
        text += " · breaks " + ", ".join(sub["breaks"])
    return text


def graph_svg(data: dict) -> str:
    """The operator graph as inline SVG: subgraph boxes, operators, inputs, outputs."""
    preds = {op["node"]: op["inputs"] for op in data["ops"]}
    preds.update({o["id"]: o["inputs"] for o in data["outputs"]})
    bands = [(None, [i["id"] for i in data["inputs"]])]
    bands += [(s["index"], s["nodes"]) for s in data["subgraphs"]]
    bands.append((None, [o["id"] for o in data["outputs"]]))
    lay = layout(bands, preds)
    timings = {t["index"]: t for t in (data.get("profile") or {}).get("subgraphs", [])}
    devices = {s["index"]: s for s in data["subgraphs"]}
    parts, captions = [], []
    for box in lay.boxes:
        sub = devices[box.index]
        kind = "dev-cpu" if sub["device"] == "cpu" else "dev-accel"
        breaks = " breaks" if sub["breaks"] else ""
        parts.append(
            f'<g class="subgraph" data-subgraph="{box.index}" data-device="{sub["device"]}">'
            f'<rect class="box {kind}{breaks}" x="{box.x}" y="{box.y:.1f}" width="{box.w}" height="{box.h:.1f}"/></g>'
        )
        # Captions go on top of the edges, with a halo, so an arrow never hides them.
        captions.append(f'<text class="boxlabel" x="{box.x + BOX_PAD}" y="{box.y + 16:.1f}">'
                        f"{escape(_box_caption(sub, timings.get(box.index)))}</text>")
    parts += _svg_edges(data, lay, preds)
    parts += _svg_nodes(data, lay)
    parts += captions
    marker = ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
              'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#777"/></marker></defs>')
    return (f'<svg id="graph" xmlns="http://www.w3.org/2000/svg" width="{lay.width:.0f}" height="{lay.height:.0f}" '
            f'viewBox="0 0 {lay.width:.0f} {lay.height:.0f}">{marker}{"".join(parts)}</svg>')


def _table(headers: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td{" class=n" if i in numeric else ""}>{cell}</td>' for i, cell in enumerate(row)) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def _summary(data: dict) -> str:
    report = data["report"]
    accel = sum(1 for s in data["subgraphs"] if s["device"] != "cpu")
    status = ('<b class="good">accepted</b>' if data["accepted"] else '<b class="bad">refused</b>')
    cards = [
        ("target", f"<b>{escape(report['target'])}</b>{' (emulated)' if report['emulated'] else ''}"),
        ("supported", f"<b>{report['support_percentage']}</b>{data['supported_count']} of {data['operator_count']} operators"),
        ("subgraphs", f"<b>{len(data['subgraphs'])}</b>{accel} accelerator, {len(data['subgraphs']) - accel} CPU"),
        ("plan", f"{status}under the model.yaml's partitioner settings"),
    ]
    if data.get("profile"):
        cards.append(("measured", f"<b>{data['profile']['total_ms']:.3f} ms</b>median of {data['profile']['runs']} runs"))
    html = '<div class="cards">' + "".join(f'<div class="card">{t}<br>{body}</div>' for t, body in cards) + "</div>"
    html += "".join(f'<div class="violation">{escape(v["message"])}</div>' for v in data["violations"])
    config = data["config"]
    html += "<p>Partitioner settings: " + ", ".join(
        f"<code>{k}: {escape(json.dumps(v))}</code>" for k, v in config.items()) + "</p>"
    if data.get("compiler_args"):
        html += "<p>Compiler arguments: " + ", ".join(
            f"<code>{escape(k)}</code> {escape(v)}" for k, v in data["compiler_args"]["options"].items()) + "</p>"
    if data.get("memory"):
        html += _memory(data["memory"])
    if data.get("tensor_parallel"):
        html += _tensor_parallel(data["tensor_parallel"])
    if data.get("lora"):
        lora = data["lora"]
        html += (f"<p>LoRA adapter buffers: <b>{_kib(lora['bytes_per_core'])} per core</b> ({lora['max_loras']} "
                 f"adapters at rank {lora['max_lora_rank']}, and the base's zeros, over "
                 f"{escape(', '.join(lora['projections']))}); whole on every core.</p>")
    return html


def _memory(memory: dict) -> str:
    """A generate model's precision and what one core holds: its weights, its KV cache, how many slots would fit."""
    quantized = (f"{memory['quantization']} weights ({memory['quantization_type'].replace('_', ' ')}, by "
                 f"{memory['quantized_by']})" if memory.get("quantization") else "unquantized weights")
    held = memory["bytes_per_core"]
    return (f"<p>Precision: <b>{escape(memory['dtype'])}</b>, {escape(quantized)}, KV cache "
            f"<b>{escape(memory['kv_cache_dtype'])}</b>; per core {_kib(held['weights'])} of weights and "
            f"{_kib(held['kv_cache'])} of KV cache for {memory['max_num_seqs']} slots; "
            f"<b>{memory['slots_that_fit']}</b> slots would fit.</p>" + _host_bytes(memory.get("host_bytes")))


def _host_bytes(host: dict | None) -> str:
    """The engine process's host memory: the weights' copy, the cores' weights and cache (host memory when emulated),
    and what this compiled model took when it last compiled here."""
    if not host:
        return ""
    where = "host memory: the cores are emulated" if host.get("cores_in_host_memory") else "the cores' own memory"
    compiled = (f"; compiling it here last kept {_kib(host['compiled_model'])} (its code and bookkeeping) and "
                f"peaked {_kib(host['compile_peak'])} above what the process held"
                if host.get("compiled_model") is not None and host.get("compile_peak") is not None
                else "; it has not compiled on this machine yet")
    return (f"<p>Host memory: {_kib(host['weights'])} of weights (their copy of record), and on the cores "
            f"{_kib(host['weights_on_cores'])} of weights and {_kib(host['kv_cache'])} of KV cache ({where}), held "
            f"once whatever the number of compiled models{compiled}.</p>")


def _tensor_parallel(split: dict) -> str:
    """A tensor-parallel model's split: each split weight's spec, and what one core holds against the whole."""
    per_core, whole = split["bytes_per_core"], split["bytes_whole"]
    html = (f"<p>Tensor parallelism: <b>{split['tensor_parallel_size']} cores</b>; KV cache "
            f"<code>{escape(split['state'])}</code>; per core {_kib(per_core['weights'])} of weights "
            f"(whole: {_kib(whole['weights'])}) and {_kib(per_core['kv_cache'])} of KV cache "
            f"(whole: {_kib(whole['kv_cache'])}). Weights not listed are whole on every core.</p>")
    rows = "".join(f"<tr><td><code>{escape(name)}</code></td><td><code>{escape(spec)}</code></td></tr>"
                   for name, spec in split["weights"].items())
    return html + f"<table><tr><th>weight</th><th>split (tp: over the cores)</th></tr>{rows}</table>"


def _legend(data: dict) -> str:
    items = "".join(f'<span><i style="background:{c["fill"]}"></i>{escape(c["label"])}</span>'
                    for c in data["categories"].values())
    return (f'<p class="legend">{items}<span>dashed blue arrow: a tensor moved between CPU and the accelerator</span>'
            "<span>red dashed box: a subgraph that breaks a rule</span></p>")


def _subgraph_table(data: dict) -> str:
    timings = {t["index"]: t for t in (data.get("profile") or {}).get("subgraphs", [])}
    rows = []
    for s in data["subgraphs"]:
        t = timings.get(s["index"], {})
        ops = ", ".join(f"{escape(op)}:{n}" for op, n in s["op_counts"].items())
        ms = [f"{t[k]:.3f}" if k in t else "" for k in ("compute_ms", "to_device_ms", "to_cpu_ms")]
        rows.append([str(s["index"]), escape(s["device_label"]), ops, str(s["size"]), _kib(s["bytes_in"]),
                     _kib(s["bytes_out"]), *ms, escape(", ".join(s["breaks"]))])
    headers = ["#", "device", "operators", "size", "in", "out", "compute ms", "to device ms", "to CPU ms", "breaks"]
    return _table(headers, rows, numeric={0, 3, 4, 5, 6, 7, 8})


def _cpu_table(data: dict) -> str:
    rows = []
    for op in data["ops"]:
        if op["category"] == "accelerator":
            continue
        site = op["call_site"]
        where = f"{escape(site['short'])}<br><code>{escape(site['code'])}</code>" if site else "unknown"
        rows.append([f'<span data-node="{escape(op["node"])}">{escape(op["node"])}</span>', escape(op["op"]),
                     str(op["subgraph"]), escape(data["categories"][op["category"]]["label"]),
                     escape(op["reason"] or ""), escape(op["failure_at"] or ""), where])
    if not rows:
        return "<p>Every operator runs on the accelerator.</p>"
    return _table(["node", "operator", "subgraph", "placement", "reason", "refused at", "call site"], rows)


def _counts_table(data: dict) -> str:
    rows = [[escape(op), str(c["total"]), str(c["accelerator"]), str(c["cpu"])] for op, c in data["op_counts"].items()]
    return _table(["operator", "total", "accelerator", "CPU"], rows, numeric={1, 2, 3})


def _batch_sizes(data: dict) -> str:
    sizes = data.get("batch_sizes")
    if not sizes:
        return "<p>Compiled at the trace-time batch only (dynamic_batch is off).</p>"
    return (f"<p>Compiled batch sizes: <code>{escape(json.dumps(sizes))}</code>, each for every shape bucket. "
            "A batch runs as the sizes of least summed cost, timed on a core when the model loads.</p>")


def _buckets(data: dict) -> str:
    buckets = data.get("buckets")
    if not buckets:
        return "<p>No shape buckets in the model.yaml: the model runs at its trace-time shapes.</p>" + _batch_sizes(data)
    rows = [[escape(k), f"<code>{escape(json.dumps(v))}</code>"] for k, v in buckets.items()]
    return _table(["field", "value"], rows) + ("<p>The graph is planned at the example input shapes of the model.yaml; each bucket is traced at "
                                     "its own shapes.</p>") + _batch_sizes(data)


def _padding(data: dict) -> str:
    """What the buckets padded of the traffic the model's replicas recorded (``neuron-serve buckets``' figures)."""
    found = data.get("padding")
    if not found:
        return ("<p>No sizes recorded for this model in the compile cache yet: once it serves, each replica keeps "
                "what it was asked for there, and this says what its buckets padded.</p>")
    rows = [[escape(family), f"<code>{escape(entry['field'])}</code>", str(entry["calls"]),
             f"<code>{escape(json.dumps(entry['today']))}</code>", f"{entry['padding_today']:.2f}x",
             f"<code>{escape(json.dumps(entry['proposed']))}</code>", f"{entry['padding_proposed']:.2f}x"]
            for family, entry in found.items()]
    headers = ["family", "field", "calls recorded", "today", "padded work / real", "proposed", "padded work / real"]
    return ("<h3>What the recorded traffic padded</h3>" + _table(headers, rows, numeric={2, 4, 6})
            + "<p>From the sizes every replica kept in the compile cache; the proposal has as many buckets, the "
              "largest kept. <code>neuron-serve buckets</code> prints the model.yaml fragment.</p>")


def _suggestions(data: dict) -> str:
    found = data.get("suggestions")
    if found is None:
        return "<p>Not computed.</p>"
    cur = found["current"]
    html = (f"<p>Now: {cur['subgraphs']} subgraphs, {cur['accelerator_ops']} operators on the accelerator "
            f"({cur['accelerator_percentage']}); the largest min_subgraph_size this plan passes is "
            f"{cur['min_subgraph_size_max']}. Each row was planned by the partitioner on this graph.</p>")
    if not found["suggestions"]:
        return html + "<p>No ops_to_partition change reduces the number of subgraphs and keeps operators on the accelerator.</p>"
    rows = [[escape(s["change"]), f"<code>{escape(json.dumps(s['ops_to_partition']))}</code>", str(s["subgraphs"]),
             str(s["accelerator_subgraphs"]), f"{s['accelerator_ops']} ({s['accelerator_percentage']})", str(s["cost"]),
             str(s["min_subgraph_size_max"])] for s in found["suggestions"]]
    headers = ["change", "ops_to_partition", "subgraphs", "accelerator subgraphs", "ops on accelerator",
               "cost (ops moved to CPU)", "passes min_subgraph_size up to"]
    return html + _table(headers, rows, numeric={2, 3, 5, 6})


def _profile(data: dict) -> str:
    prof = data.get("profile")
    if not prof:
        return "<p>Not measured: run <code>neuron-serve analyze model.yaml --html report.html --profile</code>.</p>"
    note = " Cores are emulated on XLA:CPU, so times are not Neuron times." if prof.get("emulated") else ""
    return (f"<p>Median of {prof['runs']} runs on the example inputs: {prof['total_ms']:.3f} ms end to end. "
            f"Per subgraph times are in the subgraph table and on each box (accelerator subgraphs time the transfer "
            f"of their inputs to the device and of their outputs back to CPU apart from compute).{note}</p>")


def render(data: dict) -> str:
    """The whole page for :func:`neuron_serve.report.explain.explain`'s data."""
    fills = "".join(f".cat-{k} rect{{fill:{c['fill']}}}" for k, c in data["categories"].items())
    payload = json.dumps(data).replace("</", "<\\/")
    title = f"Partition report: {data['model']}"
    body = [
        f"<header><h1>{escape(title)}</h1><div class=sub>neuron-serve {escape(data['report']['neuron_serve_version'])}"
        f" · torch {escape(data['report']['torch_version'])} · torch-xla {escape(data['report']['torch_xla_version'])}"
        "</div></header><main>",
        f"<section>{_summary(data)}</section>",
        f"<section><h2>Graph</h2>{_legend(data)}<div id=detail>Click an operator for its placement and call site."
        f"</div><div class=graph>{graph_svg(data)}</div></section>",
        f"<section><h2>Subgraphs</h2>{_subgraph_table(data)}</section>",
        pipeline_section(data),
        f"<section><h2>Operators on CPU</h2>{_cpu_table(data)}</section>",
        f"<section><h2>Operator counts</h2>{_counts_table(data)}</section>",
        f"<section><h2>Buckets and batch sizes</h2>{_buckets(data)}{_padding(data)}</section>",
        f"<section><h2>Suggestions</h2>{_suggestions(data)}</section>",
        f"<section><h2>Measured times</h2>{_profile(data)}</section></main>",
        f'<script type="application/json" id="report-data">{payload}</script><script>{_JS}</script>',
    ]
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{_CSS}{fills}</style></head><body>{''.join(body)}</body></html>\n")
