"""Automatic prefix caching: prompts reuse the keys and values of earlier ones, and greedy output never changes.

Every answer is compared with transformers' own greedy generation of the same prompt
(computed without any cache), and the engine's prefix-cache metrics say how many prompt
tokens were reused: a test that passed without reusing anything would prove nothing.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

import generation_models as gm
from neuron_serve.generation import SamplingParams, engine_for
from neuron_serve.generation.core.prefix_cache import BLOCK, PrefixCache, block_hashes

# decode_steps 2: greedy rows run two steps a call, whose free rows write past any cached block. A sampled row
# is chosen on the host (on_device_sampling: false): the cache is what is tested, not where a row is sampled.
SHAPES = {"max_num_seqs": 4, "max_model_len": 96, "prefill_buckets": [16, 48, 96], "decode_batch_buckets": [1, 4],
          "decode_context_buckets": [48, 96], "decode_steps": 2, "enable_prefix_caching": True,
          "on_device_sampling": False}


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, gm.VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = tokens(40, 0)  # a shared prefix: two whole blocks and a part of a third


@pytest.fixture(scope="module")
def cached():
    lm = gm.build("llama")
    engine = engine_for(lm, name="prefix", **SHAPES)
    yield lm, engine
    engine.close()


def counted(name: str) -> float:
    return REGISTRY.get_sample_value(f"neuron_serve_prefix_cache_{name}_total",
                                     {"model_name": "prefix", "replica": "0"}) or 0.0


def run(engine, prompts: list[list[int]], new: int = 8) -> tuple[list[list[int]], float, float]:
    """Greedy answers to ``prompts`` generated together, and the prompt tokens queried and reused meanwhile."""
    queried, hit = counted("queries"), counted("hits")
    done = engine.generate_batch(prompts, [SamplingParams(max_tokens=new, temperature=0)] * len(prompts))
    return [c.tokens for c in done], counted("queries") - queried, counted("hits") - hit


def test_a_prompt_after_a_shared_prefix_reuses_its_blocks(cached):
    lm, engine = cached
    first, second = SYSTEM + tokens(7, 1), SYSTEM + tokens(12, 2)
    assert run(engine, [first])[0] == [gm.eager_greedy(lm, first, 8)]
    answers, queried, hit = run(engine, [second])
    assert answers == [gm.eager_greedy(lm, second, 8)]
    assert (queried, hit) == (len(second), 2 * BLOCK)  # the third block differs after the prefix's 40 tokens


def test_the_same_prompt_again_computes_only_what_no_whole_block_holds(cached):
    lm, engine = cached
    prompt = tokens(50, 3)
    want = gm.eager_greedy(lm, prompt, 8)
    assert run(engine, [prompt])[0] == [want]
    answers, _, hit = run(engine, [prompt])
    assert answers == [want] and hit == 48
    # A whole-block prompt held whole: its last token is computed again (its logits give the first output).
    whole = tokens(32, 4)
    run(engine, [whole])
    answers, _, hit = run(engine, [whole])
    assert answers == [gm.eager_greedy(lm, whole, 8)] and hit == 31


def test_sequences_in_one_batch_reuse_a_running_sequences_prefix(cached):
    lm, engine = cached
    shared = tokens(40, 5)  # held by no slot yet: the first prompt computes it, the others copy its slot
    prompts = [shared + tokens(5 + i, 10 + i) for i in range(3)]
    answers, _, hit = run(engine, prompts, 10)
    assert answers == [gm.eager_greedy(lm, p, 10) for p in prompts]
    assert hit == 2 * 2 * BLOCK


def test_prompts_admitted_in_one_step_copy_a_prefix_only_once_it_is_written(cached):
    """Short prompts sharing a block fit one step's budget (32 tokens) together: the second and third are admitted
    beside the first, which computes the block; each copies it from the first's slot after that prefill."""
    lm, engine = cached
    shared = tokens(BLOCK, 20)
    prompts = [shared + tokens(4, 21 + i) for i in range(3)]
    answers, _, hit = run(engine, prompts, 10)
    assert answers == [gm.eager_greedy(lm, p, 10) for p in prompts]
    assert hit == 2 * BLOCK


def test_eviction_under_pressure_keeps_every_answer_exact(cached):
    lm, engine = cached
    # Twice as many distinct prompts as slots, in three rounds: cached slots are taken back, least recent first.
    prompts = [tokens(36, 100 + i) for i in range(8)]
    for batch in (prompts[:4], prompts[4:], prompts[:2] + prompts[6:]):
        answers, _, _ = run(engine, batch, 6)
        assert answers == [gm.eager_greedy(lm, p, 6) for p in batch]
    answers, _, hit = run(engine, [prompts[7][:33] + tokens(3, 7)], 6)  # the most recent ones are still held
    assert hit == 2 * BLOCK


def test_a_seeded_sample_is_the_same_with_its_prefix_cached(cached):
    _, engine = cached
    prompt = tokens(45, 6)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=3)
    alone = engine.generate_batch([prompt], [seeded])[0].tokens
    hit = counted("hits")
    again = engine.generate_batch([prompt], [seeded])[0].tokens  # from the cache this time
    assert alone == again and counted("hits") - hit == 32


def test_the_bookkeeping_matches_whole_blocks_checked_token_for_token():
    cache = PrefixCache(limit=64, block=4)
    cache.hold(0, list(range(10)))  # two whole blocks kept: 0..7
    assert cache.tokens[0] == list(range(8)) and len(block_hashes(range(10), 4)) == 2
    assert cache.match(list(range(6)) + [99, 98]) == (0, 4)
    assert cache.match([1, 2, 3, 4, 5]) == (None, 0)
    cache.copy(0, 2)
    assert cache.match(list(range(9)), prefer=[2]) == (2, 8)
    cache.hold(1, list(range(60)) + [1, 2, 3, 4, 5, 6])  # past the limit: only blocks below position 64
    assert len(cache.tokens[1]) == 64
    assert cache.empty_first([0, 1]) == 0  # both cached: the least recently used
    cache.forget(0)
    assert cache.empty_first([0, 1]) == 0 and cache.match(list(range(9)), prefer=[]) in ((1, 8), (2, 8))
