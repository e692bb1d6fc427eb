"""A causal LM's generation models compiled on the process's compile queue, one job a model.

Every compile runs on the compile queue's one thread (assembly/queue.py: torch.export and
tracing are not thread-safe), never inside an engine step. The models that answer every
request come first, :func:`ready_shapes`: the prefill of ``max_model_len`` tokens (any
prompt, padded) and the greedy decode of ``max_num_seqs`` rows over ``max_model_len``
positions (any running set; a sampled row is then chosen on the host from its logits,
exactly). With ``background`` the engines start on them and the rest compile behind, in
the order of :func:`compile_order`; each joins every engine's model as it is compiled
(copied onto the other cores first, on the same thread). Until a model joins, what it
would have run runs on one that has (a larger bucket, one step a call, the greedy decode
and the host's choice, a prefill in place of an extend, a decode in place of a verify);
answers are the same tokens. A variant needed only by some requests (the prefill that
keeps every position's logits, for prompt logprobs) is compiled when one first asks,
ahead of the background ones, while that request waits and the others run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
import time
from typing import Any, Sequence

import torch

from ...buckets import usage as bucket_usage
from ...api import trace_bucket_on_state
from ...assembly import host_memory, progress
from ...assembly.queue import (
    BACKGROUND, COMPILED, FAILED, NEEDED, READY, CompileGroup, CompileJob, CompileQueue, compile_queue
)
from ...buckets.generation import GenerationBuckets
from ...compile import sharding as spmd
from ...compile import core_weights
from ...compile import records as compile_records
from ...compile.aliases import shared_state
from ...errors import ConfigError, InternalCompileError, UnsupportedModelError
from ...model import Bucket
from ...targets.pjrt import on_this_thread, use_device
from ..lora import layers as lora_layers
from ..precision import dtypes as precision
from ..runner import tensor_parallel
from ..runner.attention import grouped_for_compile
from ..runner.model import NO_CPU_PARTITIONS, GenerationModel
from ..runner.shapes import Shape, example_inputs, shapes_of, slot_module

logger = logging.getLogger("neuron_serve")
_builds = itertools.count()


def ready_shapes(buckets: GenerationBuckets) -> list[Shape]:
    """What answers every request: the longest prefill and the greedy one-step decode of every slot over every
    position (a sampled row chosen on the host, one step a call, no extend nor verify)."""
    return [Shape("prefill", 1, buckets.prefill[-1], buckets.prefill[-1], sampled=True),
            Shape("decode", buckets.decode_rows[-1], 1, buckets.decode_context[-1])]


def compile_order(buckets: GenerationBuckets, prefill_shares: Sequence[float] | None = None) -> list[Shape]:
    """Every model, :func:`ready_shapes` first, then the rest, what saves the most per call first:

    - the smaller prefills, shortest first (a short prompt padded to ``max_model_len`` costs the most); with
      ``prefill_shares`` (each prefill bucket's share of the prompt lengths recorded), the most used first;
    - the greedy one-step decodes, fewest rows first, then shortest context (a lone stream run over
      every slot does ``max_num_seqs`` times its work);
    - the sampled one-step decodes in the same order (until then a sampled row takes its logits to the
      host);
    - the prefills of several prompts, fewest first (until then, prompts arriving together go one a call);
    - the mixed models of chunked prefill (until then a prompt is prefilled whole), most rows first, so the
      first one compiled takes a chunk beside any number of rows, greedy then sampled;
    - the multi-step decodes, greedy then sampled;
    - the extends (until then a cached prefix is prefilled again) and the verifies (until then a round
      decodes one token).
    """
    first = ready_shapes(buckets)
    groups = {("prefill", False): 0, ("decode", False): 1, ("mixed", False): 2, ("decode", True): 3,
              ("extend", False): 4, ("verify", False): 5}
    batched = 1.5  # prefills of several prompts: after the one-step decodes (until then, a prompt a call)

    used = dict(zip(buckets.prefill, prefill_shares or ()))

    def rank(shape: Shape) -> tuple:
        rows = -shape.rows if shape.kind == "mixed" else shape.rows
        share = -used.get(shape.tokens, 0.0) if shape.kind == "prefill" else 0.0
        group = batched if shape.kind == "prefill" and shape.rows > 1 else groups[shape.kind, shape.steps > 1]
        return group, shape.sampled, share, rows, shape.context, shape.tokens

    return first + sorted((s for s in shapes_of(buckets) if s not in first), key=rank)


class GenerationBuild:
    """One causal LM's generation models on the compile queue: see the module docstring.

    ``start`` returns the model once the start-up models (every one without ``background``)
    are compiled; the others join it and every copy :meth:`copy_to` made, as they compile.
    """

    def __init__(self, lm: torch.nn.Module, buckets: GenerationBuckets, *, target: str = "neuron",
                 compiler_args: str | list[str] | None = None, compiler_workdir: str | None = None,
                 tensor_parallel_size: int = 1, name: str | None = None, queue: CompileQueue | None = None,
                 lora: lora_layers.Layout | None = None) -> None:
        if not hasattr(lm, "config") or not hasattr(lm.config, "num_hidden_layers"):
            raise ConfigError(f"generation needs a transformers causal LM (a PreTrainedModel with a config); got "
                              f"{type(lm).__name__}.")
        self.lm = lm.eval()
        self.buckets = buckets
        self.lora = lora  # the LoRA buffers every model takes (each row's adapter an input), None without
        self.target, self.compiler_args, self.compiler_workdir = target, compiler_args, compiler_workdir
        self.plan = None
        if tensor_parallel_size > 1:
            tensor_parallel.check(lm.config, tensor_parallel_size)
            spmd.start_spmd(tensor_parallel_size)
            self.plan = tensor_parallel.plan(lm, tensor_parallel_size)
        self.name = name or type(lm).__name__
        # With prompt lengths recorded for this model (buckets/usage.py), the prefills they use most compile first.
        self.order = compile_order(buckets, bucket_usage.shares(self.name, "prefill", buckets.prefill, "prompt lengths")
                                   if name else None)
        self.compiles: CompileGroup = (queue or compile_queue()).group(f"{self.name}#{next(_builds)}")
        # What this machine measured of each compile before (compile/records.py): the budget knows the first
        # compile's need before it starts, and each compile's figures are kept for the next start.
        for label, record in compile_records.remembered(self.name).items() if name else ():
            shape = next((s for s in self.order if s.label == label), None)
            if shape is not None and record.get("peak"):
                self.compiles.queue.budget.expect(self.family(shape), int(record["peak"]))
        if name:
            self.compiles.subscribe(self._remember)
        self.progress = progress.BuildProgress(self.name, len(self.order), labels=[s.label for s in self.order])
        self.model: GenerationModel | None = None
        self._state = None  # the cache every model shares, made by the first compile
        self._early: dict[Shape, Bucket] = {}  # compiled before the model exists
        self._copies: list[tuple[GenerationModel, Any]] = []  # other cores' models, and their devices
        self._jobs: dict[Shape, CompileJob] = {}
        self._deferred: list[Shape] = []  # background compiles not queued yet (resume)
        self._lock = threading.Lock()
        self._switching = threading.Lock()  # one switch of buckets at a time (switch)
        self._open = len(self.order)
        self.finished = threading.Event()  # every planned compile has ended (compiled or failed)
        self.started = time.perf_counter()
        self.ready_seconds: float | None = None  # from the build's start to the start-up models compiled
        # What each compiled model kept of host memory (on every core), as it compiled (assembly/host_memory.py)
        self.compiled_bytes: dict[str, int | None] = {}

    # -- starting ---------------------------------------------------------------------------

    def start(self, background: bool = False) -> GenerationModel:
        """Queue every compile and return the model once the start-up ones are compiled (every one without
        ``background``); raises what a start-up compile raised."""
        early = ready_shapes(self.buckets) if background else self.order
        needed = [self._submit(shape, READY) for shape in early]
        # Queued once the first engine has started (its constructor calls resume): its start-up calls (the slot move's first compile,
        # the cache laid over the group) must not run beside a compile, whose torch_xla.sync() takes in every
        # live tensor of the process (seen at tensor_parallel_size 2: "Check failed: data()->tensor_data").
        self._deferred = [shape for shape in self.order if shape not in early]
        self.compiles.wait(needed)
        failed = next((job for job in needed if job.state == FAILED), None)
        if failed is not None:
            self.compiles.cancel()
            raise failed.future.exception()
        with self._lock:
            self.model = GenerationModel(self._state, self.buckets, self.vocab_size, self.plan, self.weight_bytes,
                                         compiled=dict(self._early), build=self, lora=self.lora)
            self.model.precision = precision.describe(self.lm)
            self.ready_seconds = time.perf_counter() - self.started
            waiting = self._open
        self._share_host_memory()
        logger.info("model %s built in %.1fs%s", self.name, self.ready_seconds,
                    f"; ready on {len(self._early)} of {len(self.order)} compiled models, the other {waiting} compile "
                    f"in the background" if waiting else "")
        return self.model

    def start_scoring(self) -> GenerationModel:
        """Only the prefill that keeps every position's logits, at the largest prefill bucket, compiled alone: the
        model of teacher-forced scoring (every position's next-token distribution of a text, as prompt logprobs
        read them), with no decode to compile (bench/quantization.py)."""
        longest = self.buckets.prefill[-1]
        shape = Shape("scored", 1, longest, longest, sampled=True)
        job = self.compiles.submit(f"{self.name} {shape.label}", functools.partial(self._trace, shape, None),
                                   priority=READY)
        self.compiles.wait([job])
        bucket = job.future.result()
        with self._lock:
            self._open = 0
            self.finished.set()
        model = GenerationModel(self._state, self.buckets, self.vocab_size, self.plan, self.weight_bytes,
                                compiled={shape: bucket}, lora=self.lora)
        model.precision = precision.describe(self.lm)
        return model

    def _share_host_memory(self) -> None:
        """Emulated: the model's weights on the host become views of the core's copy (core_weights.share_with_host),
        for the modules later compiles trace and for the compiled models' records of their weights; the checkpoint's
        own copy is then freed. Before the background compiles start, so each of them finds the weights it lifts
        already held."""
        views = core_weights.share_with_host(self.model.held_weights().values())
        if not views:
            return
        with torch.no_grad():
            for module in self.lm.modules():
                for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                    view = views.get(core_weights.identity(tensor))
                    if view is not None:
                        tensor.data = view
        for bucket in self._early.values():
            for sub in bucket.graph_module.children():
                if getattr(sub, "held_weights", None):
                    sub.weights = {n: views.get(core_weights.identity(t), t) for n, t in sub.weights.items()}

    def resume(self) -> None:
        """Queue the background compiles (once the engine that runs the start-up models has started)."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
        for shape in deferred:
            self._submit(shape, BACKGROUND)

    @property
    def vocab_size(self) -> int:
        return int(self.lm.get_output_embeddings().weight.shape[0])

    @property
    def weight_bytes(self) -> int:
        return tensor_parallel.bytes_per_core(self.lm, self.plan)

    def family(self, shape: Shape) -> str:
        """The compiles whose host memory needs are alike (assembly/host_memory.py): this model's of one kind."""
        return f"{self.name} {shape.kind}"

    def _submit(self, shape: Shape, priority: int) -> CompileJob:
        job = self.compiles.submit(f"{self.name} {shape.label}", functools.partial(self._compile, shape),
                                   priority=priority, family=self.family(shape))
        self._jobs[shape] = job
        job.future.add_done_callback(lambda _: self._ended())
        return job

    def _ended(self) -> None:
        """One planned compile ended (compiled and joined, or failed); the last logs the placement line, and the
        end of the background compile when there was one."""
        with self._lock:
            self._open -= 1
            if self._open or self.finished.is_set():
                return
            background = self.ready_seconds is not None
        self.progress.finish()
        if background:
            logger.info("model %s: background compile finished %.1f s after the build began: %d compiled models%s",
                        self.name, time.perf_counter() - self.started, self.compiles.counts().compiled,
                        progress.failures_said(self.compiles.failures()))
        self.finished.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every planned compile has ended; False on timeout."""
        return self.finished.wait(timeout)

    # -- compiling (on the queue's thread) ----------------------------------------------------

    def _remember(self, job: CompileJob) -> None:
        """A compile that ended: what it took, kept for the next start (compile/records.py)."""
        label = job.label.removeprefix(f"{self.name} ")
        if job.kind == "compile" and job.state == COMPILED:
            compile_records.remember(self.name, label, peak=job.peak_bytes, kept=self.compiled_bytes.get(label),
                                 seconds=round(job.seconds, 1) if job.seconds is not None else None)

    def _placed(self) -> int:
        """Bytes on the cores that are no compiled model's own: the weights held there and the KV cache."""
        states = ([self._state] if self._state is not None else []) + [c.state for c, _ in self._copies]
        return core_weights.held_bytes() + sum(t.numel() * t.element_size() for s in states for t in s.tensors)

    def _compile(self, shape: Shape) -> Bucket:
        with host_memory.kept(self._placed) as measured:
            bucket = self._trace(shape, self.progress)
            with self._lock:
                model = self.model
                if model is None:
                    self._early[shape] = bucket
            if model is not None:
                self._join(model, shape, bucket)
        self.compiled_bytes[shape.label] = measured.kept
        return bucket

    def _trace(self, shape: Shape, reporting: progress.BuildProgress | None) -> Bucket:
        """One model, compiled around the cache every model shares (made, on the core, by the first)."""
        module = slot_module(self.lm, self.buckets, shape, self.lora)
        if self._state is None:
            # The cache's shapes and dtypes as host tensors that hold one element each (a compile reads no value of
            # them; a whole copy of the cache would be held as long as the build).
            self._initial = [torch.zeros((), dtype=t.dtype).expand(t.shape) for t in module.states()]
            self._state = shared_state(self._initial)
        try:
            with grouped_for_compile(self.lm), spmd.sharded(self.plan), \
                    (progress.current(reporting) if reporting is not None else contextlib.nullcontext()):
                if reporting is not None:
                    reporting.at(self.order.index(shape), None)
                return trace_bucket_on_state(module, module.aliases(), example_inputs(shape, self.lora is not None),
                                             self._state,
                                             target=self.target, compiler_args=self.compiler_args,
                                             initial=self._initial, inline_weights_to_neff=False)
        except InternalCompileError as exc:  # torch-xla's own failure: say which model it was compiling
            raise InternalCompileError(f"{self.name} {shape.label}: {exc}") from None
        except UnsupportedModelError as exc:
            # The operator list stands; the usual hint (partition onto CPU) does not apply around the cache.
            listed = str(exc).rsplit("\nPass partitioner_config", 1)[0]
            raise UnsupportedModelError(f"{listed}\n{NO_CPU_PARTITIONS}") from None

    def _join(self, model: GenerationModel, shape: Shape, bucket: Bucket) -> None:
        """A model compiled in the background joins the engines: this core's now, each other core's once loaded
        onto it (on this thread too: loading traces)."""
        model.add(shape, bucket)
        for copy, device in list(self._copies):
            copy.add(shape, on_this_thread(lambda: (use_device(device), copy.bucket_on(bucket)))[1])
        logger.debug("generation model %s joined the engines of %s", shape.label, self.name)

    # -- a switch of buckets while serving ---------------------------------------------------------

    def switch(self, changes: dict[str, list[int]], label: str) -> tuple[int, int]:
        """Serve under the buckets served with ``changes`` (one family's list chosen from the traffic:
        GenerationBuckets' ``prefill`` or ``decode_rows``) from now on: the models they need and the engines
        lack compile on the compile queue behind any other compile (each joins the engines as it is compiled: a
        call fits it or a larger one, answers alike); then every engine's model drops those the new buckets no
        longer plan, in one step. (compiled, kept); raises buckets/learn.Abandoned
        when a compile fails: the new models that did join are dropped again, and the old buckets serve on."""
        from ...buckets.learn import Abandoned  # noqa: PLC0415

        with self._switching:  # the buckets changed are those of the switch before, if one ran meanwhile
            buckets = dataclasses.replace(self.buckets, **changes)
            model = self.model
            wanted = shapes_of(buckets)
            missing = [s for s in compile_order(buckets) if not model.has(s)]
            group = self.compiles.queue.group(label)
            why = "for the buckets it switches to"
            jobs = [group.submit(f"{self.name} {s.label}", functools.partial(self._compile_late, s, why),
                                 priority=BACKGROUND, family=self.family(s)) for s in missing]
            group.wait(jobs)
            failed = next((j for j in jobs if j.state != COMPILED), None)
            planned = set(wanted) if failed is None else set(shapes_of(self.buckets))
            dropped = [s for s in model.shapes if s.kind != "scored" and s not in planned]
            kept = buckets if failed is None else self.buckets
            for each in [model, *(copy for copy, _ in self._copies)]:
                each.rebucket(kept, dropped)
            self.buckets = kept
            if failed is not None:
                raise Abandoned(failed)
            return len(missing), len(wanted) - len(missing)

    # -- copies and late needs ------------------------------------------------------------------

    def copy_to(self, device: Any) -> GenerationModel:
        """The model on another core (its own cache there), compiled for it on the queue's thread, and kept
        up to date with every later compile."""
        def load() -> GenerationModel:
            use_device(device)
            with host_memory.kept(self._placed) as measured:
                copy = self.model.load_to(device)
                with self._lock:
                    self._copies.append((copy, device))
            # the compiled models' code for that core (its weights and cache are counted apart)
            self.compiled_bytes[f"copy onto {device}"] = measured.kept
            return copy

        job = self.compiles.submit(f"load {self.name} onto {device}", functools.partial(on_this_thread, load),
                                   priority=READY, kind="load")
        self.compiles.wait([job])
        return job.future.result()

    def need(self, shape: Shape) -> None:
        """A request waits for ``shape``, a variant compiled on demand (the prompt-logprobs prefill): queued ahead
        of the background compiles, once."""
        with self._lock:
            job = self._jobs.get(shape)
            if job is None:
                self._jobs[shape] = self.compiles.submit(f"{self.name} {shape.label}",
                                                         functools.partial(self._compile_late, shape),
                                                         priority=NEEDED, family=self.family(shape))
                return
        self.compiles.queue.promote(job, NEEDED)

    def _compile_late(self, shape: Shape, why: str = "asked for by a request") -> Bucket:
        started = time.perf_counter()
        with host_memory.kept(self._placed) as measured:
            bucket = self._trace(shape, None)
            self._join(self.model, shape, bucket)
        self.compiled_bytes[shape.label] = measured.kept
        logger.info("compiled %s %s (%s) in %.1f s", self.name, shape.label, why, time.perf_counter() - started)
        return bucket


def compile_generation(lm: torch.nn.Module, buckets: GenerationBuckets, *, target: str = "neuron",
                       compiler_args: str | list[str] | None = None,
                       compiler_workdir: str | None = None, tensor_parallel_size: int = 1,
                       name: str | None = None, lora: lora_layers.Layout | None = None) -> GenerationModel:
    """Compile ``lm`` (a transformers causal LM) for generation under ``buckets``, every model, and return them
    (a GenerationBuild, waited for; a replica starts on the first ones instead).

    ``name`` names the model in the progress lines (default: its class, ``LlamaForCausalLM``).

    ``tensor_parallel_size`` N above 1 compiles each model once for a group of N cores (SPMD,
    split by the model's tensor-parallel plan): this process's cores must be that group."""
    return GenerationBuild(lm, buckets, target=target, compiler_args=compiler_args, compiler_workdir=compiler_workdir,
                           tensor_parallel_size=tensor_parallel_size, name=name, lora=lora).start(background=False)
