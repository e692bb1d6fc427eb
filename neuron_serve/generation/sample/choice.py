"""Each running sequence's tokens from a compiled call: the core's choice, or the host's where it must.

A call chooses every row's token on the core (``sampler.py``): by argmax when every row
is greedy, else sampled from each row's parameters. A row whose next token needs more than
its logits (``SamplingParams.on_host``: penalties, a bias, ``min_tokens``, a grammar,
logprobs) is chosen here from its logits (``sampling.sample_row``), and so is a sampled
row the core left undone (a rejection test that failed, or top-k with top-p). The logits
cross to the host only when some row of the call needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence as Seq

from .sampler import GREEDY, RowChoice, choose_on_host, sample_on_host
from .sampling import Sampled, sample_row

if TYPE_CHECKING:
    import torch

    from ..core.request import Sequence
    from ..runner.output import StepOutput


def on_host(seq: Sequence, ahead: int = 0) -> bool:
    """Whether ``seq``'s next token (``ahead`` tokens past its output) is chosen on the host (see the module
    docstring)."""
    return seq.params.on_host(len(seq.output) + ahead)


def for_call(seqs: Seq[Sequence], ahead: int = 0) -> list[RowChoice] | None:
    """Each row's parameters for a sampled call (its token ``ahead`` tokens past its output: 1 for a decode
    launched before the one before it is read); None when every row takes the argmax (a greedy call). A row the
    host chooses for takes the argmax on the core: cheapest, and unused."""
    if all(seq.params.greedy or on_host(seq, ahead) for seq in seqs):
        return None
    return [GREEDY if on_host(seq, ahead) else seq.params.choice(len(seq.output) + ahead) for seq in seqs]


def host_choice(seq: Sequence, logits: torch.Tensor, eos_token_ids: frozenset[int], ahead: int = 0, undone: bool = False) -> Sampled:
    """``seq``'s token ``ahead`` tokens past its output, chosen on the host from its logits (vocab,): a row
    the core left ``undone`` by the sampler's own rule, any other as the core would have chosen it."""
    if on_host(seq):
        return sample_row(logits, seq.params, seq.prompt, seq.output, eos_token_ids, seq.constraint)
    choice = seq.params.choice(len(seq.output) + ahead)
    return Sampled(sample_on_host(logits, choice) if undone else choose_on_host(logits, choice))


class Taken:
    """The tokens of one call, row by row, with the host's choices where the core's are not final."""

    def __init__(self, seqs: Seq[Sequence], out: StepOutput, eos_token_ids: frozenset[int]) -> None:
        self.seqs = seqs
        self.tokens = out.tokens
        self.done = out.done
        self._sampled_call = out.sampled
        self._out = out
        self._eos = eos_token_ids
        needed = any(on_host(seq) for seq in seqs) or (self.done is not None and not all(_flat(self.done)))
        self._logits = out.logits if needed else None

    def at(self, row: int, position: int | None = None, ahead: int = 0) -> Sampled:
        """Row ``row``'s token (at ``position`` of a call of several steps or positions), ``ahead`` tokens
        past its sequence's output."""
        seq = self.seqs[row]
        token = self.tokens[row] if position is None else self.tokens[row][position]
        done = True if self.done is None else (self.done[row] if position is None else self.done[row][position])
        if done and not on_host(seq):
            return Sampled(int(token))
        logits = self._logits[row] if position is None else self._logits[row][position]
        # Undone by a sampled call: the sampler's host rule; by an argmax call (no sampled one compiled yet): the
        # sampler itself, here.
        return host_choice(seq, logits, self._eos, ahead, undone=self._sampled_call)

    def steps(self, row: int) -> list[Sampled]:
        """Row ``row``'s tokens of a call of several steps, up to the first the host had to choose (the later
        steps were fed the core's, which was not kept)."""
        taken = []
        for step in range(len(self.tokens[row])):
            undone = self.done is not None and not self.done[row][step]
            taken.append(self.at(row, step, ahead=step))
            if undone:
                break
        return taken


def _flat(values: list) -> list:
    return [v for row in values for v in (row if isinstance(row, list) else [row])]
