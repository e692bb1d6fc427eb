"""An accelerator subgraph compiled through torch-xla into one cached executable.

``extract_compiled_graph`` (torch-xla's dynamo bridge, what the ``openxla`` backend
uses) traces the FX graph once on XLA tensors and hands back a callable that replays
the compiled executable with little per-call overhead. On Neuron the executable is a
NEFF; in emulation it is an XLA:CPU executable. Weights stay resident on the device;
only activations cross per call.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from typing import Any, Iterator, Sequence

import torch
import torch.fx

from ..config.compiler_args import NONE, CompilerArgs
from ..targets import xla_state
from ..targets.pjrt import emulated, use_device, xla
from . import core_weights
from . import sharding as spmd
from .lift_weights import lift_weights
from .passes.fold_weight_layout import DERIVED, fold_input_layout, fold_weight_layout
from .passes.matvec_addend import subtract_matvec_addends
from .passes.place_on_device import place_on_device
from .passes.row_linear import weight_times_column
from .replay import direct_replay

logger = logging.getLogger("neuron_serve")

_compiles = 0  # executables compiled in this process; replace_weights must not add any


def compile_count() -> int:
    """How many subgraph executables this process has compiled (every trace, load and core copy)."""
    return _compiles


def _alias_count() -> int:
    """Input buffers torch-xla has compiled as aliased to an output, in this process."""
    import torch_xla.debug.metrics as metrics  # noqa: PLC0415

    data = metrics.metric_data("InputOutputAliasCount")
    return int(data[1]) if data else 0


def _copy_to(source: torch.fx.GraphModule, device: Any,
             weights: list[torch.Tensor] = ()) -> tuple[torch.fx.GraphModule, set[int]]:
    """A copy of ``source``, weights laid out for their matmuls, with every tensor it creates on ``device``.

    ``weights`` are the lifted weight inputs (trailing); also returns the indices of
    those the copy takes transposed (see :func:`_on_device`).
    """
    gm = copy.deepcopy(source)
    if emulated():
        weight_times_column(gm)
    gm = fold_weight_layout(gm)
    transposed = fold_input_layout(gm, list(weights)) if weights else set()
    if emulated():
        subtract_matvec_addends(gm)
    return place_on_device(gm, device).to(device), transposed


def _zeros(specs: Sequence[tuple]) -> list[torch.Tensor]:
    """Host tensors of ``specs`` ((shape, dtype) each): a compile's inputs, whose values do not matter."""
    return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]


def _graphs(gm: torch.fx.GraphModule) -> Iterator[torch.fx.GraphModule]:
    """``gm``'s graph modules: itself, its submodules, and those the dynamo bridge keeps in the closures of the
    calls it put in their place (each fused part it compiled)."""
    seen: set[int] = set()
    pending = [gm]
    while pending:
        module = pending.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield module
        pending.extend(m for m in module.children() if isinstance(m, torch.fx.GraphModule))
        graph = getattr(module, "graph", None)
        for node in graph.nodes if isinstance(graph, torch.fx.Graph) else ():
            cells = getattr(node.target, "__closure__", None) if node.op == "call_function" else None
            for cell in cells or ():
                try:
                    held = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if isinstance(held, torch.fx.GraphModule):
                    pending.append(held)


