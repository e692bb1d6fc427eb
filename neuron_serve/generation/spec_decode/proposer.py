"""Speculative decoding: proposals for each running sequence; the verify call (runner/calls.py) and what
each sequence takes (core/states.py) follow the rule below.

Each round, a sequence gets up to k proposed tokens; one verify call runs its last token
and the proposals through the model at once, and the core chooses the model's token at
every position as a decode step would (argmax, or sampled from the row's stream with the
counter of that token). A sequence takes the proposals while each equals the model's own
choice there, then the model's choice at the first mismatch (or after the last proposal):
one to k + 1 tokens a round, exactly the tokens it would have had one step at a time. For
a sampled sequence that is speculative sampling's rule with a certain proposal: a
proposal d is taken with probability p(d), and on a rejection the token drawn is
distributed as p with d removed (Leviathan et al., 2023; Chen et al., 2023), here with
the same seed giving the same tokens whether or not the round proposed them.

Sequences whose tokens need the host (penalties, a logit bias, logprobs, a grammar,
tokens under ``min_tokens``) get no proposals and take one token from the call's first
position, as a decode step gives it.

The n-gram proposer (vLLM's ``method: ngram``, prompt lookup decoding) copies the tokens
that followed the latest earlier occurrence of the sequence's last n tokens, for n from
``prompt_lookup_max`` down to ``prompt_lookup_min``: repetitive text (code edits,
extraction, summaries quoting their input) is proposed for free. A draft model
(``method: draft_model``) proposes its own greedy tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ...errors import InvalidInput
from ..sample.sampling import SamplingParams

if TYPE_CHECKING:
    from ...config.generation import SpeculativeConfig
    from ..runner.executor import Executor
    from ..core.request import Sequence as Seq


def ngram_proposals(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix of ``tokens`` (of
    ``lookup_max`` down to ``lookup_min`` tokens) found earlier; none when no suffix repeats.

    Of several occurrences, the latest one followed by k known tokens: in a loop of period
    shorter than k the latest occurrence is followed by less than a period of tokens, an
    earlier one by the whole k."""
    array = np.asarray(tokens, dtype=np.int64)
    length = len(array)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(array[:length - 1], n)  # not the suffix itself
        hits = np.flatnonzero((windows == array[length - n:]).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= length]
            start = int(full[-1] if len(full) else hits[0]) + n
            return array[start:start + k].tolist()
    return []


def speculable(params: SamplingParams, generated: int) -> bool:
    """Whether a sequence's next tokens may be proposed: its tokens need nothing of the host."""
    return not params.on_host(generated)


class Proposer:
    """One engine's proposals each round (n-gram or draft); the runner's verify call takes them (runner/calls.py)."""

    def __init__(self, config: SpeculativeConfig, executor: Executor) -> None:
        if executor.speculative_tokens != config.num_speculative_tokens:
            raise InvalidInput(f"speculative_config.num_speculative_tokens is {config.num_speculative_tokens} "
                               f"but the model's verify calls take {executor.speculative_tokens} proposals; compile "
                               f"it with the same generation.speculative_config.")
        self.config = config
        self.executor = executor

    def propose(self, running: list[Seq]) -> list[list[int]]:
        """Each running sequence's proposals this round (none for one that cannot take them, or has no room)."""
        config, executor, limit = self.config, self.executor, self.executor.max_model_len
        k = config.num_speculative_tokens
        drafted = None
        if executor.has_draft:
            # The draft runs k + 1 greedy steps for every running sequence (its k proposals, and the last one fed
            # too); with no room for them, one step, which feeds the last token and proposes nothing.
            steps = k + 1 if max(s.position for s in running) + k + 1 <= limit else 1
            drafted = executor.draft([s.output[-1] for s in running], [s.position for s in running],
                                     [s.slot for s in running], steps)
            k = min(k, steps - 1)
        proposals = []
        for i, seq in enumerate(running):
            room = min(k, limit - 1 - seq.position)
            if seq.params.max_tokens is not None:  # a round adds up to one more than it proposes
                room = min(room, seq.params.max_tokens - len(seq.output) - 1)
            if room <= 0 or not speculable(seq.params, len(seq.output)):
                proposals.append([])
            elif drafted is not None:
                proposals.append(list(drafted[i][:room]))
            else:
                proposals.append(ngram_proposals(seq.prompt + seq.output, room, config.prompt_lookup_min,
                                                 config.prompt_lookup_max))
        return proposals

    def wanted(self, proposals: list[list[int]]) -> bool:
        """Whether this round verifies: some sequence has proposals, or a draft fed every sequence's last token
        (only a round that takes what the draft fed keeps the draft's cache whole)."""
        return any(proposals) or self.executor.has_draft
