"""The runner: each call of an engine step's plan (core/plan.py) made on the executor, its tokens chosen.

The runner turns a call and its requests into the executor's inputs (tokens, positions, slots,
each row's sampling choice), makes the call, runs ``overlap`` once the core has it (the step
before's events go out while it computes), and returns what came back as a :class:`CallOutput`:
the tokens each row takes (choice.py: the core's, or the host's where it must), the bucket that
ran and the real and padded sizes. It changes no request: states.py applies the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ..sample import choice
from ..core.plan import Admit, Chunk, Move
from ..core.request import Sequence
from ..sample.sampler import GREEDY
from ..sample.sampling import Sampled, prompt_logprobs

if TYPE_CHECKING:
    from .executor import Executor
    from .output import StepOutput
    from .shapes import Shape
    from ..spec_decode.proposer import Proposer


@dataclass
class CallOutput:
    """What one call gave: per row the tokens it takes (a decode of several steps or a verify round: several;
    an empty list for a row that takes none), the bucket run, and (family, real size, bucket size) of each
    dimension padded."""

    tokens: list[list[Sampled]]
    shape: Shape
    used: list[tuple[str, int, int]] = field(default_factory=list)
    proposals: list[list[int]] | None = None  # a verify round's proposals, row by row
    prompt_logprobs: list | None = None  # a scored prefill's
    core: list | None = None  # a decode's: the token the core chose for each row (before any host choice)


@dataclass
class Launched:
    """A decode the core has, its tokens not read yet: its rows (in order), output and bucket."""

    rows: list[Sequence]
    out: StepOutput
    shape: Shape


class Runner:
    """Calls on one core group's executor; ``proposer`` with speculative decoding."""

    def __init__(self, executor: Executor, eos_token_ids: frozenset[int], adapters: bool,
                 proposer: Proposer | None = None) -> None:
        self.executor = executor
        self.eos_token_ids = eos_token_ids
        self.adapters = adapters
        self.proposer = proposer

    def admit(self, call: Admit) -> None:
        """A running sequence's cached prefix copied into the admitted prompt's slot, its adapter set."""
        if call.copy_from is not None:
            self.executor.move(call.copy_from, call.slot)
        if self.adapters:
            self.executor.assign(call.slot, call.adapter_slot)

    def move(self, call: Move) -> None:
        self.executor.move(call.src, call.dst)

    def prefill(self, seq: Sequence, scored: bool, cached: int, overlap: Callable[[], None]) -> CallOutput:
        """``seq``'s prompt written whole into its slot (after the ``cached`` tokens it holds) and its first token
        (none when its prompt's logprobs were all it asked for)."""
        core_choice = choice.for_call([seq])
        row = core_choice[0] if core_choice is not None else GREEDY
        scores = None
        if scored:  # a prefill that also brings home every prompt position's logits
            out, shape, logits = self.executor.prefill_scored(seq.prompt, seq.slot, row)
            scores = [None if s is None else (s.logprob, s.top) for s in
                      prompt_logprobs(seq.prompt, logits, seq.params.prompt_logprobs)]
        else:
            # A prompt whose prefix the slot holds computes only the rest, once its extend model is compiled.
            extended = self.executor.extend(seq.prompt, seq.slot, cached, row) if cached else None
            out, shape = extended or self.executor.prefill(seq.prompt, seq.slot, row)
        overlap()
        used = [("prefill", len(seq.prompt) - (cached if shape.kind == "extend" else 0), shape.tokens)]
        first = [] if scored and seq.params.max_tokens == 0 else \
            [choice.Taken([seq], out, self.eos_token_ids).at(0)]
        return CallOutput([first], shape, used, prompt_logprobs=scores)

    def prefill_batch(self, seqs: list[Sequence], overlap: Callable[[], None]) -> CallOutput:
        """Each of ``seqs``' prompts written whole into its slot, in one call, and each one's first token."""
        choices = choice.for_call(seqs) or [GREEDY] * len(seqs)
        out, shape = self.executor.prefill_many([s.prompt for s in seqs], [s.slot for s in seqs], choices)
        overlap()
        taken = choice.Taken(seqs, out, self.eos_token_ids)
        used = [("prefill", len(s.prompt), shape.tokens) for s in seqs]
        return CallOutput([[taken.at(i)] for i in range(len(seqs))], shape, used)

    def decode(self, rows: list[Sequence], steps: int, overlap: Callable[[], None]) -> CallOutput:
        """One call for every running row: a verify round when proposals are wanted (and its model compiled), else
        a decode of ``steps`` tokens a row."""
        proposals = self.proposer.propose(rows) if self.proposer is not None else None
        if proposals is not None and self.proposer.wanted(proposals):
            verified = self._verify(rows, proposals, overlap)
            if verified is not None:
                return verified
        return self.take(self.launch(rows, steps, overlap))

    def launch(self, rows: list[Sequence], steps: int, overlap: Callable[[], None],
               after: Launched | None = None) -> Launched:
        """A decode of ``steps`` tokens a row, launched and not read. ``after``, a one-step decode of the same rows
        (or more) not read yet: each row's token is the one that call chose, fed on the core, at the position
        after (the host's state is a token behind, so each row's choice is for its token after the next)."""
        slots = [s.slot for s in rows]
        if after is None:
            out, shape = self.executor.decode([s.output[-1] for s in rows], [s.position for s in rows], slots, steps,
                                              choice.for_call(rows))
        else:
            out, shape = self.executor.decode(None, [s.position + 1 for s in rows], slots, steps,
                                              choice.for_call(rows, ahead=1), feed=after.out)
        overlap()
        return Launched(rows, out, shape)

    def take(self, launched: Launched, rows: list[Sequence] | None = None) -> CallOutput:
        """A launched decode's tokens, read (its first read waits for the core), for ``rows`` of its rows (default:
        all); ``core`` says which token the core chose for each (what a decode launched after it was fed)."""
        rows = launched.rows if rows is None else rows
        out, shape = launched.out, launched.shape
        if len(rows) != len(launched.rows):  # a decode's output row r is slot r's
            out = out.rows(torch.as_tensor([s.slot for s in rows], dtype=torch.long))
        taken = choice.Taken(rows, out, self.eos_token_ids)
        tokens = [taken.steps(i) if shape.steps > 1 else [taken.at(i)] for i in range(len(rows))]
        return CallOutput(tokens, shape, _decode_used(rows, shape, shape.steps), core=taken.tokens)

    def _verify(self, rows: list[Sequence], proposals: list[list[int]],
                overlap: Callable[[], None]) -> CallOutput | None:
        """One verify call: each row takes its proposals while each equals the model's own choice there, then the
        model's choice (spec_decode/proposer.py). None while no verify model that holds them is compiled."""
        called = self.executor.verify([[s.output[-1], *p] for s, p in zip(rows, proposals)],
                                      [s.position for s in rows], [s.slot for s in rows], choice.for_call(rows))
        if called is None:
            return None
        out, shape = called
        overlap()
        taken = choice.Taken(rows, out, self.eos_token_ids)
        every = []
        for i, proposed in enumerate(proposals):
            tokens = []
            for j, proposal in enumerate([*proposed, None]):
                model = taken.at(i, j, ahead=j)
                tokens.append(model)
                if model.token != proposal:  # the model's own choice ends the round (after the last proposal too)
                    break
            every.append(tokens)
        return CallOutput(every, shape, _decode_used(rows, shape, max(len(p) for p in proposals) + 1),
                          proposals=proposals)

    def mixed(self, rows: list[Sequence], seq: Sequence, chunk: Chunk, overlap: Callable[[], None]) -> CallOutput:
        """One mixed call: every row's next token and ``chunk`` of ``seq``'s prompt written into its slot; a chunk
        that ends the prompt gives its first token (the last row)."""
        every = [*rows, seq]
        out, shape = self.executor.mixed([s.output[-1] for s in rows], [s.position for s in rows],
                                         [s.slot for s in rows], seq.prompt[chunk.start:chunk.start + chunk.length],
                                         chunk.start, seq.slot, choice.for_call(every))
        overlap()
        used = [("decode_rows", len(rows), shape.rows), ("chunk", chunk.length, shape.tokens)]
        taken = choice.Taken(every, out, self.eos_token_ids)
        tokens = [[taken.at(i)] for i in range(len(rows))] + [[taken.at(len(rows))] if chunk.last else []]
        return CallOutput(tokens, shape, used)


def _decode_used(rows: list[Sequence], shape: Shape, tokens: int) -> list[tuple[str, int, int]]:
    """A decode or verify call's padded dimensions: its rows, and the positions its longest row attends over (it
    writes ``tokens`` a row) against its context bucket."""
    return [("decode_rows", len(rows), shape.rows),
            ("decode_context", max(s.position for s in rows) + tokens, shape.context)]