def _compact(gm: torch.fx.GraphModule, keep: tuple[str, ...] = ()) -> None:
    """Drop what each node of ``gm``'s graphs records of how it was made, but ``keep``: stack traces, module stacks,
    provenance. A compiled model keeps its graphs for as long as it serves, and that record is most of their size."""
    for module in _graphs(gm):
        graph = getattr(module, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            for node in graph.nodes:
                node.meta = {k: v for k, v in node.meta.items() if k in keep}


def _release_example_inputs(compiled: torch.fx.GraphModule) -> None:
    """Let go of the device inputs the dynamo bridge kept from the compile's trace (``xla_args`` of the graph and
    of each fused part): a generate model's are a copy of the whole KV cache. The bridge sets them afresh before it
    ever traces again."""
    for module in _graphs(compiled):
        if getattr(module, "xla_args", None) is not None:
            module.xla_args = None


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _returns_tuple(gm: torch.fx.GraphModule) -> bool:
    """Make the graph return a tuple (the bridge expects it); say if it already did."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return True
    output.args = ((output.args[0],),)
    gm.recompile()
    return False


@contextlib.contextmanager
def neuron_cc_flags(args: CompilerArgs) -> Iterator[None]:
    """On Neuron, hand ``args`` to neuronx-cc (NEURON_CC_FLAGS, which its NEFF cache keys on).

    In emulation XLA:CPU compiles and the flags are only recorded; the numeric ones are
    reproduced by FX passes before compile (see passes/auto_cast.py).
    """
    if emulated() or not args:
        yield
        return
    previous = os.environ.get("NEURON_CC_FLAGS")
    os.environ["NEURON_CC_FLAGS"] = " ".join(filter(None, [previous, args.neuron_cc_flags()]))
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("NEURON_CC_FLAGS", None)
        else:
            os.environ["NEURON_CC_FLAGS"] = previous


class CompiledSubgraph(torch.nn.Module):
    """Runs one accelerator partition on one device; consumes and returns CPU tensors."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        example_args: Sequence[torch.Tensor],
        *,
        name: str = "subgraph",
        device: Any = None,
        compiler_workdir: str | None = None,
        inline_weights: bool = True,
        weights: dict[str, torch.Tensor] | None = None,
        compiler_args: CompilerArgs = NONE,
        donate: Sequence[int] = (),
        sharding: spmd.Sharding | None = None,
    ) -> None:
        super().__init__()
        # The trace's whole-process calls (its sync, its clearing of pending IR) hold the XLA state themselves
        # (xla_state.install); the rest works on this subgraph's own tensors, beside serving.
        self._build(gm, example_args, name, device, compiler_workdir, inline_weights, weights, compiler_args,
                    donate, sharding)

    def _build(self, gm: torch.fx.GraphModule, example_args: Sequence[torch.Tensor], name: str, device: Any,
               compiler_workdir: str | None, inline_weights: bool, weights: dict[str, torch.Tensor] | None,
               compiler_args: CompilerArgs, donate: Sequence[int], sharding: spmd.Sharding | None) -> None:
        global _compiles
        torch_xla = xla()
        from torch_xla._dynamo.dynamo_bridge import extract_compiled_graph  # noqa: PLC0415

        self.name = name
        # A CPU copy of the graph, to load onto further cores; its weights are the graph's own tensors, not copies
        # (each compiled model of a grid would otherwise hold another copy of every weight on the host).
        self.source = copy.deepcopy(gm, {id(t): t for t in (*gm.parameters(), *gm.buffers())})
        self._tuple_out = _returns_tuple(self.source)
        self.inline_weights = inline_weights
        # Weights apart from the executable: lifted into trailing inputs, kept on the device.
        self.weights: dict[str, torch.Tensor] = {}
        if not inline_weights:
            lifted = lift_weights(self.source) if weights is None else {}
            self.weights = weights if weights is not None else lifted
        self.device = device if device is not None else torch_xla.device()
        # Only the shapes and dtypes: a compile's inputs' values do not matter, and a copy of a generate model's
        # (its whole KV cache) would be held for every compiled model.
        self.example_specs = [(tuple(a.shape), a.dtype) for a in example_args]
        self.compiler_workdir = compiler_workdir
        self.compiler_args = compiler_args  # what neuronx-cc gets for this subgraph
        # One program over a core group: weights and state split as the plan says (SPMD).
        self.sharding = sharding if sharding is not None else spmd.current()
        use_device(self.device)
        resident, self._transposed = _copy_to(self.source, self.device, list(self.weights.values()))
        self._hold_weights()
        xla_args = [a.to(self.device) for a in example_args] + self._weights_on_device
        # State inputs (input_output_aliases) whose buffer the executable may reuse for
        # their new value: torch-xla compiles donated inputs as aliased to an output.
        self.donate = list(donate)
        # Under a plan: the layout each input is compiled for, given to a host input as it moves to the group.
        self._layouts: dict[int, Any] = {}
        if self.sharding is not None:
            spmd.apply_to_module(resident, self.sharding, resident.meta.get(DERIVED, {}))
            # The plan's state spec is the KV cache's; a state of another rank (LoRA's buffers) stays whole, as does
            # every other input.
            state = self.sharding.state
            specs = [state if i in self.donate and state is not None and len(state) == a.dim() else None
                     for i, a in enumerate(example_args)]
            for index in self.donate:
                spmd.mark(xla_args[index], specs[index], self.sharding.devices)
            self._layouts = {i: spmd.layout(spec, a, self.sharding.devices)
                             for i, (spec, a) in enumerate(zip(specs, example_args)) if spec is not None}
        # Outputs left on the device: new values of state tensors, never copied to the host.
        self.keep_on_device: set[int] = set()
        self._donate(xla_args)
        aliased_before = _alias_count()
        started = time.perf_counter()
        with torch.no_grad(), neuron_cc_flags(compiler_args):
            self._compiled = extract_compiled_graph(resident, xla_args)
            outputs = self._compiled(*xla_args)
        self._replay = direct_replay(self._compiled)
        _release_example_inputs(self._compiled)
        # The source is compiled again for another core, whose passes read each value's shape ("val"); the compiled
        # graph is only ever traced again, which reads no record.
        _compact(self.source, keep=("val",))
        _compact(self._compiled)
        del xla_args, outputs
        self.aliased_buffers = _alias_count() - aliased_before  # inputs XLA aliased to outputs
        _compiles += 1
        self.compile_seconds = time.perf_counter() - started
        self._on_device = resident  # keeps the resident weights alive
        if compiler_workdir:
            self._dump_hlo(compiler_workdir)
        logger.debug("compiled %s on %s in %.3fs", name, self.device, self.compile_seconds)

    @property
    def held_weights(self) -> dict[str, core_weights.HeldWeight]:
        """The weights this executable takes, by name, as held on its device (shared with every other executable
        there that takes them); none when they are compiled in."""
        return dict(zip(self.weights, self._held))

    @property
    def example_args(self) -> list[torch.Tensor]:
        """Inputs of the compiled shapes and dtypes (zeros), as the compile took them."""
        return _zeros(self.example_specs)

    def _hold_weights(self) -> None:
        """The lifted weights on this subgraph's device, shared with every executable there that takes the same
        (core_weights.py): each split as the plan splits its source, transposed with it when it is taken so."""
        names, host = list(self.weights), list(self.weights.values())
        specs = None
        if self.sharding is not None:
            specs = []
            for index, name in enumerate(names):
                spec = self.sharding.spec_of(name)
                if spec is not None and len(spec) != host[index].dim():
                    raise ValueError(f"sharding spec {spec} of {name} does not fit its shape {tuple(host[index].shape)}")
                specs.append(spmd.permuted(spec, "t", ()) if spec is not None and index in self._transposed else spec)
        self._held = core_weights.hold(host, self._transposed, self.device, specs,
                                       self.sharding.devices if self.sharding is not None else 1)
        self._weights_on_device = [h.tensor for h in self._held]

    def _donate(self, on_device: list[torch.Tensor]) -> None:
        for index in self.donate:
            xla()._XLAC._set_buffer_donation(on_device[index], True)

    def _run(self, args: list[torch.Tensor]) -> Any:
        """One replay of the executable on device ``args`` (inputs, then lifted weights)."""
        return self._replay(args) if self._replay is not None else self._compiled(*args)

    def _outputs(self, outputs: Sequence[torch.Tensor]) -> Any:
        # The outputs leaving the device are fetched in one transfer: per tensor, ``.cpu()``
        # costs about 0.1 ms more a call (the MLP example's batch-1 call: 1.31 -> 1.23 ms).
        leaving = [i for i, o in enumerate(outputs)
                   if i not in self.keep_on_device and isinstance(o, torch.Tensor) and o.device.type == "xla"]
        fetched = dict(zip(leaving, xla()._XLAC._xla_get_cpu_tensors([outputs[i] for i in leaving]))) if leaving else {}
        kept = tuple(fetched[i] if i in fetched else o if i in self.keep_on_device else o.cpu()
                     for i, o in enumerate(outputs))
        return kept if self._tuple_out else kept[0]

    def _dump_hlo(self, workdir: str) -> None:
        # The compiled outputs are already device data (their HLO is empty), so lower afresh.
        os.makedirs(workdir, exist_ok=True)
        text = self.hlo_text()
        with open(os.path.join(workdir, f"{self.name}.hlo.txt"), "w") as handle:
            handle.write(text)

    def hlo_text(self) -> str:
        """The HLO torch-xla lowers this subgraph to (what the compiler compiles)."""
        with xla_state.exclusive():
            use_device(self.device)
            # The compiled module replays its executable; lowering again needs a fresh copy.
            lowered, _ = _copy_to(self.source, self.device, list(self.weights.values()))
            with torch.no_grad():
                outputs = lowered(*[a.to(self.device) for a in _zeros(self.example_specs)], *self._weights_on_device)
            return xla()._XLAC._get_xla_tensors_hlo(list(outputs))

    def load_to(self, device: Any) -> "CompiledSubgraph":
        """A copy of this subgraph compiled for and resident on ``device`` (another core).

        Call it from the thread that will run the copy (see :func:`use_device`).
        """
        copy_ = CompiledSubgraph(self.source, _zeros(self.example_specs), name=self.name, device=device,
                                 compiler_args=self.compiler_args, inline_weights=self.inline_weights,
                                 weights=self.weights, donate=self.donate, sharding=self.sharding)
        copy_._tuple_out = self._tuple_out  # self.source already returns a tuple
        copy_.keep_on_device = set(self.keep_on_device)
        return copy_

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Hand the executable other weights (same names, shapes, dtypes); nothing is compiled. The host tensors
        are kept as given: every executable given the same ones shares their copy on the device, so they must not
        change in place afterwards (replace_weights clones a state dict once for all of a model's executables)."""
        if self.inline_weights:
            raise ValueError(f"{self.name} holds its weights inside the executable")
        self.weights = {name: weights[name].detach() for name in self.weights}
        self._hold_weights()

    def _to_device(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``args`` on the device: the ones on the host moved in one transfer call.

        One call for all of them instead of a ``.to()`` each: each call lets the GIL go
        and takes it back, and on a busy replica every take-back may wait for the event
        loop (four decode inputs: 24 -> 16 µs, and one hand-over of the GIL instead of four).
        """
        on_device = list(args)
        host = [i for i, a in enumerate(args) if a.device.type != "xla"]
        # A host input the executable takes split (a state, at the compile's first call) moves in its layout; the
        # others move whole, which a program over a group takes as replicated.
        split = [i for i in host if i in self._layouts]
        whole = [i for i in host if i not in self._layouts] if split else host
        for group, layouts in ((split, [self._layouts[i] for i in split]), (whole, None)):
            if group:
                moved = xla()._XLAC._xla_tensors_from_aten([_dense(args[i]) for i in group],
                                                           [str(self.device)] * len(group), layouts)
                for i, tensor in zip(group, moved):
                    on_device[i] = tensor
        return on_device

    def forward(self, *args: torch.Tensor) -> Any:
        with torch.no_grad():
            # The dispatch holds the XLA state (a trace beside it would see the donated inputs); the outputs are
            # device data once launched, fetched without it while the next caller dispatches.
            with xla_state.exclusive():
                on_device = self._to_device(args)
                self._donate(on_device)
                outputs = self._run(on_device + self._weights_on_device)
            return self._outputs(outputs)

    def timed(self, *args: torch.Tensor) -> tuple[Any, dict[str, float]]:
        """forward() with its phases timed apart: to the device, compute, back to CPU.

        Each phase waits for the device, so the times add up to a slower call than
        forward(); the partition report uses them to show what transfers cost.
        """
        wait = xla()._XLAC._xla_wait_device_ops
        with torch.no_grad(), xla_state.exclusive():
            started = time.perf_counter()
            on_device = [a.to(self.device) for a in args] + self._weights_on_device
            self._donate(on_device)
            wait(devices=[])
            moved = time.perf_counter()
            outputs = self._run(on_device)
            wait(devices=[])
            computed = time.perf_counter()
            result = self._outputs(outputs)
            done = time.perf_counter()
        phases = {"to_device_s": moved - started, "compute_s": computed - moved, "to_cpu_s": done - computed}
        return result, phases
