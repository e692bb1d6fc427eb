"""The executor: one core group's compiled models and KV cache, behind the calls an engine makes.

As vLLM's v1 splits an engine from its executor and workers, the engine here keeps the
request lifecycle and the scheduler, and hands each model call to an :class:`Executor`:
prefill prompts into their slots, decode one token (or ``decode_steps``) for the running
slots, copy a slot over another. :class:`CoreGroupExecutor` runs them on one core
(tensor_parallel_size 1) or, as one SPMD program, on a group of cores whose weights
and cache are split by the model's tensor-parallel plan (``tensor_parallel.py``). The
engine never sees which: outputs are the same tokens and logits either way.

A call returns as soon as the core has it: its :class:`~.output.StepOutput` holds the
outputs on the core, and reading its tokens waits for them. What the engine does
between the two (handing the last step's events to their requests) overlaps the
computation, with no side channel.
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

from ...targets.pjrt import use_device
from .model import GenerationModel
from .output import StepOutput
from .shapes import Shape
from ..sample.sampler import GREEDY, RowChoice


class Executor(abc.ABC):
    """The model calls of one core group (see the module docstring)."""

    slots: int
    max_model_len: int
    vocab_size: int
    decode_steps: int
    tensor_parallel_size: int
    prefix_caching: bool
    speculative_tokens: int
    has_draft: bool
    chunks: list[int]  # chunk lengths of the mixed models (chunked prefill; empty: none)

    @abc.abstractmethod
    def start(self) -> None:
        """Prepare the calling thread to drive the cores; the engine's thread calls it once, first."""

    @abc.abstractmethod
    def prefill(self, prompt: Sequence[int], slot: int, choice: RowChoice = GREEDY) -> tuple[StepOutput, Shape]:
        """Write ``prompt`` into ``slot``; the output at its last token (chosen as ``choice`` says) and the
        bucket run."""

    @abc.abstractmethod
    def prefill_many(self, prompts: Sequence[Sequence[int]], slots: Sequence[int],
                     choices: Sequence[RowChoice]) -> tuple[StepOutput, Shape]:
        """Write each prompt into its slot in one call; the output at each one's last token, in the order given."""

    @abc.abstractmethod
    def prefill_rows(self, length: int) -> list[int]:
        """The prompt counts a prefill call takes with prompts of at most ``length`` tokens (compiled so far)."""

    @abc.abstractmethod
    def extend(self, prompt: Sequence[int], slot: int, cached: int,
               choice: RowChoice = GREEDY) -> tuple[StepOutput, Shape] | None:
        """Write ``prompt[cached:]`` after the ``cached`` tokens ``slot`` holds (prefix caching); as :meth:`prefill`.
        None while no model that does it is compiled (prefill the whole prompt instead)."""

    @abc.abstractmethod
    def can_score(self, length: int) -> bool:
        """Whether :meth:`prefill_scored` of a ``length``-token prompt can run now; if not, its model is queued
        to compile (InvalidInput if it never can: an artifact loaded without the transformers model)."""

    @abc.abstractmethod
    def prefill_scored(self, prompt: Sequence[int], slot: int,
                       choice: RowChoice = GREEDY) -> tuple[StepOutput, Shape, Any]:
        """:meth:`prefill`, and the logits at every prompt position (len(prompt), vocab) on the host."""

    @abc.abstractmethod
    def decode(self, tokens: Sequence[int] | None, positions: Sequence[int], slots: Sequence[int], steps: int = 1,
               choices: Sequence[RowChoice] | None = None, feed: StepOutput | None = None) -> tuple[StepOutput, Shape]:
        """One token (or ``steps``) for each running sequence, by argmax, or sampled with ``choices``
        (one a sequence); outputs in the order given. With ``feed``, a one-step decode not read yet, each row's
        token is the one it chose for that row's slot, taken on the core (``tokens`` is None)."""

    @abc.abstractmethod
    def verify(self, rows: Sequence[Sequence[int]], positions: Sequence[int], slots: Sequence[int],
               choices: Sequence[RowChoice] | None = None) -> tuple[StepOutput, Shape] | None:
        """Each running sequence's last token and its proposals in one call; every position's output (None
        while no verify model that holds them is compiled)."""

    @abc.abstractmethod
    def mixed(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int], chunk: Sequence[int],
              start: int, slot: int, choices: Sequence[RowChoice] | None = None) -> tuple[StepOutput, Shape]:
        """A decode of each running sequence (as :meth:`decode`, one step) and ``chunk``, prompt tokens from position
        ``start`` of cache slot ``slot``, written in the same call (chunked prefill); outputs in the order given,
        then the chunk's last token's (``choices``: one a row, the chunk's last)."""

    @abc.abstractmethod
    def chunk_capacity(self, rows: int) -> int:
        """The longest chunk a compiled mixed model takes beside ``rows`` decode rows (slots 0..rows-1; 0: none)."""

    @abc.abstractmethod
    def draft(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int],
              steps: int) -> list[list[int]]:
        """A speculative draft's greedy tokens for each running sequence (``steps`` of them, its last token fed at
        its position first); the draft's cache takes what it fed. Its proposals are certain, so the model
        accepts them by its own choice alone (spec_decode/proposer.py)."""

    @abc.abstractmethod
    def move(self, src: int, dst: int) -> None:
        """Copy cache slot ``src`` over slot ``dst``, on the cores."""

    @abc.abstractmethod
    def write_adapter(self, index: int, adapter: Any) -> None:
        """Put a LoRA adapter (``lora.LoraAdapter``; None: zeros) in slot ``index`` of the buffers on the cores."""

    @abc.abstractmethod
    def assign(self, slot: int, adapter: int) -> None:
        """Cache slot ``slot``'s rows run with adapter slot ``adapter`` (0: the base) from the next call on."""

    @abc.abstractmethod
    def rows_bucket(self, rows: int) -> int:
        """The decode bucket (sequences) that ``rows`` rows run in."""

    @property
    def precision(self) -> dict:
        """What the weights and the cache hold (dtype, quantization, kv_cache_dtype: precision.describe)."""
        return dict(getattr(getattr(self, "model", None), "precision", None) or {})

    @abc.abstractmethod
    def memory(self) -> dict[str, int]:
        """Bytes each core of the group holds: ``weights`` and ``kv_cache`` (and ``lora``, its adapter buffers)."""


