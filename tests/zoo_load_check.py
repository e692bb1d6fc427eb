"""Run in a fresh process by tests/unit/test_zoo.py: load every saved artifact and compare.

argv: a JSON file listing {"name", "artifact", "io"}; each io file holds the flat inputs
and the eager outputs (torch.save of plain tensors). The artifacts are loaded onto core 0
and core 1 in turn (CPU_NUM_DEVICES=2): each one's subgraphs are compiled again, on that
core, and run there. (One core each: a subgraph compiled for another core is the same
graph compiled again, and load_to, the path a replica's further cores take, is tested
with the runtime.) Prints one JSON object: name -> {"core": its core, "diff": the
largest absolute difference from eager}.
"""

import json
import sys

import torch
import torch.utils._pytree as pytree

import neuron_serve
from neuron_serve.compile.subgraph import CompiledSubgraph
from neuron_serve.targets.pjrt import use_device, xla


def largest_difference(outputs, expected) -> float:
    leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
    assert len(leaves) == len(expected), (len(leaves), len(expected))
    return max(float((a.double() - b.double()).abs().max()) if a.numel() else 0.0 for a, b in zip(leaves, expected))


def main() -> None:
    results = {}
    for index, entry in enumerate(json.loads(open(sys.argv[1]).read())):
        io = torch.load(entry["io"])
        core = index % 2
        use_device(xla().device(core))
        model = neuron_serve.load(entry["artifact"])
        devices = {str(sub.device) for sub in model.first.graph_module.children() if isinstance(sub, CompiledSubgraph)}
        assert devices <= {str(xla().device(core))}, (entry["name"], devices)
        results[entry["name"]] = {"core": core, "diff": largest_difference(model(*io["inputs"]), io["expected"])}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
