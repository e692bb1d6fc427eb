"""A small decoder with a KV cache as state, bucketed by sequence length (input_output_aliases).

The cache of every layer is a buffer of the module; ``forward(tokens, start)`` writes
the keys and values of ``tokens`` (at positions ``start``, ``start + 1``, ...) into it
and returns ``(logits, k_0, v_0, k_1, v_1, ...)``, the new caches. Traced with
``input_output_aliases={model.k_0: 1, ...}`` the caches stay on the core and are
updated in place after every call; run eagerly, :func:`eager_step` writes them back.

The cache is written with a one-hot matrix product rather than an indexed scatter, so
every operator runs on the accelerator, and a position past the cache (padding of a
long prompt) writes nothing. Attention masks every cache position after the query's,
so what padding wrote is never read before a later token overwrites it.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import torch
import torch.nn.functional as F

VOCAB = 40
DIM = 16
HEADS = 2
LAYERS = 2
MAX_LEN = 48
BUCKETS = [1, 4, 8]  # sequence lengths: 1 for each generated token, 4 and 8 for prompts


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x, k_cache, v_cache, write, visible):
        batch, length, dim = x.shape
        head_dim = dim // self.heads
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
        q, k, v = (t.reshape(batch, length, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        # write: (length, max_len) one-hot of each token's position; keep what no token overwrites.
        kept = 1.0 - write.sum(0)[None, None, :, None]
        k_cache = k_cache * kept + torch.matmul(write.t(), k)
        v_cache = v_cache * kept + torch.matmul(write.t(), v)
        scores = torch.matmul(q, k_cache.transpose(-1, -2)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~visible, -1e9)
        attended = torch.matmul(F.softmax(scores, dim=-1), v_cache)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x)), k_cache, v_cache


class KVDecoder(torch.nn.Module):
    """Token ids (1, L) and the position of the first (1,) in; logits (1, L, VOCAB) and new caches out."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, layers: int = LAYERS,
                 max_len: int = MAX_LEN, cache_len: int | None = None) -> None:
        super().__init__()
        # cache_len: positions the caches hold (max_len by default); a shorter cache sees
        # the first cache_len positions of a max_len one (see sliced_cache_preprocessor).
        self.max_len = cache_len or max_len
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Embedding(max_len, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)
        for i in range(layers):
            self.register_buffer(f"k_{i}", torch.zeros(1, heads, self.max_len, dim // heads))
            self.register_buffer(f"v_{i}", torch.zeros(1, heads, self.max_len, dim // heads))

    def caches(self) -> list[torch.Tensor]:
        """The cache buffers in output order: k_0, v_0, k_1, v_1, ..."""
        return [getattr(self, f"{kind}_{i}") for i in range(len(self.blocks)) for kind in ("k", "v")]

    def aliases(self) -> dict:
        """input_output_aliases: each cache is updated from its output (output 0 is the logits)."""
        return {cache: 1 + i for i, cache in enumerate(self.caches())}

    def forward(self, tokens: torch.Tensor, start: torch.Tensor):
        length = tokens.shape[1]
        positions = start + torch.arange(length)
        slots = torch.arange(self.max_len)
        write = (positions[:, None] == slots[None, :]).float()
        visible = slots[None, :] <= positions[:, None]
        x = self.embed(tokens) + self.position(positions.clamp(max=self.position.num_embeddings - 1))[None]
        caches = self.caches()
        new = []
        for i, block in enumerate(self.blocks):
            x, k, v = block(x, caches[2 * i], caches[2 * i + 1], write, visible)
            new += [k, v]
        return (self.head(self.norm(x)), *new)


def build(seed: int = 0, cache_len: int | None = None) -> KVDecoder:
    torch.manual_seed(seed)
    return KVDecoder(cache_len=cache_len).eval()


def bucket_model(seed: int = 0) -> tuple[KVDecoder, dict]:
    """bucket_model_trace's ``func``: the model and its input_output_aliases."""
    model = build(seed)
    return model, model.aliases()


def sequence_bucket_kernel(inputs: List[torch.Tensor]) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Pad the tokens (inputs[0], dim 1) to the smallest bucket that holds them; the position passes through."""
    tokens, start = inputs[0], inputs[1]
    length = tokens.shape[1]
    for index, size in enumerate(BUCKETS):
        if length <= size:
            padded = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], size - length)], dim=1)
            return [padded, start], torch.tensor(index)
    raise ValueError(f"a prompt of {length} tokens is longer than the largest bucket ({BUCKETS[-1]})")


# Buckets by (tokens, cache positions) for one MAX_LEN cache shared through a preprocessor:
# an 8-token prompt into the first 16 positions, then one token at a time with 16 or 32
# (each bucket model sees only its first positions of the shared cache).
CONTEXT_BUCKETS = [(8, 16), (1, 16), (1, 32)]


def sliced_bucket_model(bucket: int, seed: int = 0) -> tuple[KVDecoder, dict]:
    """bucket_model_trace's ``func`` (func_kwargs=[{"bucket": i}, ...]): caches of the bucket's length."""
    model = build(seed, cache_len=CONTEXT_BUCKETS[bucket][1])
    return model, model.aliases()


@torch.jit.script
def context_bucket_kernel(inputs: List[torch.Tensor]) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """A prompt (up to 8 tokens at position 0) goes to bucket 0; one token (before position 32) to the
    shortest cache holding its position."""
    tokens, start = inputs[0], inputs[1]
    length = tokens.shape[1]
    if length > 1:
        padded = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], 8 - length)], dim=1)
        return [padded, start], torch.tensor(0)
    if int(start[0]) < 16:
        return [tokens, start], torch.tensor(1)
    if int(start[0]) < 32:
        return [tokens, start], torch.tensor(2)
    raise ValueError("position past the largest context bucket (32)")


@torch.jit.script
def sliced_cache_preprocessor(shapes: List[List[int]], state: List[torch.Tensor],
                              bucket: torch.Tensor) -> List[torch.Tensor]:
    """shared_state_buffer_preprocessor: each MAX_LEN cache cut to the bucket's first positions (views)."""
    lengths = [16, 16, 32]  # CONTEXT_BUCKETS' cache lengths
    length = lengths[int(bucket)]
    return [cache[:, :, :length] for cache in state]


def context_example_inputs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One example per CONTEXT_BUCKETS entry: (tokens (1, n), start (1,))."""
    return [(torch.zeros(1, n, dtype=torch.long), torch.zeros(1, dtype=torch.long)) for n, _ in CONTEXT_BUCKETS]


def example_inputs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One example per bucket: (tokens (1, size), start (1,))."""
    return [(torch.zeros(1, size, dtype=torch.long), torch.zeros(1, dtype=torch.long)) for size in BUCKETS]


def eager_step(model: KVDecoder, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """One eager call with the same cache semantics as the traced model: the new caches are written back."""
    with torch.no_grad():
        logits, *caches = model(tokens, torch.tensor([start]))
        for buffer, value in zip(model.caches(), caches):
            buffer.copy_(value)
    return logits


def traced_step(traced):
    """A generation step of a traced decoder: its logits for ``tokens`` at ``start``."""
    return lambda tokens, start: traced(tokens, torch.tensor([start]))[0]


def reset_caches(traced) -> None:
    """Empty the KV caches a traced decoder keeps on the core."""
    traced.load_states([torch.zeros_like(c) for c in build().caches()])


def generate(step, prompt: torch.Tensor, new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy generation: ``step(tokens, start) -> logits``; returns the tokens and each step's last logits."""
    logits = step(prompt, 0)[:, prompt.shape[1] - 1]
    tokens, scores = [], [logits]
    position = prompt.shape[1]
    for _ in range(new_tokens):
        token = int(logits.argmax(-1))
        tokens.append(token)
        logits = step(torch.tensor([[token]]), position)[:, 0]
        scores.append(logits)
        position += 1
    return tokens, scores