class CoreGroupExecutor(Executor):
    """``model``'s calls on ``device`` (a core, or the SPMD device of a group of ``model.tensor_parallel_size``)."""

    def __init__(self, model: GenerationModel, device: Any = None) -> None:
        self.model = model
        self.device = device
        self.slots = model.slots
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size
        self.decode_steps = model.decode_steps
        self.tensor_parallel_size = model.tensor_parallel_size
        self.prefix_caching = model.buckets.prefix_caching
        self.speculative_tokens = model.buckets.speculative_tokens
        self.has_draft = model.draft is not None
        self.chunks = list(model.buckets.chunks)

    def start(self) -> None:
        if self.device is not None:
            use_device(self.device)
        # Compile the slot move now, not in the middle of the first step that needs one
        # (slot 0 over itself: the cache is empty and stays so), and give every bucket its first call.
        self.model.move(0, 0)
        self.model.warm_up()

    def prefill(self, prompt: Sequence[int], slot: int, choice: RowChoice = GREEDY) -> tuple[StepOutput, Shape]:
        if self.model.draft is not None:  # the draft's cache holds every prompt too
            self.model.draft.prefill(prompt, slot)
        return self.model.prefill(prompt, slot, choice)

    def prefill_many(self, prompts: Sequence[Sequence[int]], slots: Sequence[int],
                     choices: Sequence[RowChoice]) -> tuple[StepOutput, Shape]:
        if self.model.draft is not None:  # a draft prefills a prompt a call (its buckets are the model's alone)
            for prompt, slot in zip(prompts, slots):
                self.model.draft.prefill(prompt, slot)
        return self.model.prefill_many(prompts, slots, choices)

    def prefill_rows(self, length: int) -> list[int]:
        return self.model.prefill_rows(length)

    def extend(self, prompt: Sequence[int], slot: int, cached: int,
               choice: RowChoice = GREEDY) -> tuple[StepOutput, Shape] | None:
        return self.model.extend(prompt, slot, cached, choice)

    def can_score(self, length: int) -> bool:
        return self.model.can_score(length)

    def prefill_scored(self, prompt: Sequence[int], slot: int,
                       choice: RowChoice = GREEDY) -> tuple[StepOutput, Shape, Any]:
        if self.model.draft is not None:
            self.model.draft.prefill(prompt, slot)
        return self.model.prefill_scored(prompt, slot, choice)

    def decode(self, tokens: Sequence[int] | None, positions: Sequence[int], slots: Sequence[int], steps: int = 1,
               choices: Sequence[RowChoice] | None = None, feed: StepOutput | None = None) -> tuple[StepOutput, Shape]:
        return self.model.decode(tokens, positions, slots, steps, choices, feed)

    def verify(self, rows: Sequence[Sequence[int]], positions: Sequence[int], slots: Sequence[int],
               choices: Sequence[RowChoice] | None = None) -> tuple[StepOutput, Shape] | None:
        return self.model.verify(rows, positions, slots, choices)

    def mixed(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int], chunk: Sequence[int],
              start: int, slot: int, choices: Sequence[RowChoice] | None = None) -> tuple[StepOutput, Shape]:
        return self.model.mixed(tokens, positions, slots, chunk, start, slot, choices)

    def chunk_capacity(self, rows: int) -> int:
        return self.model.chunk_capacity(rows)

    def draft(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int],
              steps: int) -> list[list[int]]:
        out, _ = self.model.draft.decode(tokens, positions, slots, steps)
        chosen = out.tokens
        return chosen if steps > 1 else [[token] for token in chosen]

    def move(self, src: int, dst: int) -> None:
        self.model.move(src, dst)
        if self.model.draft is not None:
            self.model.draft.move(src, dst)

    def write_adapter(self, index: int, adapter: Any) -> None:
        self.model.write_adapter(index, adapter)

    def assign(self, slot: int, adapter: int) -> None:
        self.model.assign(slot, adapter)

    def rows_bucket(self, rows: int) -> int:
        return self.model.rows_bucket(rows)

    def memory(self) -> dict[str, int]:
        return self.model.memory_per_core()
