"""A causal LM compiled for generation: prefill and decode models around one KV cache on the core.

``compile_generation`` runs neuron-serve's own pipeline on a transformers causal LM
wrapped in :class:`~neuron_serve.generation.slots.SlotLM`: ``bucket_model_trace``
compiles one prefill model per prompt-length bucket (one row, writing one slot) and two
decode models per (running-sequences bucket x context-length bucket), every one taking
the cache as its ``shared_state_buffer``: one choosing each row's token by argmax, one
by the sampler (``sampler.py``) from each row's parameters, so a decode of greedy rows
pays for no sampling. Analysis and partitioning run for each as for any model, so an
operator the accelerator cannot run around the cache is refused naming it.

:class:`GenerationModel` is what the engine calls: ``prefill`` one prompt into a slot,
``decode`` one token for each of a set of running sequences. Each call leaves the cache and
the logits on the core and brings home one token id a row (and, sampled, whether the
core could choose it); the logits cross only for a row the host chooses for (penalties, a
logit bias, a grammar, logprobs, or a sampled choice the core left to it).
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
from ..targets.pjrt import xla
from . import tensor_parallel
from .attention import grouped_for_compile
from .sampler import GREEDY, RowChoice, row_parameters
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
    steps: int = 1  # decode steps in one call
    # Tokens chosen by the sampler from per-row parameters (every prefill and extend; a decode or verify
    # with a sampled row), else by argmax (a decode or verify of greedy rows only: no sampler to pay for).
    sampled: bool = False

    @property
    def label(self) -> str:
        """The bucket label of metrics and logs: prefill_64, decode_8x256, decode_8x256_steps4_sampled."""
        if self.kind == "prefill":
            return f"prefill_{self.tokens}"
        if self.kind == "extend":
            return f"extend_{self.tokens}x{self.context}"
        sampled = "_sampled" if self.sampled else ""
        if self.kind == "verify":
            return f"verify_{self.rows}x{self.context}_tokens{self.tokens}{sampled}"
        return f"decode_{self.rows}x{self.context}" + (f"_steps{self.steps}" if self.steps > 1 else "") + sampled


def shapes_of(buckets: GenerationBuckets) -> list[Shape]:
    """Every compiled model, in bucket order: prefill buckets, then decode (rows-major), greedy then sampled."""
    shapes = [Shape("prefill", 1, length, length, sampled=True) for length in buckets.prefill]
    decode = [(rows, context) for rows in buckets.decode_rows for context in buckets.decode_context]
    steps = [1, buckets.decode_steps] if buckets.decode_steps > 1 else [1]
    forms = (False, True) if buckets.sampled else (False,)
    for sampled in forms:
        shapes += [Shape("decode", rows, 1, context, k, sampled) for k in steps for rows, context in decode]
    shapes += [Shape("extend", 1, tokens, context, sampled=True) for tokens, context in buckets.extend]
    if buckets.speculative_tokens:
        width = buckets.speculative_tokens + 1
        shapes += [Shape("verify", rows, width, context, sampled=sampled) for sampled in forms
                   for rows, context in decode]
    return shapes


def _example(shape: Shape) -> tuple[torch.Tensor, ...]:
    tokens = torch.zeros(shape.rows, shape.tokens, dtype=torch.long)
    positions = torch.arange(shape.tokens).expand(shape.rows, shape.tokens).contiguous()
    slots = torch.arange(shape.rows, dtype=torch.long)
    last = torch.full((shape.rows, 1), shape.tokens - 1, dtype=torch.long)
    if not shape.sampled:
        return tokens, positions, slots, last
    return (tokens, positions, slots, last, *row_parameters([], shape.rows))


class _Outputs:
    """A call's outputs, on the core until first read; tokens and flags then cross in one transfer."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor, done: torch.Tensor | None) -> None:
        self.logits = logits
        self._on_core = [tokens] if done is None else [tokens, done]
        self._home: list[torch.Tensor] | None = None

    def home(self) -> list[torch.Tensor]:
        """[tokens] or [tokens, done] on the host; the first read waits for the call to finish."""
        if self._home is None:
            moving = [t for t in self._on_core if t.device.type == "xla"]
            fetched = iter(xla()._XLAC._xla_get_cpu_tensors(moving) if moving else [])
            self._home = [next(fetched) if t.device.type == "xla" else t for t in self._on_core]
        return self._home


