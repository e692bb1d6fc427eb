"""A causal LM compiled for generation: prefill and decode models around one KV cache on the core.

``compile_generation`` runs neuron-serve's own pipeline on a transformers causal LM
wrapped in :class:`~neuron_serve.generation.slots.SlotLM`: ``bucket_model_trace``
compiles one prefill model per prompt-length bucket (one row, writing one slot) and one
decode model per (running-sequences bucket x context-length bucket), every one taking
the cache as its ``shared_state_buffer``. Analysis and partitioning run for each as for
any model, so an operator the accelerator cannot run around the cache is refused
naming it.

:class:`GenerationModel` is what the engine calls: ``prefill`` one prompt into a slot,
``decode`` one token for each of a set of running sequences. Each call leaves the cache and
the logits on the core and brings home one greedy token per row; the logits cross only
for a row that samples, penalizes or asks for logprobs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx

from ..build import progress
from ..api import bucket_model_trace, trace_bucket_on_state
from ..buckets.shape import BucketModelConfig
from ..buckets.generation import GenerationBuckets
from ..compile import sharding as spmd
from ..errors import ConfigError, InvalidInput, UnsupportedModelError
from ..model import Bucket, CompiledModel
from ..model.state import DeviceState
from . import tensor_parallel
from .attention import grouped_for_compile
from .slots import SlotLM


NO_CPU_PARTITIONS = ("Generation runs every operator on the NeuronCore, where the KV cache lives; replace the operator "
                     "(or serve the model with task: infer).")


@dataclass(frozen=True)
class Shape:
    """One compiled generation model: ``rows`` sequences of ``tokens`` tokens, attending over ``context`` positions."""

    kind: str  # "prefill", "decode", "extend" (prefill after a cached prefix) or "verify" (speculative proposals)
    rows: int
    tokens: int
    context: int
    steps: int = 1  # greedy decode steps in one call

    @property
    def label(self) -> str:
        """The bucket label of metrics and logs: prefill_64, decode_8x256, decode_8x256_steps4."""
        if self.kind == "prefill":
            return f"prefill_{self.tokens}"
        if self.kind == "extend":
            return f"extend_{self.tokens}x{self.context}"
        if self.kind == "verify":
            return f"verify_{self.rows}x{self.context}_tokens{self.tokens}"
        return f"decode_{self.rows}x{self.context}" + (f"_steps{self.steps}" if self.steps > 1 else "")


def shapes_of(buckets: GenerationBuckets) -> list[Shape]:
    """Every compiled model, in bucket order: prefill buckets, then decode (rows-major)."""
    shapes = [Shape("prefill", 1, length, length) for length in buckets.prefill]
    decode = [(rows, context) for rows in buckets.decode_rows for context in buckets.decode_context]
    shapes += [Shape("decode", rows, 1, context) for rows, context in decode]
    if buckets.decode_steps > 1:
        shapes += [Shape("decode", rows, 1, context, buckets.decode_steps) for rows, context in decode]
    shapes += [Shape("extend", 1, tokens, context) for tokens, context in buckets.extend]
    if buckets.speculative_tokens:
        shapes += [Shape("verify", rows, buckets.speculative_tokens + 1, context) for rows, context in decode]
    return shapes


def _example(shape: Shape) -> tuple[torch.Tensor, ...]:
    tokens = torch.zeros(shape.rows, shape.tokens, dtype=torch.long)
    positions = torch.arange(shape.tokens).expand(shape.rows, shape.tokens).contiguous()
    slots = torch.arange(shape.rows, dtype=torch.long)
    last = torch.full((shape.rows, 1), shape.tokens - 1, dtype=torch.long)
    return tokens, positions, slots, last


class StepOutput:
    """One compiled call's rows: their greedy tokens (on the host) and their logits (on the core until asked for)."""

    def __init__(self, logits: torch.Tensor, greedy: torch.Tensor, index: torch.Tensor | None = None) -> None:
        self._logits = logits
        self._greedy = greedy
        self._index = index

    def rows(self, index: torch.Tensor) -> "StepOutput":
        """The same output, for rows ``index`` only, in that order."""
        return StepOutput(self._logits, self._greedy, index)

    @property
    def greedy(self) -> list:
        """Each row's argmax, chosen on the core (a list of each step's per row, for a call of several steps)."""
        return self._greedy[self._index].tolist()

    @property
    def logits(self) -> torch.Tensor:
        """Each row's logits (rows, vocab), copied to the host: for sampling, penalties and logprobs."""
        return self._logits.cpu()[self._index]


