"""Which operators run on the accelerator: real torch-xla evidence plus target limits.

An operator is unsupported when the target's profile says so, when torch-xla cannot
lower it (it falls back to CPU and an ``aten::*`` counter appears in
torch_xla.debug.metrics), or when its one-op graph fails to compile. Each answer is
cached per (operator, argument shapes and dtypes, target, versions), so a model with
many identical layers compiles each distinct one-op graph once; the persistent compile
cache keeps the answers across processes, so a second start compiles none.

Only verdicts are cached: a probe that fails for a reason of torch-xla's own (its process
state, memory; ``xla_state.internal_failure``) is retried once in a clean state and, failing
again, raised as an :class:`~neuron_serve.errors.InternalCompileError`, never stored. A stored
entry with such a reason (written before this rule) is not trusted, and a stored "unsupported"
is never used alone: it is decided afresh, once a process, before it puts an operator on CPU
or refuses a model. Every probe holds the process's XLA state (``xla_state.exclusive``) and
syncs only its own tensors.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..compile import cache as compile_cache
from ..errors import InternalCompileError
from ..targets import Decision, Target, xla_state
from ..targets.pjrt import versions, xla

logger = logging.getLogger("neuron_serve")

LOWERING_STAGE = "torch-xla lowering"
COMPILE_STAGE = "xla compile"


@dataclass
class OracleStats:
    queries: int = 0
    compiles: int = 0


def _signature(value: Any) -> Any:
    """A hashable description of an argument: shape/dtype for tensors, value otherwise."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), str(value.dtype), tuple(value.stride()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _signature(v)) for k, v in value.items())))
    return ("V", repr(value))


def _example(value: Any) -> Any:
    """A real tensor like the fake one export recorded, with values safe for any op.

    Integer tensors are zeros so index arguments stay in range; floats are in [0, 1)
    so log/sqrt-style ops see ordinary inputs.
    """
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype.is_floating_point and value.dtype.itemsize == 1:  # fp8: drawn in float32, then rounded
        out = torch.rand(value.shape).to(value.dtype)
    elif value.dtype.is_floating_point or value.dtype.is_complex:
        out = torch.rand(value.shape, dtype=value.dtype)
    else:
        out = torch.zeros(value.shape, dtype=value.dtype)
    return out


