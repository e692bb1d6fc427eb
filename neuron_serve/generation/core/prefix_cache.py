"""Automatic prefix caching over the KV cache's slots: which slot holds which prompt prefix.

Tokens are hashed in blocks of ``BLOCK`` as vLLM hashes them: a block's hash covers its
tokens and its parent block's hash, so one hash names a whole prefix. The cache stays
where it is computed: a sequence owns one contiguous slot, and a slot keeps its keys
and values after its sequence ends, until a new sequence takes the slot (the least
recently used cached slot goes first, after every empty one). A new prompt whose leading
blocks a slot holds is prefilled from there: in that slot itself when it is free (no copy
at all), or, when a running sequence holds them (a shared system prompt among sequences
running together), in a free slot that first gets a copy of that slot on the core. Only
its remaining tokens are computed. A match is checked token for token, so a hash
collision can cost a hit, never a wrong answer. With LoRA a prefix is held under its adapter
(``key``: the base's None, or the adapter as loaded): the same tokens under another adapter
are other keys and values, and never match.

What a slot holds: its sequence's prompt from the prefill on, and at its end the prompt
and output whose keys and values were written (every token but the last), in whole
blocks, short of the slot's last positions, where decode calls park their free rows.

This is bookkeeping only; the engine makes the calls (copy, extend) the scheduler plans.
"""

from __future__ import annotations

import itertools
from typing import Hashable, Sequence

BLOCK = 16  # tokens a hash covers (vLLM's default block size)


def block_hashes(tokens: Sequence[int], block: int = BLOCK, key: Hashable = None) -> list[int]:
    """The chained hash of each whole block of ``tokens`` (computed under ``key``: the first block's parent)."""
    hashes, parent = [], key
    for start in range(0, len(tokens) - block + 1, block):
        parent = hash((parent, tuple(tokens[start:start + block])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    """The blocks each slot of one engine's cache holds (see the module docstring).

    ``limit`` is the last position a cached block may reach (exclusive): decode calls write
    their free rows at the positions after it.
    """

    def __init__(self, limit: int, block: int = BLOCK) -> None:
        self.block = block
        self.limit = limit
        self.tokens: dict[int, list[int]] = {}  # slot -> the tokens its cache holds (whole blocks)
        self._hashes: dict[int, list[int]] = {}  # slot -> its blocks' hashes
        self._index: dict[int, set[int]] = {}  # block hash -> slots holding it
        self._used: dict[int, int] = {}  # slot -> when it was last written or hit
        self._keys: dict[int, Hashable] = {}  # slot -> the adapter its tokens were computed under (None: the base)
        self._clock = itertools.count()

    def match(self, prompt: Sequence[int], prefer: Sequence[int] = (), key: Hashable = None) -> tuple[int | None, int]:
        """(slot, tokens) of the longest cached prefix of ``prompt`` under ``key`` (None, 0 without one); a prompt
        held whole leaves its last token to compute, whose logits the first output token needs. Of slots holding
        as much, one in ``prefer`` (the free ones: no copy needed) is chosen."""
        best: tuple[int | None, int] = (None, 0)
        preferred = set(prefer)
        for slot in self.holders(prompt, key):
            cached = self._common(slot, prompt)
            if cached > best[1] or (cached == best[1] and cached and slot in preferred and best[0] not in preferred):
                best = (slot, cached)
        if best[1] == 0:
            return None, 0
        self.touch(best[0])
        return best

    def holders(self, prompt: Sequence[int], key: Hashable = None) -> list[int]:
        """The slots holding the longest run of ``prompt``'s leading blocks (under ``key``) that any slot holds."""
        found: set[int] = set()
        for h in block_hashes(prompt, self.block, key):
            slots = self._index.get(h)
            if not slots:
                break
            found = set(slots)
        return sorted(slot for slot in found if self._keys.get(slot) == key)

    def _common(self, slot: int, prompt: Sequence[int]) -> int:
        """Tokens of ``prompt`` that ``slot`` holds, in whole blocks, checked token for token; at most all but one."""
        held = self.tokens.get(slot, [])
        n = min(len(held), len(prompt))
        same = 0
        while same < n and held[same] == prompt[same]:
            same += 1
        same -= same % self.block
        return min(same, len(prompt) - 1)

    def hold(self, slot: int, tokens: Sequence[int], key: Hashable = None) -> None:
        """``slot``'s cache now holds ``tokens``, computed under ``key`` (whatever it held before is gone)."""
        self.forget(slot)
        usable = min(len(tokens), self.limit)
        usable -= usable % self.block
        if usable == 0:
            return
        self.tokens[slot] = list(tokens[:usable])
        self._keys[slot] = key
        self._hashes[slot] = block_hashes(self.tokens[slot], self.block, key)
        for h in self._hashes[slot]:
            self._index.setdefault(h, set()).add(slot)
        self.touch(slot)

    def copy(self, src: int, dst: int) -> None:
        """``dst`` got a copy of ``src``'s cache."""
        self.hold(dst, self.tokens.get(src, []), self._keys.get(src))

    def forget(self, slot: int) -> None:
        for h in self._hashes.pop(slot, ()):
            holders = self._index.get(h)
            if holders is not None:
                holders.discard(slot)
                if not holders:
                    del self._index[h]
        self.tokens.pop(slot, None)
        self._used.pop(slot, None)
        self._keys.pop(slot, None)

    def touch(self, slot: int) -> None:
        self._used[slot] = next(self._clock)

    def empty_first(self, free: Sequence[int]) -> int:
        """Of the ``free`` slots, the one to give a sequence that reuses none: the lowest empty slot, else the
        least recently used."""
        empty = [slot for slot in free if slot not in self.tokens]
        if empty:
            return min(empty)
        return min(free, key=lambda slot: self._used.get(slot, -1))
