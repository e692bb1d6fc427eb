"""Token choice on the core: greedy, temperature, min-p, top-k and top-p, per row, inside the compiled call.

A sampled decode (and every prefill) ends in :func:`sample`, so a call brings home one
token id, its log-probability and a flag a row, never the logits. Each row's parameters
are tensors (:func:`row_parameters`): greedy and sampled rows share one call.

Randomness is counter-based, as the Neuron stacks' deterministic mode: a row's uniforms
are a hash of (its seed, the index of the token being chosen, a lane), so the same seed
gives the same tokens alone or in any batch, on one core or a tensor-parallel group, in a
decode of one step or several, and whether speculation proposed the token or not.

The distribution is vLLM's: logits / temperature, then min-p (tokens below min_p times the
top probability dropped), then top-k, then top-p over what is left. It is sampled
exactly, with no sort (neuronx-cc has none, and XLA:CPU's top-k takes 200 ms on 32 rows
of a 32k vocabulary) and no pass per token:

- the token is drawn by inverse CDF over blocks of :data:`BLOCK` tokens: the blocks'
  masses, their cumulative sum, then the cumulative sum inside the one block drawn;
- top-k and top-p are rejection tests on :data:`DRAWS` tokens drawn from the distribution
  that min-p (and, for top-k, a bound below the k-th largest logit: the k-th largest block
  maximum) leaves: a draw is kept when fewer than k tokens rank above it, or when the
  tokens above it hold less than top_p of the mass. A draw from a distribution restricted
  by such a test is a draw from the restricted distribution, so the first draw kept is
  exact. A draw is kept with probability at least top_p (top-p), so two draws fail
  together with probability (1 - top_p)^2 or less;
- a row none of whose draws is kept, and a row that asks for top-k and top-p together
  (whose top-p needs the mass of the top k, which needs the k-th largest logit exactly),
  comes back not ``done``: its logits are still on the core, and :func:`sample_on_host`
  chooses its token, exactly, with a uniform of the same stream. A row the host chooses for
  from the start takes :func:`choose_on_host`: the core's algorithm first, so the same seed
  gives the same token either way.

Greedy rows (temperature 0) take their first largest logit, as ``argmax``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 256  # tokens per block of the inverse CDF
DRAWS = 2  # draws tested per row and choice (top-k, top-p)
HOST_LANE = DRAWS  # the lane of the uniform a host choice uses
FLOATS = ("temperature", "top_p", "min_p")  # columns of the float parameters
INTS = ("top_k", "seed", "counter")  # columns of the integer parameters (int32)
_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)  # lowbias32's multipliers, as int32
_LANE_SALT = 0x3C6EF372


@dataclass(frozen=True)
class RowChoice:
    """How one row's token is chosen: vLLM's parameters, its seed and the index of the token chosen."""

    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    seed: int = 0
    counter: int = 0


GREEDY = RowChoice()


def row_parameters(choices: list[RowChoice], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float and int parameter tensors of a call of ``rows`` rows; rows past ``choices`` are greedy."""
    floats = torch.zeros(rows, len(FLOATS), dtype=torch.float32)
    floats[:, 1] = 1.0
    ints = torch.zeros(rows, len(INTS), dtype=torch.int32)
    if choices:
        n = len(choices)
        floats[:n] = torch.tensor([[c.temperature, c.top_p, c.min_p] for c in choices], dtype=torch.float32)
        ints[:n] = torch.tensor([[c.top_k, _int32(c.seed), c.counter] for c in choices], dtype=torch.int32)
    return floats, ints


def _int32(seed: int) -> int:
    """A seed of any size folded to int32 (the stream hashes 32 bits)."""
    seed = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    return seed - (1 << 32) if seed >= 1 << 31 else seed


