"""Run in a fresh process by tests/unit/test_zoo.py: load every saved artifact and compare.

argv: a JSON file listing {"name", "artifact", "io"}; each io file holds the flat inputs
and the eager outputs (torch.save of plain tensors). Every artifact is run as loaded
(its subgraphs compiled again on core 0) and again with each accelerator subgraph
loaded onto core 1 (CPU_NUM_DEVICES=2). Prints one JSON object: name -> largest
absolute difference from eager on each core.
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
    for entry in json.loads(open(sys.argv[1]).read()):
        io = torch.load(entry["io"])
        model = neuron_serve.load(entry["artifact"])
        use_device(xla().device(0))
        core0 = largest_difference(model(*io["inputs"]), io["expected"])
        graph = model.first.graph_module
        second = xla().device(1)
        use_device(second)
        for name, sub in list(graph.named_children()):
            if isinstance(sub, CompiledSubgraph):
                setattr(graph, name, sub.load_to(second))
        core1 = largest_difference(model(*io["inputs"]), io["expected"])
        use_device(xla().device(0))
        results[entry["name"]] = {"core0": core0, "core1": core1}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
