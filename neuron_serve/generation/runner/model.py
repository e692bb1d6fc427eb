"""A causal LM compiled for generation: prefill and decode models around one KV cache on the core.

``compiling.compile_generation`` runs neuron-serve's own pipeline on a transformers causal LM
wrapped in :class:`~neuron_serve.generation.runner.slots.SlotLM`: ``bucket_model_trace``
compiles one prefill model per (prompts x prompt-length) bucket (each row writing its slot) and two
decode models per (running-sequences bucket x context-length bucket), every one taking
the cache as its ``shared_state_buffer``: one choosing each row's token by argmax, one
by the sampler (``sample/sampler.py``) from each row's parameters, so a decode of greedy rows
pays for no sampling. Analysis and partitioning run for each as for any model, so an
operator the accelerator cannot run around the cache is refused naming it.

:class:`GenerationModel` is what the engine calls: ``prefill_many`` prompts into their slots,
``decode`` one token for each of a set of running sequences. Each call leaves the cache and
the logits on the core and brings home one token id a row (and, sampled, whether the
core could choose it); the logits cross only for a row the host chooses for (penalties, a
logit bias, a grammar, logprobs, or a sampled choice the core left to it).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from ...buckets.generation import GenerationBuckets
from ...compile import sharding as spmd
from ...errors import InvalidInput
from ...model import Bucket, CompiledModel
from ...model.state import DeviceState
from ...targets import xla_state
from ..lora import layers as lora_layers
from ..sample.sampler import GREEDY, RowChoice, row_parameters
from .output import StepOutput
from .shapes import Shape, example_inputs, shapes_of


NO_CPU_PARTITIONS = ("Generation runs every operator on the NeuronCore, where the KV cache lives; replace the operator "
                     "(or serve the model with task: infer).")


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

    ``compiled`` holds the models compiled so far, by shape; more join (:meth:`add`) as ``build``
    (compiling/compile.py) compiles them, and each call runs on the smallest compiled model that holds it.
    With ``sharding`` (tensor parallelism) every model is one program over the group's cores and
    the cache is split as the plan says; ``weight_bytes`` is what one core holds of the weights.
    """

    def __init__(self, state: DeviceState, buckets: GenerationBuckets, vocab_size: int,
                 sharding: spmd.Sharding | None = None, weight_bytes: int | None = None, *,
                 compiled: dict[Shape, Bucket], build=None, lora: lora_layers.Layout | None = None) -> None:
        self.state = state
        # LoRA: the adapter buffers follow the cache in the state; each cache slot's adapter slot (0: the base),
        # passed as each row's input to every call (a decode's row r is cache slot r).
        self.lora = lora
        self.caches = len(state) - (lora.buffers if lora is not None else 0)
        self.slot_adapters = [0] * buckets.max_num_seqs
        self.build = build  # what compiles the models not compiled yet (None: every one is, from an artifact)
        self.buckets = buckets
        self.vocab_size = vocab_size
        self.sharding = sharding
        self.weight_bytes = weight_bytes
        self.draft: GenerationModel | None = None  # a speculative draft's compiled models, beside these
        self.adapter_policy = None  # with LoRA: how engines hold adapters (adapters.AdapterPolicy)
        # What the weights and cache hold: dtype, quantization, kv_cache_dtype (precision.describe; {}: not said)
        self.precision: dict = {}
        self._buckets: dict[Shape, Bucket] = {}
        # The models a switch of buckets dropped (:meth:`rebucket`): no call is planned on them, but one planned
        # just before the switch still finds its model; let go at the next switch.
        self._retired: dict[Shape, Bucket] = {}
        for shape, bucket in compiled.items():
            self.add(shape, bucket)
        self._split_cache()

    def add(self, shape: Shape, bucket: Bucket) -> None:
        """Serve ``shape`` from now on (a model compiled after the engine started); safe beside a running engine:
        its thread sees the model or does not, never half of it."""
        _keep_outputs_on_core(bucket, shape)
        self._buckets = {**self._buckets, shape: bucket}

    def rebucket(self, buckets: GenerationBuckets, dropped: Sequence[Shape]) -> None:
        """Serve under ``buckets`` from now on, ``dropped``'s models no longer (their replacements have joined);
        safe beside a running engine, as :meth:`add`."""
        current = self._buckets
        self._retired = {s: current[s] for s in dropped if s in current}
        self._buckets = {s: b for s, b in current.items() if s not in self._retired}
        self.buckets = buckets

    def has(self, shape: Shape) -> bool:
        return shape in self._buckets

    def bucket(self, shape: Shape) -> Bucket:
        """The compiled model of ``shape`` (KeyError while it is not compiled)."""
        found = self._buckets.get(shape)
        return found if found is not None else self._retired[shape]

    @property
    def shapes(self) -> list[Shape]:
        """The models compiled so far, in bucket order (prefill, decode, extend, verify; then on-demand ones)."""
        planned = shapes_of(self.buckets)
        return [s for s in planned if s in self._buckets] + [s for s in self._buckets if s not in planned]

    @property
    def compiled(self) -> CompiledModel:
        """The compiled models, in :attr:`shapes` order, as one CompiledModel (for saving and inspection)."""
        return CompiledModel([self._buckets[s] for s in self.shapes])

    @property
    def tensor_parallel_size(self) -> int:
        """Cores one call spans (1: one core)."""
        return self.sharding.devices if self.sharding is not None else 1

    def _split_cache(self) -> None:
        """Lay the cache out over the group as the plan says (after it was written from the host); the LoRA
        buffers stay whole on every core."""
        if self.sharding is not None:
            for tensor in self.state.tensors[:self.caches]:
                spmd.mark(tensor, self.sharding.state, self.sharding.devices)

    def held_weights(self) -> dict[str, Any]:
        """The weights every compiled model takes, by name, as held on this model's core (or group): one device
        tensor each, shared by all of them (compile/core_weights.py)."""
        held: dict[str, Any] = {}
        for bucket in {**self._buckets, **self._retired}.values():
            held.update(bucket.held_weights())
        return held

    def _subgraphs(self) -> list:
        """Every compiled model's executables that take the weights as inputs."""
        return [m for b in {**self._buckets, **self._retired}.values() for m in b.graph_module.children()
                if getattr(m, "held_weights", None)]

    def replace_weights(self, state: dict[str, torch.Tensor]) -> int:
        """Hand every compiled model the weights of ``state`` (by the names they take them: slots.weights_of of a
        model of the same architecture, dtype and quantization); nothing is compiled, every compiled model shares
        the new copy on the core, and the next call runs on it. Refuses (ConfigError naming the weight) a state
        whose names, shapes or dtypes differ. The tensors are held as given: they must not change afterwards.
        Returns how many weights were replaced."""
        from ...assembly.weights import check_state_dict  # noqa: PLC0415

        subgraphs = self._subgraphs()
        current: dict[str, torch.Tensor] = {}
        for sub in subgraphs:
            current.update(sub.weights)
        check_state_dict(current, {name: state[name] for name in current if name in state})
        for sub in subgraphs:
            sub.set_weights(state)
        return len(current)

    def memory_per_core(self) -> dict[str, int]:
        """Bytes each core holds: its share of the weights (as held, once for every compiled model) and of the KV
        cache, and the LoRA buffers."""
        split = self.sharding is not None and self.sharding.state is not None
        cache = sum(t.numel() * t.element_size() for t in self.state.tensors[:self.caches])
        unique = {id(w): w for w in self.held_weights().values()}
        weights = sum(w.share for w in unique.values()) if unique else self.weight_bytes or 0
        held = {"weights": weights, "kv_cache": cache // self.tensor_parallel_size if split else cache}
        if self.lora is not None:
            held["lora"] = sum(t.numel() * t.element_size() for t in self.state.tensors[self.caches:])
        return held

    # -- LoRA ------------------------------------------------------------------------------

    def write_adapter(self, index: int, adapter: lora_layers.LoraAdapter | None) -> None:
        """Put ``adapter`` (None: zeros) in slot ``index`` of the buffers, on the core: no compile after the first."""
        self.state.write_row(index, lora_layers.slot_values(self.lora, adapter), start=self.caches)

    def assign(self, slot: int, adapter: int) -> None:
        """Cache slot ``slot``'s rows run with adapter slot ``adapter`` (0: the base) from the next call on."""
        self.slot_adapters[slot] = adapter

    def _adapters(self, slots: Sequence[int]) -> list[torch.Tensor]:
        """The adapter-slot input of rows on cache slots ``slots`` (nothing without LoRA)."""
        if self.lora is None:
            return []
        return [torch.tensor([self.slot_adapters[s] for s in slots], dtype=torch.long)]

    @property
    def slots(self) -> int:
        return self.buckets.max_num_seqs

    @property
    def max_model_len(self) -> int:
        return self.buckets.max_model_len

    def bucket_on(self, bucket: Bucket) -> Bucket:
        """``bucket`` (compiled for another core) compiled for this model's core, around this model's cache."""
        return _bucket_on(bucket, self.state.device, self.state)

    def load_to(self, device) -> "GenerationModel":
        """A copy of every compiled model on ``device`` (another core), with its own empty cache there.

        Call it with ``device`` the calling thread's default (torch-xla compiles and replays an
        executable on it; the compile queue's thread does, see compiling.py).
        """
        if self.sharding is not None:
            raise RuntimeError("a tensor-parallel model is one program over its group of cores; another group runs "
                               "in a process of its own, with its own compile")
        cache = DeviceState(self.state.names, [torch.zeros_like(t, device="cpu") for t in self.state.tensors], device)
        copy = GenerationModel(cache, self.buckets, self.vocab_size, weight_bytes=self.weight_bytes,
                               compiled={s: _bucket_on(b, device, cache) for s, b in self._buckets.items()},
                               build=self.build, lora=self.lora)
        copy.draft = self.draft.load_to(device) if self.draft is not None else None
        copy.adapter_policy = self.adapter_policy
        copy.precision = self.precision
        return copy

    def warm_up(self) -> None:
        """Run every compiled model once, then empty the cache: a bucket's first call costs more than the next
        ones (a 300-token prompt and 20 decode steps: 20.8 against 16.1 ms on XLA:CPU), which a request should
        never wait for. (A model compiled later is first called by a request: the cache is in use by then.)"""
        for shape, bucket in self._buckets.items():
            outputs = bucket.run_flat(list(example_inputs(shape, self.lora is not None)))
            outputs[1].cpu()  # the tokens: the call has run
        self.reset()
        if self.draft is not None:
            self.draft.move(0, 0)
            self.draft.warm_up()

    def reset(self) -> None:
        """Empty the cache (every slot), on the core."""
        with xla_state.exclusive():  # no other XLA work sees the cache between its load and its layout
            self.state.load([torch.zeros_like(t, device="cpu") for t in self.state.tensors])
            self._split_cache()

    def _run(self, shape: Shape, inputs: list[torch.Tensor]) -> "StepOutput":
        outputs = self.bucket(shape).run_flat(inputs)
        return StepOutput(outputs[0], outputs[1], outputs[2] if shape.sampled else None, sampled=shape.sampled)

    def _smallest(self, kind: str, rows: int, tokens: int, context: int, steps: int = 1,
                  sampled: bool | None = None) -> Shape | None:
        """The compiled model of ``kind`` that holds ``rows`` rows of ``tokens`` at ``context`` positions and
        costs least (fewest rows, then positions, then tokens); None when none does."""
        fits = [s for s in self._buckets if s.kind == kind and s.rows >= rows and s.tokens >= tokens
                and s.context >= context and s.steps == steps and (sampled is None or s.sampled == sampled)]
        return min(fits, key=lambda s: (s.rows, s.context, s.tokens), default=None)

    def rows_bucket(self, rows: int) -> int:
        """The decode bucket (sequences) that ``rows`` rows run in."""
        shape = self._smallest("decode", rows, 1, 1, sampled=False)
        return shape.rows if shape is not None else self.buckets.decode_rows[-1]

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src`` of the cache over slot ``dst``, on the core (every layer's keys and values), and its
        adapter with it."""
        self.state.copy_row(src, dst, self.caches)
        self.slot_adapters[dst] = self.slot_adapters[src]

    def prefill_shape(self, length: int, prompts: int = 1) -> Shape:
        """The compiled prefill of ``prompts`` prompts of at most ``length`` tokens that costs least."""
        if length > self.buckets.prefill[-1]:
            raise InvalidInput(f"a prompt of {length} tokens is longer than the largest prefill bucket "
                               f"({self.buckets.prefill[-1]}).")
        return self._smallest("prefill", prompts, length, length)

    def prefill_rows(self, length: int) -> list[int]:
        """The prompt counts a prefill call takes with prompts of at most ``length`` tokens, as compiled so far."""
        bucket = self.prefill_shape(length).tokens
        return sorted({s.rows for s in self._buckets if s.kind == "prefill" and s.tokens == bucket})

    @property
    def decode_steps(self) -> int:
        """Steps a multi-step decode call runs (1: none compiled)."""
        return self.buckets.decode_steps

    def decode_shape(self, rows: int, context: int, steps: int = 1, sampled: bool = False) -> Shape | None:
        """The compiled decode for ``rows`` rows (slots 0..rows-1) at ``context`` positions; None when none holds
        them in that form (it compiles later: a call then runs one step, or greedy with the host choosing)."""
        return self._smallest("decode", rows, 1, context, steps, sampled)

    def _prompt_inputs(self, shape: Shape, prompt: Sequence[int], slot: int, choice: RowChoice) -> list[torch.Tensor]:
        tokens = torch.zeros(1, shape.tokens, dtype=torch.long)
        tokens[0, :len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
        positions = torch.arange(shape.tokens)[None]
        last = torch.tensor([[len(prompt) - 1]])
        return [tokens, positions, torch.tensor([slot]), last, *row_parameters([choice], 1), *self._adapters([slot])]

    def prefill(self, prompt: Sequence[int], slot: int, choice: RowChoice = GREEDY) -> tuple["StepOutput", Shape]:
        """Write ``prompt`` (token ids) into ``slot``; the output at its last token (one row, its token chosen as
        ``choice`` says) and the bucket run."""
        return self.prefill_many([prompt], [slot], [choice])

    def prefill_many(self, prompts: Sequence[Sequence[int]], slots: Sequence[int],
                     choices: Sequence[RowChoice]) -> tuple["StepOutput", Shape]:
        """Write each prompt into its slot in one call (the smallest compiled prefill that holds them); the output
        at each prompt's last token, in the order given (each token chosen as its ``choices`` entry says), and
        the bucket run. The call's rows past the prompts repeat the first prompt: the same values written at the
        same places of its slot, which leaves the cache as one write does."""
        shape = self.prefill_shape(max(len(p) for p in prompts), len(prompts))
        rows, width = shape.rows, shape.tokens
        every = [*range(len(prompts))] + [0] * (rows - len(prompts))
        tokens = torch.zeros(rows, width, dtype=torch.long)
        for row, i in enumerate(every):
            tokens[row, :len(prompts[i])] = torch.as_tensor(prompts[i], dtype=torch.long)
        positions = torch.arange(width).expand(rows, width).contiguous()
        last = torch.tensor([[len(prompts[i]) - 1] for i in every])
        slot_rows = [slots[i] for i in every]
        inputs = [tokens, positions, torch.tensor(slot_rows), last, *row_parameters([choices[i] for i in every], rows),
                  *self._adapters(slot_rows)]
        return self._run(shape, inputs).rows(torch.arange(len(prompts))), shape

    def extend(self, prompt: Sequence[int], slot: int, cached: int,
               choice: RowChoice = GREEDY) -> tuple["StepOutput", Shape] | None:
        """Write ``prompt[cached:]`` into ``slot``, whose cache already holds ``prompt[:cached]``; the output at the
        prompt's last token and the bucket run (None while no extend model that holds it is compiled: prefill
        the whole prompt instead). The bucket's padding repeats the last token at its position, so it writes
        what that token writes, and nothing past the prompt."""
        rest = len(prompt) - cached
        shape = self._smallest("extend", 1, rest, len(prompt))
        if shape is None:
            return None
        tokens = torch.full((1, shape.tokens), int(prompt[-1]), dtype=torch.long)
        tokens[0, :rest] = torch.as_tensor(prompt[cached:], dtype=torch.long)
        positions = torch.full((1, shape.tokens), len(prompt) - 1, dtype=torch.long)
        positions[0, :rest] = torch.arange(cached, len(prompt))
        last = torch.tensor([[rest - 1]])
        inputs = [tokens, positions, torch.tensor([slot]), last, *row_parameters([choice], 1), *self._adapters([slot])]
        return self._run(shape, inputs).rows(torch.tensor([0])), shape

    def scored_shape(self, length: int) -> Shape:
        """The prefill that keeps every position's logits, for a prompt of ``length`` tokens: one per prefill
        bucket, compiled on demand."""
        self.prefill_shape(length)  # refuses a prompt longer than every bucket
        bucket = next(n for n in self.buckets.prefill if n >= length)
        return Shape("scored", 1, bucket, bucket, sampled=True)

    def can_score(self, length: int) -> bool:
        """Whether the prompt-logprobs prefill of a ``length``-token prompt is compiled; if not, it is queued
        (compiled on demand, on the compile queue: the request waits, the others run)."""
        shape = self.scored_shape(length)
        if self.has(shape):
            return True
        if self.build is None:
            raise InvalidInput("prompt logprobs (echo with logprobs, prompt_logprobs) need the model's prefill that keeps "
                               "every position's logits, compiled from the transformers model; this engine was loaded "
                               "from an artifact without it. Serve the model.yaml with model.pretrained or "
                               "model.factory.")
        self.build.need(shape)
        return False

    def prefill_scored(self, prompt: Sequence[int], slot: int,
                       choice: RowChoice = GREEDY) -> tuple["StepOutput", Shape, torch.Tensor]:
        """:meth:`prefill`, also returning the logits at every prompt position (len(prompt), vocab) on the host;
        its model must be compiled (:meth:`can_score`)."""
        shape = self.scored_shape(len(prompt))
        logits, tokens, done = self._buckets[shape].run_flat(self._prompt_inputs(shape, prompt, slot, choice))[:3]
        every = logits.cpu()[0, :len(prompt)]
        return StepOutput(every[-1:], tokens, done, sampled=True).rows(torch.tensor([0])), shape, every

    def verify(self, rows: Sequence[Sequence[int]], positions: Sequence[int], slots: Sequence[int],
               choices: Sequence[RowChoice] | None = None) -> tuple["StepOutput", Shape] | None:
        """Each running sequence's last token and its proposals (``rows[i]``, at most k + 1 tokens, from
        ``positions[i]`` on) in one call; the output of every position: tokens (rows, k + 1), chosen by argmax or,
        with ``choices``, sampled (position j choosing the row's j-th token of the call), logits (rows, k + 1,
        vocab). None while no verify model that holds them is compiled (the round decodes instead). A row's
        padding repeats its last token at its position, writing what that token writes; a free slot's row
        writes token 0 at the last position only."""
        width = self.buckets.speculative_tokens + 1
        ends = [p + len(r) for r, p in zip(rows, positions)]
        shape = self._smallest("verify", max(slots) + 1, width, max(ends), sampled=choices is not None)
        if shape is None:
            return None
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
        inputs += self._adapters(range(shape.rows))
        return self._run(shape, inputs).rows(index), shape

    def decode(self, tokens: Sequence[int] | None, positions: Sequence[int], slots: Sequence[int],
               steps: int = 1, choices: Sequence[RowChoice] | None = None,
               feed: "StepOutput | None" = None) -> tuple["StepOutput", Shape]:
        """One token for each running sequence (its last token, at its position, in its slot).

        Row r of the call is slot r, so the call covers slots 0 to the highest running one;
        a free slot among them gets token 0 at the last positions (it writes only at
        max_model_len - steps to max_model_len - 1, which no cached prefix holds). Returns the output of each
        sequence, in the order given, and the bucket run. Tokens are argmax, or, with ``choices`` (one per
        sequence), sampled on the core. ``steps`` > 1 (``decode_steps``) runs that many steps: each row's
        tokens are its next ``steps`` tokens, written at the positions after. With ``feed`` (a one-step decode's
        output not read yet) each row's token is the one that call chose for its slot, taken on the core.

        A form not compiled yet runs as one that is: one step a call (the shape returned says how many),
        and without the sampled form, argmax, each sampled row marked not done (the host chooses its
        token from its logits, from the same distribution).
        """
        if steps not in (1, self.decode_steps):
            raise InvalidInput(f"decode runs 1 or decode_steps ({self.decode_steps}) steps a call, not {steps}.")
        rows, sampled = max(slots) + 1, choices is not None
        shape = (self.decode_shape(rows, max(positions) + steps, steps, sampled)
                 or self.decode_shape(rows, max(positions) + 1, 1, sampled)
                 or self.decode_shape(rows, max(positions) + 1, 1, False))
        positions_t = torch.full((shape.rows, 1), self.max_model_len - shape.steps, dtype=torch.long)
        index = torch.as_tensor(slots, dtype=torch.long)
        if feed is not None:  # a free row takes the call before's token for its slot, at its last position
            tokens_t = feed.next_input(shape.rows)
        else:
            tokens_t = torch.zeros(shape.rows, 1, dtype=torch.long)
            tokens_t[index, 0] = torch.as_tensor(tokens, dtype=torch.long)
        positions_t[index, 0] = torch.as_tensor(positions, dtype=torch.long)
        rows_t = torch.arange(shape.rows, dtype=torch.long)
        last = torch.zeros(shape.rows, 1, dtype=torch.long)
        inputs = [tokens_t, positions_t, rows_t, last]
        if shape.sampled:
            inputs += _parameters(choices, index, shape.rows)
        inputs += self._adapters(range(shape.rows))
        out = self._run(shape, inputs)
        if sampled and not shape.sampled:  # the argmax stands for the greedy rows only: the host chooses the others
            out = out.with_done(torch.tensor([c.temperature <= 0 for c in _per_row(choices, index, shape.rows)]))
        return out.rows(index), shape


    def chunk_capacity(self, rows: int) -> int:
        """The longest chunk a compiled mixed model takes beside ``rows`` decode rows (0: none compiled yet)."""
        return max((s.tokens for s in self._buckets if s.kind == "mixed" and s.rows >= rows), default=0)

    def mixed(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int], chunk: Sequence[int],
              start: int, slot: int, choices: Sequence[RowChoice] | None = None) -> tuple["StepOutput", Shape]:
        """One decode step of each running sequence (its last token at its position, row r being slot r) and the
        prompt tokens ``chunk`` written into ``slot`` from position ``start``, in one call (slots.py's mixed form);
        each sequence's output in the order given, then the chunk's last token's. ``choices`` (one a row, the
        chunk's last) sample on the core; without a sampled model compiled, as :meth:`decode` does, argmax and
        the host chooses the sampled rows. A free row writes token 0 at its slot's last position; the chunk's
        padding repeats its last token at its position."""
        rows = max(slots, default=0) + 1
        sampled = choices is not None
        shape = self._smallest("mixed", rows, len(chunk), self.max_model_len, sampled=sampled) \
            or self._smallest("mixed", rows, len(chunk), self.max_model_len, sampled=False)
        rows, width, n = shape.rows, shape.tokens, len(chunk)
        ids = torch.zeros(1, rows + width, dtype=torch.long)
        where = torch.full((1, rows + width), self.max_model_len - 1, dtype=torch.long)
        index = torch.as_tensor(slots, dtype=torch.long)
        ids[0, index] = torch.as_tensor(tokens, dtype=torch.long)
        where[0, index] = torch.as_tensor(positions, dtype=torch.long)
        ids[0, rows:rows + n] = torch.as_tensor(chunk, dtype=torch.long)
        ids[0, rows + n:] = int(chunk[-1])
        where[0, rows:rows + n] = torch.arange(start, start + n)
        where[0, rows + n:] = start + n - 1
        inputs = [ids, where, torch.tensor([slot]), torch.tensor([[n - 1]])]
        index = torch.cat([index, torch.tensor([rows])])  # the chunk's output row comes after the decode rows
        if shape.sampled:
            inputs += _parameters(choices, index, rows + 1)
        inputs += self._adapters([*range(rows), slot])
        out = self._run(shape, inputs)
        if sampled and not shape.sampled:
            out = out.with_done(torch.tensor([c.temperature <= 0 for c in _per_row(choices, index, rows + 1)]))
        return out.rows(index), shape


def _per_row(choices: Sequence[RowChoice], index: torch.Tensor, rows: int) -> list[RowChoice]:
    """``choices[i]`` at row ``index[i]``, greedy elsewhere."""
    every = [GREEDY] * rows
    for choice, row in zip(choices, index.tolist()):
        every[row] = choice
    return every


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