def _lsr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int32 values. Only a non-negative value is shifted: torch shifts a
    negative one arithmetically, torch-xla rounds it toward zero; the sign bit is put back by hand."""
    return ((x & 0x7FFFFFFF) >> shift) + torch.where(x < 0, 1 << (31 - shift), 0).to(x.dtype)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons): a 32-bit integer hash. Its products wrap in int32, as the hash wants: the
    multipliers are int32 tensors (torch-xla computes a product with a Python int in int64)."""
    m1, m2 = (torch.tensor(m, dtype=torch.int32, device=x.device) for m in (_M1, _M2))
    x = x ^ _lsr(x, 16)
    x = x * m1
    x = x ^ _lsr(x, 15)
    x = x * m2
    return x ^ _lsr(x, 16)


def uniforms(seed: torch.Tensor, counter: torch.Tensor, lanes: int) -> torch.Tensor:
    """(rows, lanes) uniforms in [0, 1), 24 bits each, a function of (seed, counter, lane) only."""
    lane = torch.arange(lanes, dtype=torch.int32, device=seed.device)[None, :]
    hashed = _mix(_mix(_mix(lane + _LANE_SALT) ^ counter[:, None]) ^ seed[:, None])
    return _lsr(hashed, 8).to(torch.float32) * (1.0 / (1 << 24))