class StepOutput:
    """One compiled call's rows: the tokens chosen on the core (and, sampled, whether each was), and the
    logits, on the core until asked for."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor, done: torch.Tensor | None = None,
                 index: torch.Tensor | None = None, outputs: _Outputs | None = None) -> None:
        self._outputs = outputs or _Outputs(logits, tokens, done)
        self._index = index

    def rows(self, index: torch.Tensor) -> "StepOutput":
        """The same output, for rows ``index`` only, in that order."""
        return StepOutput(None, None, index=index, outputs=self._outputs)

    @property
    def tokens(self) -> list:
        """Each row's token (a list of each step's, for a call of several steps or positions)."""
        return self._outputs.home()[0][self._index].tolist()

    @property
    def done(self) -> list | None:
        """Whether the core chose each token (as :attr:`tokens`); where not, the host chooses from :attr:`logits`
        (sampler.sample_on_host). None for an argmax call: every token is chosen."""
        home = self._outputs.home()
        return home[1][self._index].tolist() if len(home) > 1 else None

    @property
    def logits(self) -> torch.Tensor:
        """Each row's logits (rows, [steps,] vocab), copied to the host: for penalties, logprobs and the
        choices the core left to the host."""
        return self._outputs.logits.cpu()[self._index]


def _parameters(choices: Sequence[RowChoice], index: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """The sampling parameters of a call of ``rows`` rows: ``choices[i]`` for row ``index[i]``, greedy elsewhere."""
    floats, ints = row_parameters([], rows)
    given = row_parameters(list(choices), len(choices))
    floats[index], ints[index] = given
    return [floats, ints]


def _keep_outputs_on_core(bucket: Bucket, shape: Shape) -> None:
    """Leave the outputs ahead of the caches (logits, tokens, done) of ``bucket``'s compiled call on the core:
    the call then returns as soon as it is launched, and only what is read crosses (StepOutput)."""
    gm = bucket.graph_module
    outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    for node in outputs[:3 if shape.sampled else 2]:
        call, index = (node.args[0], node.args[1]) if node.op == "call_function" else (node, 0)
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
        for shape, bucket in zip(self.shapes, compiled.buckets):
            _keep_outputs_on_core(bucket, shape)
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
            outputs[1].cpu()  # the tokens: the call has run
        self.reset()
        if self.draft is not None:
            self.draft.move(0, 0)
            self.draft.warm_up()

    def reset(self) -> None:
        """Empty the cache (every slot), on the core."""
        self.compiled.load_states([torch.zeros_like(t, device="cpu") for t in self.compiled.states])
        self._split_cache()

    def _run(self, shape: Shape, inputs: list[torch.Tensor]) -> "StepOutput":
        outputs = self.compiled.buckets[self._index[shape]].run_flat(inputs)
        return StepOutput(outputs[0], outputs[1], outputs[2] if shape.sampled else None)

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
        return Shape("prefill", 1, lengths[i], lengths[i], sampled=True)

    @property
    def decode_steps(self) -> int:
        """Steps a multi-step decode call runs (1: none compiled)."""
        return self.buckets.decode_steps

    def decode_shape(self, rows: int, context: int, steps: int = 1, sampled: bool = False) -> Shape:
        b = bisect.bisect_left(self.buckets.decode_rows, rows)
        c = bisect.bisect_left(self.buckets.decode_context, context)
        if b == len(self.buckets.decode_rows) or c == len(self.buckets.decode_context):
            raise InvalidInput(f"no decode bucket holds {rows} sequences at {context} positions.")
        return Shape("decode", self.buckets.decode_rows[b], 1, self.buckets.decode_context[c], steps, sampled)

    def _prompt_inputs(self, shape: Shape, prompt: Sequence[int], choice: RowChoice) -> list[torch.Tensor]:
        tokens = torch.zeros(1, shape.tokens, dtype=torch.long)
        tokens[0, :len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
        positions = torch.arange(shape.tokens)[None]
        last = torch.tensor([[len(prompt) - 1]])
        return [tokens, positions, torch.tensor([0]), last, *row_parameters([choice], 1)]

    def prefill(self, prompt: Sequence[int], slot: int, choice: RowChoice = GREEDY) -> tuple["StepOutput", Shape]:
        """Write ``prompt`` (token ids) into ``slot``; the output at its last token (one row, its token chosen as
        ``choice`` says) and the bucket run."""
        shape = self.prefill_shape(len(prompt))
        inputs = self._prompt_inputs(shape, prompt, choice)
        inputs[2] = torch.tensor([slot])
        return self._run(shape, inputs).rows(torch.tensor([0])), shape

    def extend_shape(self, tokens: int, length: int) -> Shape:
        """The extend bucket of ``tokens`` new tokens in a sequence of ``length`` tokens (prefix and them)."""
        for t, c in self.buckets.extend:  # context-major, then suffix length: the first that holds both is smallest
            if t >= tokens and c >= length:
                return Shape("extend", 1, t, c, sampled=True)
        raise InvalidInput(f"no extend bucket takes {tokens} tokens at {length} positions.")

    def extend(self, prompt: Sequence[int], slot: int, cached: int,
               choice: RowChoice = GREEDY) -> tuple["StepOutput", Shape]:
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
        inputs = [tokens, positions, torch.tensor([slot]), last, *row_parameters([choice], 1)]
        return self._run(shape, inputs).rows(torch.tensor([0])), shape

    def prefill_scored(self, prompt: Sequence[int], slot: int,
                       choice: RowChoice = GREEDY) -> tuple["StepOutput", Shape, torch.Tensor]:
        """:meth:`prefill`, also returning the logits at every prompt position (len(prompt), vocab) on the host.

        Its own compiled model per prompt-length bucket, compiled the first time a prompt of
        that bucket asks (a few seconds; the engine's other sequences wait for it once), so a
        model whose requests never ask compiles and runs nothing more.
        """
        shape = self.prefill_shape(len(prompt))
        bucket = self._scored.get(shape.tokens)
        if bucket is None:
            bucket = self._scored[shape.tokens] = self._compile_scored(shape)
        inputs = self._prompt_inputs(shape, prompt, choice)
        inputs[2] = torch.tensor([slot])
        logits, tokens, done = bucket.run_flat(inputs)[:3]
        every = logits.cpu()[0, :len(prompt)]
        return StepOutput(every[-1:], tokens, done).rows(torch.tensor([0])), shape, every

    def _compile_scored(self, shape: Shape) -> Bucket:
        if self._source is None:
            raise InvalidInput("prompt logprobs (echo with logprobs, prompt_logprobs) need the model's prefill that keeps "
                               "every position's logits, compiled from the transformers model; this engine was loaded "
                               "from an artifact without it. Serve the model.yaml with model.pretrained or "
                               "model.factory.")
        lm, target, compiler_args = self._source
        model = SlotLM(lm, self.buckets.max_num_seqs, self.buckets.max_model_len, every_position=True,
                       sampled=True).eval()
        with grouped_for_compile(lm), spmd.sharded(self.sharding):
            bucket = trace_bucket_on_state(model, model.aliases(), _example(shape), self.compiled.buckets[0].state,
                                           target=target, compiler_args=compiler_args)
        _keep_outputs_on_core(bucket, shape)
        return bucket

    def verify(self, rows: Sequence[Sequence[int]], positions: Sequence[int], slots: Sequence[int],
               choices: Sequence[RowChoice] | None = None) -> tuple["StepOutput", Shape]:
        """Each running sequence's last token and its proposals (``rows[i]``, at most k + 1 tokens, from
        ``positions[i]`` on) in one call; the output of every position: tokens (rows, k + 1), chosen by argmax or,
        with ``choices``, sampled (position j choosing the row's j-th token of the call), logits (rows, k + 1,
        vocab). A row's padding repeats its last token at its position, writing what that token writes; a free
        slot's row writes token 0 at the last position only."""
        width = self.buckets.speculative_tokens + 1
        ends = [p + len(r) for r, p in zip(rows, positions)]
        shape = self.decode_shape(max(slots) + 1, max(ends), 1)
        shape = Shape("verify", shape.rows, width, shape.context, sampled=choices is not None)
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
        inputs = [tokens_t, positions_t, rows_t, last]
        if choices is not None:
            inputs += _parameters(choices, index, shape.rows)
        return self._run(shape, inputs).rows(index), shape

    def decode(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int],
               steps: int = 1, choices: Sequence[RowChoice] | None = None) -> tuple["StepOutput", Shape]:
        """One token for each running sequence (its last token, at its position, in its slot).

        Row r of the call is slot r, so the call covers slots 0 to the highest running one;
        a free slot among them gets token 0 at the last positions (it writes only at
        max_model_len - steps to max_model_len - 1, which no cached prefix holds). Returns the output of each
        sequence, in the order given, and the bucket run. Tokens are argmax, or, with ``choices`` (one per
        sequence), sampled on the core. ``steps`` > 1 (``decode_steps``) runs that many steps: each row's
        tokens are its next ``steps`` tokens, written at the positions after.
        """
        if steps not in (1, self.decode_steps):
            raise InvalidInput(f"decode runs 1 or decode_steps ({self.decode_steps}) steps a call, not {steps}.")
        shape = self.decode_shape(max(slots) + 1, max(positions) + steps, steps, sampled=choices is not None)
        tokens_t = torch.zeros(shape.rows, 1, dtype=torch.long)
        positions_t = torch.full((shape.rows, 1), self.max_model_len - steps, dtype=torch.long)
        index = torch.as_tensor(slots, dtype=torch.long)
        tokens_t[index, 0] = torch.as_tensor(tokens, dtype=torch.long)
        positions_t[index, 0] = torch.as_tensor(positions, dtype=torch.long)
        rows = torch.arange(shape.rows, dtype=torch.long)
        last = torch.zeros(shape.rows, 1, dtype=torch.long)
        inputs = [tokens_t, positions_t, rows, last]
        if choices is not None:
            inputs += _parameters(choices, index, shape.rows)
        return self._run(shape, inputs).rows(index), shape


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

    def func(context: int | None, steps: int, extend: bool = False, verify: bool = False,
             sampled: bool = False) -> tuple[SlotLM, dict]:
        model = SlotLM(lm, buckets.max_num_seqs, buckets.max_model_len, context, steps, every_position=verify,
                       extend=extend, sampled=sampled).eval()
        return model, model.aliases()

    def kernel(inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        tokens, positions = inputs[0], inputs[1]
        kind = "prefill" if tokens.shape[1] > 1 else "decode"
        if kind == "prefill" and tokens.shape[0] > 1:
            kind = "verify"  # several rows of several tokens: proposals
        elif kind == "prefill" and int(positions[:, 0].max()) > 0:
            kind = "extend"  # after a cached prefix
        context = int(positions.max()) + 1
        sampled = len(inputs) > 4  # with the sampling parameters
        for i, shape in enumerate(shapes):  # one token per call: the engine runs multi-step shapes itself
            if shape.kind == kind and shape.rows == tokens.shape[0] and shape.tokens == tokens.shape[1] \
                    and context <= shape.context and shape.steps == 1 and shape.sampled == sampled:
                return inputs, torch.tensor(i)
        raise InvalidInput(f"no generation bucket takes {tuple(tokens.shape)} tokens at {context} positions.")

    config = BucketModelConfig(lambda: kernel, shared_state_buffer=shared,
                               func_kwargs=[{"context": s.context if s.kind != "prefill" else None, "steps": s.steps,
                                             "extend": s.kind == "extend", "verify": s.kind == "verify",
                                             "sampled": s.sampled} for s in shapes])
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