@dataclass
class SupportOracle:
    """Answers "can the target run this node?" for one target, with a cache."""

    target: Target
    stats: OracleStats = field(default_factory=OracleStats)
    _cache: dict = field(default_factory=dict)
    # torch-xla's fallback counters are process-wide, so one lowering check runs at a
    # time; with max_workers the rest (profile rules, cache reads) runs in parallel.
    _xla_lock: threading.Lock = field(default_factory=threading.Lock)

    def decide(self, node: torch.fx.Node, op: str, gm: torch.fx.GraphModule, flags: tuple[str, ...] = ()) -> Decision:
        """Can the target run ``node``? ``flags`` (the compiler arguments) are part of the cache key:
        on Neuron the compiler frontend answers, and its answer can depend on them."""
        with self._xla_lock:
            self.stats.queries += 1
        decision = self.target.profile_decision(op, node)
        if decision is not None:
            return decision
        args, kwargs = self._concrete_args(node, gm)
        key = (self.target.name, str(node.target), _signature(args), _signature(kwargs), tuple(versions().values()))
        if flags:  # keys made without compiler arguments stay as they were
            key = (*key, ("compiler_args", tuple(flags)))
        if key not in self._cache:
            self._cache[key] = self._lookup(key, node.target, op, args, kwargs)
        return self._cache[key]

    def _lookup(self, key: tuple, target: Any, op: str, args: tuple, kwargs: dict) -> Decision:
        store = compile_cache.current()
        stored = store.get("support", key) if store is not None else None
        if stored is not None and _trusted(stored, op):
            return Decision(**stored)
        with self._xla_lock:
            if key in self._cache:  # another thread decided it while this one waited
                return self._cache[key]
            if store is None:
                return self._probe(target, op, args, kwargs)

            def decide() -> dict:
                decision = self._probe(target, op, args, kwargs)
                if stored is not None and decision.supported:
                    logger.info("compile cache: %s was stored as unsupported (%s); decided afresh, it runs on the "
                                "accelerator, and the entry is replaced", op, stored.get("reason"))
                return {"supported": decision.supported, "failure_at": decision.failure_at, "reason": decision.reason}
            # Another replica starting beside this one may be deciding the same: it is decided once. A stored entry
            # not trusted is decided again and written over.
            if stored is not None:
                with store.lease("support", key):
                    payload = decide()
                    store.put("support", key, payload)
                return Decision(**payload)
            return Decision(**store.get_or_compute("support", key, decide, missed=True))

    def _probe(self, target: Any, op: str, args: tuple, kwargs: dict) -> Decision:
        """The operator run on XLA; a failure of torch-xla's own state is tried once more in a clean state, and
        raised if it comes back (an operator's verdict is never made of it)."""
        with xla_state.exclusive():
            decision, failure = self._run_on_xla(target, op, args, kwargs)
            if failure is None or not xla_state.internal_failure(failure):
                return decision
            logger.warning("the support check of %s failed inside torch-xla (%s); trying it again in a clean state",
                           op, decision.reason)
            xla_state.clean_state(xla())
            decision, failure = self._run_on_xla(target, op, args, kwargs)
            if failure is not None and xla_state.internal_failure(failure):
                raise InternalCompileError(
                    f"torch-xla failed inside its own state while checking whether {op} runs on the accelerator, "
                    f"twice (the second time in a clean state): {decision.reason}. This is not a verdict on the "
                    "operator and nothing was cached; deploy again, and report it if it persists.")
            return decision

    @staticmethod
    def _concrete_args(node: torch.fx.Node, gm: torch.fx.GraphModule) -> tuple[tuple, dict]:
        def value(arg: torch.fx.Node) -> Any:
            if arg.op == "get_attr":
                return _attr(gm, arg.target)
            return pytree.tree_map(_example, arg.meta["val"])

        return torch.fx.node.map_arg((node.args, node.kwargs), value)

    def _run_on_xla(self, target: Any, op: str, args: tuple, kwargs: dict) -> tuple[Decision, BaseException | None]:
        """The decision, and the exception that made it a "no" (None for a "yes" or a lowering fallback). Only this
        probe's own tensors are synced; the counters are read under the caller's hold of the XLA state."""
        torch_xla = xla()
        import torch_xla.debug.metrics as metrics  # noqa: PLC0415

        device = torch_xla.device()
        self.stats.compiles += 1
        to_xla = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        metrics.clear_counters()
        try:
            with torch.no_grad():
                out = target(*pytree.tree_map(to_xla, args), **pytree.tree_map(to_xla, kwargs))
                leaves = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
                on_xla = [leaf for leaf in leaves if leaf.device.type == "xla"]
                if on_xla:
                    torch_xla._XLAC._xla_sync_multi(on_xla, devices=[], wait=True)
                for leaf in leaves:
                    leaf.cpu()
        except Exception as exc:  # the compiler or the lowering refused it, or torch-xla failed (the caller tells)
            logger.debug("%s failed on XLA: %s", op, exc)
            return Decision(False, COMPILE_STAGE, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"), exc
        fallbacks = sorted(c for c in metrics.counter_names() if c.startswith("aten::"))
        if fallbacks:
            return Decision(False, LOWERING_STAGE,
                            f"torch-xla has no lowering (CPU fallback: {', '.join(fallbacks)})"), None
        return Decision.ok(), None


def _trusted(stored: dict, op: str) -> bool:
    """Whether a stored decision can be used as it is: a "yes", not a "no" (decided afresh before it places an
    operator on CPU or refuses a model) nor a failure of torch-xla's own written as one by an older version."""
    if stored.get("supported"):
        return True
    if xla_state.internal_failure(stored.get("reason")):
        logger.warning("compile cache: the entry for %s says unsupported for a reason of torch-xla's own (%s), not "
                       "a verdict on the operator; not trusted, decided afresh", op, stored.get("reason"))
    return False


def _attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