def _keep_logits_on_core(bucket: Bucket) -> None:
    """Leave output 0 (the logits) of ``bucket``'s compiled call on the core: only what is asked for crosses."""
    gm = bucket.graph_module
    logits = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0][0]
    call, index = (logits.args[0], logits.args[1]) if logits.op == "call_function" else (logits, 0)
    gm.get_submodule(call.target).keep_on_device.add(index)


class GenerationModel:
    """The compiled prefill and decode models of one causal LM and the cache they share on the core.

    With ``sharding`` (tensor parallelism) every model is one program over the group's cores
    and the cache is split as the plan says; ``weight_bytes`` is what one core holds of the weights.
    """

    def __init__(self, compiled: CompiledModel, buckets: GenerationBuckets, vocab_size: int,
                 sharding: spmd.Sharding | None = None, weight_bytes: int | None = None,
                 source: tuple | None = None) -> None:
        self.compiled = compiled
        # (transformers model, target, compiler_args) to compile the prompt-logprobs prefill from, when first asked.
        self._source = source
        self._scored: dict[int, Bucket] = {}
        self.buckets = buckets
        self.shapes = shapes_of(buckets)
        self.vocab_size = vocab_size
        self.sharding = sharding
        self.weight_bytes = weight_bytes
        self._index = {s: i for i, s in enumerate(self.shapes)}
        self.draft: GenerationModel | None = None  # a speculative draft's compiled models, beside these
        for bucket in compiled.buckets:
            _keep_logits_on_core(bucket)
        self._split_cache()

    @property
    def tensor_parallel_size(self) -> int:
        """Cores one call spans (1: one core)."""
        return self.sharding.devices if self.sharding is not None else 1

    def _split_cache(self) -> None:
        """Lay the cache out over the group as the plan says (after it was written from the host)."""
        if self.sharding is not None:
            for tensor in self.compiled.states:
                spmd.mark(tensor, self.sharding.state, self.sharding.devices)

    def memory_per_core(self) -> dict[str, int]:
        """Bytes each core holds: its share of the weights and of the KV cache."""
        split = self.sharding is not None and self.sharding.state is not None
        cache = sum(t.numel() * t.element_size() for t in self.compiled.states)
        return {"weights": self.weight_bytes or 0,
                "kv_cache": cache // self.tensor_parallel_size if split else cache}

    @property
    def slots(self) -> int:
        return self.buckets.max_num_seqs

    @property
    def max_model_len(self) -> int:
        return self.buckets.max_model_len

    def load_to(self, device) -> "GenerationModel":
        """A copy of every compiled model on ``device`` (another core), with its own empty cache there.

        Call it from the thread that will drive the copy (torch-xla replays an executable on
        the calling thread's device).
        """
        if self.sharding is not None:
            raise RuntimeError("a tensor-parallel model is one program over its group of cores; another group runs "
                               "in a process of its own, with its own compile")
        states = self.compiled.states
        cache = DeviceState([f"shared_state_buffer[{i}]" for i in range(len(states))],
                            [torch.zeros_like(t, device="cpu") for t in states], device)
        buckets = [_bucket_on(b, device, cache) for b in self.compiled.buckets]
        copy = GenerationModel(CompiledModel(buckets, kernel=self.compiled.kernel), self.buckets, self.vocab_size,
                               weight_bytes=self.weight_bytes, source=self._source)
        copy.draft = self.draft.load_to(device) if self.draft is not None else None
        return copy

    def warm_up(self) -> None:
        """Run every compiled model once, then empty the cache: a bucket's first call costs more than the next
        ones (a 300-token prompt and 20 decode steps: 20.8 against 16.1 ms on XLA:CPU), which a request should
        never wait for."""
        for shape, bucket in zip(self.shapes, self.compiled.buckets):
            outputs = bucket.run_flat(list(_example(shape)))
            outputs[1].cpu()  # the greedy tokens: the call has run
        self.reset()
        if self.draft is not None:
            self.draft.move(0, 0)
            self.draft.warm_up()

    def reset(self) -> None:
        """Empty the cache (every slot), on the core."""
        self.compiled.load_states([torch.zeros_like(t, device="cpu") for t in self.compiled.states])
        self._split_cache()

    def _run(self, shape: Shape, tokens, positions, slots, last) -> "StepOutput":
        outputs = self.compiled.buckets[self._index[shape]].run_flat([tokens, positions, slots, last])
        return StepOutput(outputs[0], outputs[1])

    def rows_bucket(self, rows: int) -> int:
        """The decode bucket (sequences) that ``rows`` rows run in."""
        return self.buckets.decode_rows[min(bisect.bisect_left(self.buckets.decode_rows, rows),
                                            len(self.buckets.decode_rows) - 1)]

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src`` of the cache over slot ``dst``, on the core (every layer's keys and values)."""
        self.compiled.copy_state_row(src, dst)

    def prefill_shape(self, length: int) -> Shape:
        lengths = self.buckets.prefill
        i = bisect.bisect_left(lengths, length)
        if i == len(lengths):
            raise InvalidInput(f"a prompt of {length} tokens is longer than the largest prefill bucket ({lengths[-1]}).")
        return Shape("prefill", 1, lengths[i], lengths[i])

    @property
    def decode_steps(self) -> int:
        """Greedy steps a multi-step decode call runs (1: none compiled)."""
        return self.buckets.decode_steps

    def decode_shape(self, rows: int, context: int, steps: int = 1) -> Shape:
        b = bisect.bisect_left(self.buckets.decode_rows, rows)
        c = bisect.bisect_left(self.buckets.decode_context, context)
        if b == len(self.buckets.decode_rows) or c == len(self.buckets.decode_context):
            raise InvalidInput(f"no decode bucket holds {rows} sequences at {context} positions.")
        return Shape("decode", self.buckets.decode_rows[b], 1, self.buckets.decode_context[c], steps)

    def prefill(self, prompt: Sequence[int], slot: int) -> tuple["StepOutput", Shape]:
        """Write ``prompt`` (token ids) into ``slot``; the output at its last token (one row) and the bucket run."""
        shape = self.prefill_shape(len(prompt))
        tokens = torch.zeros(1, shape.tokens, dtype=torch.long)
        tokens[0, :len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
        positions = torch.arange(shape.tokens)[None]
        last = torch.tensor([[len(prompt) - 1]])
        return self._run(shape, tokens, positions, torch.tensor([slot]), last).rows(torch.tensor([0])), shape

    def extend_shape(self, tokens: int, length: int) -> Shape:
        """The extend bucket of ``tokens`` new tokens in a sequence of ``length`` tokens (prefix and them)."""
        for t, c in self.buckets.extend:  # context-major, then suffix length: the first that holds both is smallest
            if t >= tokens and c >= length:
                return Shape("extend", 1, t, c)
        raise InvalidInput(f"no extend bucket takes {tokens} tokens at {length} positions.")

    def extend(self, prompt: Sequence[int], slot: int, cached: int) -> tuple["StepOutput", Shape]:
        """Write ``prompt[cached:]`` into ``slot``, whose cache already holds ``prompt[:cached]``; the output at the
        prompt's last token and the bucket run. The bucket's padding repeats the last token at its position, so
        it writes what that token writes, and nothing past the prompt."""
        rest = len(prompt) - cached
        shape = self.extend_shape(rest, len(prompt))
        tokens = torch.full((1, shape.tokens), int(prompt[-1]), dtype=torch.long)
        tokens[0, :rest] = torch.as_tensor(prompt[cached:], dtype=torch.long)
        positions = torch.full((1, shape.tokens), len(prompt) - 1, dtype=torch.long)
        positions[0, :rest] = torch.arange(cached, len(prompt))
        last = torch.tensor([[rest - 1]])
        return self._run(shape, tokens, positions, torch.tensor([slot]), last).rows(torch.tensor([0])), shape

    def prefill_scored(self, prompt: Sequence[int], slot: int) -> tuple["StepOutput", Shape, torch.Tensor]:
        """:meth:`prefill`, also returning the logits at every prompt position (len(prompt), vocab) on the host.

        Its own compiled model per prompt-length bucket, compiled the first time a prompt of
        that bucket asks (a few seconds; the engine's other sequences wait for it once), so a
        model whose requests never ask compiles and runs nothing more.
        """
        shape = self.prefill_shape(len(prompt))
        bucket = self._scored.get(shape.tokens)
        if bucket is None:
            bucket = self._scored[shape.tokens] = self._compile_scored(shape)
        tokens = torch.zeros(1, shape.tokens, dtype=torch.long)
        tokens[0, :len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
        last = torch.tensor([[len(prompt) - 1]])
        logits, greedy = bucket.run_flat([tokens, torch.arange(shape.tokens)[None], torch.tensor([slot]), last])[:2]
        every = logits.cpu()[0, :len(prompt)]
        return StepOutput(every[-1:], greedy).rows(torch.tensor([0])), shape, every

    def _compile_scored(self, shape: Shape) -> Bucket:
        if self._source is None:
            raise InvalidInput("prompt logprobs (echo with logprobs, prompt_logprobs) need the model's prefill that keeps "
                               "every position's logits, compiled from the transformers model; this engine was loaded "
                               "from an artifact without it. Serve the model.yaml with model.pretrained or "
                               "model.factory.")
        lm, target, compiler_args = self._source
        model = SlotLM(lm, self.buckets.max_num_seqs, self.buckets.max_model_len, every_position=True).eval()
        with grouped_for_compile(lm), spmd.sharded(self.sharding):
            bucket = trace_bucket_on_state(model, model.aliases(), _example(shape), self.compiled.buckets[0].state,
                                           target=target, compiler_args=compiler_args)
        return bucket

    def verify(self, rows: Sequence[Sequence[int]], positions: Sequence[int], slots: Sequence[int]) \
            -> tuple["StepOutput", Shape]:
        """Each running sequence's last token and its proposals (``rows[i]``, at most k + 1 tokens, from
        ``positions[i]`` on) in one call; the output of every position: greedy (rows, k + 1), logits (rows, k + 1,
        vocab). A row's padding repeats its last token at its position, writing what that token writes; a free
        slot's row writes token 0 at the last position only."""
        width = self.buckets.speculative_tokens + 1
        ends = [p + len(r) for r, p in zip(rows, positions)]
        shape = self.decode_shape(max(slots) + 1, max(ends), 1)
        shape = Shape("verify", shape.rows, width, shape.context)
        tokens_t = torch.zeros(shape.rows, width, dtype=torch.long)
        positions_t = torch.full((shape.rows, width), self.max_model_len - 1, dtype=torch.long)
        for slot, row, start in zip(slots, rows, positions):
            n = len(row)
            tokens_t[slot, :n] = torch.as_tensor(row, dtype=torch.long)
            tokens_t[slot, n:] = row[-1]
            positions_t[slot, :n] = torch.arange(start, start + n)
            positions_t[slot, n:] = start + n - 1
        index = torch.as_tensor(slots, dtype=torch.long)
        last = torch.zeros(shape.rows, 1, dtype=torch.long)
        rows_t = torch.arange(shape.rows, dtype=torch.long)
        return self._run(shape, tokens_t, positions_t, rows_t, last).rows(index), shape

    def decode(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int],
               steps: int = 1) -> tuple["StepOutput", Shape]:
        """One token for each running sequence (its last token, at its position, in its slot).

        Row r of the call is slot r, so the call covers slots 0 to the highest running one;
        a free slot among them gets token 0 at the last positions (it writes only at
        max_model_len - steps to max_model_len - 1, which no cached prefix holds). Returns the output of each sequence, in the order given,
        and the bucket run. ``steps`` > 1 (``decode_steps``) runs that many greedy steps:
        each row's greedy output is its next ``steps`` tokens, written at the positions after.
        """
        if steps not in (1, self.decode_steps):
            raise InvalidInput(f"decode runs 1 or decode_steps ({self.decode_steps}) steps a call, not {steps}.")
        shape = self.decode_shape(max(slots) + 1, max(positions) + steps, steps)
        tokens_t = torch.zeros(shape.rows, 1, dtype=torch.long)
        positions_t = torch.full((shape.rows, 1), self.max_model_len - steps, dtype=torch.long)
        index = torch.as_tensor(slots, dtype=torch.long)
        tokens_t[index, 0] = torch.as_tensor(tokens, dtype=torch.long)
        positions_t[index, 0] = torch.as_tensor(positions, dtype=torch.long)
        rows = torch.arange(shape.rows, dtype=torch.long)
        last = torch.zeros(shape.rows, 1, dtype=torch.long)
        return self._run(shape, tokens_t, positions_t, rows, last).rows(index), shape


def _bucket_on(bucket: Bucket, device, cache: DeviceState) -> Bucket:
    """``bucket`` with its accelerator subgraphs compiled for ``device`` and ``cache`` as its state."""
    gm = bucket.graph_module
    accel = {p.name for p in bucket.partitions if not p.on_cpu}
    modules = {name: module.load_to(device) if name in accel else module for name, module in gm.named_children()}
    copy = Bucket(torch.fx.GraphModule(modules, gm.graph), in_spec=bucket.in_spec, out_spec=bucket.out_spec,
                  input_shapes=bucket.input_shapes, output_shapes=bucket.output_shapes,
                  output_dtypes=bucket.output_dtypes, partitions=bucket.partitions, report=bucket.report,
                  target=bucket.target, stage_inputs=bucket.stage_inputs, batch_size=bucket.batch_size)
    copy.state, copy.aliases = cache, bucket.aliases
    return copy


def compile_generation(lm: torch.nn.Module, buckets: GenerationBuckets, *, target: str = "neuron",
                       compiler_args: str | list[str] | None = None,
                       compiler_workdir: str | None = None, tensor_parallel_size: int = 1,
                       name: str | None = None) -> GenerationModel:
    """Compile ``lm`` (a transformers causal LM) for generation under ``buckets``; see the module docstring.

    ``name`` names the model in the progress lines (default: its class, ``LlamaForCausalLM``).

    ``tensor_parallel_size`` N above 1 compiles each model once for a group of N cores (SPMD,
    split by the model's tensor-parallel plan): this process's cores must be that group."""
    if not hasattr(lm, "config") or not hasattr(lm.config, "num_hidden_layers"):
        raise ConfigError(f"generation needs a transformers causal LM (a PreTrainedModel with a config); got "
                          f"{type(lm).__name__}.")
    lm = lm.eval()
    plan = None
    if tensor_parallel_size > 1:
        tensor_parallel.check(lm.config, tensor_parallel_size)
        spmd.start_spmd(tensor_parallel_size)
        plan = tensor_parallel.plan(lm, tensor_parallel_size)
    shapes = shapes_of(buckets)
    cache = SlotLM(lm, buckets.max_num_seqs, buckets.max_model_len)
    shared = [torch.zeros_like(t) for t in cache.caches()]
    del cache

    def func(context: int | None, steps: int, extend: bool = False, verify: bool = False) -> tuple[SlotLM, dict]:
        model = SlotLM(lm, buckets.max_num_seqs, buckets.max_model_len, context, steps, every_position=verify,
                       extend=extend).eval()
        return model, model.aliases()

    def kernel(inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        tokens, positions = inputs[0], inputs[1]
        kind = "prefill" if tokens.shape[1] > 1 else "decode"
        if kind == "prefill" and tokens.shape[0] > 1:
            kind = "verify"  # several rows of several tokens: proposals
        elif kind == "prefill" and int(positions[:, 0].max()) > 0:
            kind = "extend"  # after a cached prefix
        context = int(positions.max()) + 1
        for i, shape in enumerate(shapes):  # one token per call: the engine runs multi-step shapes itself
            if shape.kind == kind and shape.rows == tokens.shape[0] and shape.tokens == tokens.shape[1] \
                    and context <= shape.context and shape.steps == 1:
                return inputs, torch.tensor(i)
        raise InvalidInput(f"no generation bucket takes {tuple(tokens.shape)} tokens at {context} positions.")

    config = BucketModelConfig(lambda: kernel, shared_state_buffer=shared,
                               func_kwargs=[{"context": s.context if s.kind != "prefill" else None, "steps": s.steps,
                                             "extend": s.kind == "extend", "verify": s.kind == "verify"}
                                            for s in shapes])
    name = name or type(lm).__name__
    try:
        with grouped_for_compile(lm), spmd.sharded(plan), \
                progress.reporting(progress.BuildProgress(name, len(shapes), labels=[s.label for s in shapes])):
            compiled = bucket_model_trace(func, [_example(s) for s in shapes], config, compiler_workdir,
                                          compiler_args, target=target)
    except UnsupportedModelError as exc:
        # The operator list stands; the usual hint (partition onto CPU) does not apply around the cache.
        listed = str(exc).rsplit("\nPass partitioner_config", 1)[0]
        raise UnsupportedModelError(f"{listed}\n{NO_CPU_PARTITIONS}") from None
    vocab = int(lm.get_output_embeddings().weight.shape[0])
    return GenerationModel(compiled, buckets, vocab, plan, tensor_parallel.bytes_per_core(lm, plan),
                           source=(lm, target, compiler_args))