def _blocks(vocab: int) -> int:
    return -(-vocab // BLOCK)


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens (rows, draws) drawn by inverse CDF from ``weights`` (rows, blocks * BLOCK), one per uniform."""
    rows, padded = weights.shape
    nb = padded // BLOCK
    blocks = weights.view(rows, nb, BLOCK)
    cum = blocks.sum(-1).cumsum(-1)
    total = cum[:, -1:]
    # u < 1, but u * total may round up to total: stay below it, so the block drawn has mass.
    target = torch.minimum(u * total, total * (1 - 2.0 ** -22))
    block = (cum[:, None, :] <= target[:, :, None]).to(torch.float32).sum(-1).to(torch.int64).clamp(max=nb - 1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum], 1).gather(1, block)
    drawn = blocks.gather(1, block[:, :, None].expand(-1, -1, BLOCK))  # (rows, draws, BLOCK)
    index = torch.arange(BLOCK, device=weights.device)
    upper = (index[:, None] <= index[None, :]).to(drawn.dtype)
    within = drawn @ upper  # the cumulative sum inside the block, as one small matmul
    rest = (target - before)[:, :, None]
    # Rounding may leave ``rest`` past the block's own sum: the last token of the block with mass then.
    last = torch.where(drawn > 0, index, -1).max(-1).values
    place = torch.minimum((within <= rest).to(torch.float32).sum(-1).to(torch.int64), last)
    return block * BLOCK + place


def sample(logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor,
           counter_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token (int64) and whether it is ``done`` (else :func:`sample_on_host` chooses it);
    see the module docstring.

    ``logits`` (rows, vocab); ``floats``/``ints`` as :func:`row_parameters` makes them;
    ``counter_offset`` is added to each row's counter (the later steps of one call)."""
    rows, vocab = logits.shape
    nb = _blocks(vocab)
    scores = logits.float()
    if nb * BLOCK != vocab:
        scores = torch.nn.functional.pad(scores, (0, nb * BLOCK - vocab), value=-math.inf)
    temperature, top_p, min_p = floats[:, 0:1], floats[:, 1:2], floats[:, 2:3]
    top_k, seed = ints[:, 0:1], ints[:, 1]
    counter = ints[:, 2] + counter_offset
    greedy = temperature <= 0
    block_max = scores.view(rows, nb, BLOCK).max(-1).values
    top = block_max.max(-1, keepdim=True).values
    temperature = torch.where(greedy, 1.0, temperature)
    # min-p keeps (logit - top) / T >= log(min_p); top-k what is at or above its bound.
    floor = torch.maximum(top + temperature * torch.log(min_p), _top_k_bound(block_max, top_k))
    weights = torch.where(scores >= floor, torch.exp((scores - top) / temperature), 0.0)
    # A greedy row weighs only its largest logits; its uniform 0 draws the first of them.
    weights = torch.where(greedy, (scores == top).to(weights.dtype), weights)
    u = torch.where(greedy, 0.0, uniforms(seed, counter, DRAWS))
    drawn = _draw(weights, u)
    # One test a draw: top-k rows count the tokens above it, top-p rows weigh them. What the floor
    # dropped lies below every draw, so the weights order the tokens above a draw as the logits do.
    counting = top_k > 0
    measure = torch.where(counting, 1.0, weights)
    limit = torch.where(counting, top_k.to(torch.float32), top_p * weights.sum(-1, keepdim=True))
    tested = (counting | (top_p < 1)) & ~greedy
    drawn_weights = weights.gather(1, drawn)
    kept = [(torch.where(weights > drawn_weights[:, d:d + 1], measure, 0.0).sum(-1, keepdim=True) < limit)
            for d in range(DRAWS)]
    ok = torch.cat(kept, 1) | ~tested
    first = ok.to(torch.float32).argmax(-1)
    token = drawn.gather(1, first[:, None])[:, 0]
    both = counting & (top_p < 1) & ~greedy  # top-k and top-p together: the host's (module docstring)
    return token, ok.any(-1) & ~both[:, 0]


def _top_k_bound(block_max: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """(rows, 1): a value at or below the k-th largest logit (-inf where top_k is 0 or more than the blocks).

    The smallest block maximum with fewer than k block maxima above it: at least k blocks have a
    maximum at or above it (itself and those above, or, with ties, the next one down has k above
    it), so at least k logits are."""
    nb = block_max.shape[1]
    higher = (block_max[:, None, :] > block_max[:, :, None]).to(block_max.dtype)
    above = (higher @ torch.ones(nb, 1, dtype=block_max.dtype, device=block_max.device))[..., 0]  # a matmul: fast
    bound = torch.where(above < top_k.to(torch.float32), block_max, math.inf).min(-1, keepdim=True).values
    return torch.where((top_k > 0) & (top_k <= nb), bound, -math.inf)


def choose_on_host(logits: torch.Tensor, choice: RowChoice) -> int:
    """One row's token chosen on the host from its logits (vocab,), as the core would choose it: :func:`sample`
    run here, then :func:`sample_on_host` if it leaves the row undone. A seed so gives the same token whichever
    side chose it (a sampled call not compiled yet, a row whose logits the host adjusted first)."""
    token, done = sample(logits.float()[None], *row_parameters([choice], 1))
    return int(token[0]) if bool(done[0]) else sample_on_host(logits, choice)


def sample_on_host(logits: torch.Tensor, choice: RowChoice) -> int:
    """One row's token chosen on the host, exactly, from its logits (vocab,): the same distribution as
    :func:`sample`, sorted, with the uniform of lane :data:`HOST_LANE` of the row's stream."""
    scores = logits.float()
    if choice.temperature <= 0:
        return int(scores.argmax())
    probs = torch.softmax(scores / choice.temperature, dim=-1)
    if choice.min_p > 0:
        probs = torch.where(probs >= choice.min_p * probs.max(), probs, 0.0)
    ordered, order = torch.sort(probs, descending=True, stable=True)
    if 0 < choice.top_k < len(ordered):
        ordered[choice.top_k:] = 0.0
    if choice.top_p < 1:
        # Keep a token while the tokens before it hold less than top_p of what is left.
        before = ordered.cumsum(-1) - ordered
        ordered = torch.where(before < choice.top_p * ordered.sum(), ordered, 0.0)
    cum = ordered.cumsum(-1)
    u = float(uniforms(torch.tensor([_int32(choice.seed)], dtype=torch.int32),
                       torch.tensor([choice.counter], dtype=torch.int32), HOST_LANE + 1)[0, HOST_LANE])
    place = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])]), right=True)[0])
    place = min(place, int((ordered > 0).nonzero().max()))
    return int(order[place])
