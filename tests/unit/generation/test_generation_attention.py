"""Grouped-query attention for the compile: the same numbers as transformers' eager attention, used only where it applies."""

from __future__ import annotations

import os

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

import generation_models as gm
from neuron_serve.buckets.generation import GenerationBuckets
from neuron_serve.generation.runner import attention
from neuron_serve.generation.compiling.compile import compile_generation
from neuron_serve.targets import pjrt


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("q", [1, 5])
def test_grouped_attention_equals_transformers_eager_attention(q):
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, k, head_dim = 3, 8, 2, 12, 16
    query = torch.randn(batch, heads, q, head_dim, generator=generator)
    key = torch.randn(batch, kv_heads, k, head_dim, generator=generator)
    value = torch.randn(batch, kv_heads, k, head_dim, generator=generator)
    visible = torch.arange(k)[None, None, None, :] <= torch.randint(0, k, (batch, 1, q, 1), generator=generator)
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)
    module = _Module(heads // kv_heads).eval()
    want, _ = eager_attention_forward(module, query, key, value, mask, scaling=head_dim ** -0.5)
    got, _ = attention.grouped_attention(module, query, key, value, mask, scaling=head_dim ** -0.5)
    assert got.shape == want.shape == (batch, q, heads, head_dim)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("tokens", "kv_heads"), [(256, 2), (300, 2), (300, 8)])
def test_a_prefill_in_causal_blocks_equals_transformers_eager_attention(tokens, kv_heads):
    # 300 is not a multiple of the 4 blocks: the last block takes the rest. 8 key/value heads: no grouping.
    generator = torch.Generator().manual_seed(1)
    batch, heads, head_dim = 1, 8, 16
    query = torch.randn(batch, heads, tokens, head_dim, generator=generator)
    key = torch.randn(batch, kv_heads, tokens, head_dim, generator=generator)
    value = torch.randn(batch, kv_heads, tokens, head_dim, generator=generator)
    visible = torch.arange(tokens)[None, :] <= torch.arange(tokens)[:, None]
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]
    module = _Module(heads // kv_heads).eval()
    want, _ = eager_attention_forward(module, query, key, value, mask, scaling=head_dim ** -0.5)
    got, _ = attention.grouped_attention(module, query, key, value, mask, scaling=head_dim ** -0.5,
                                         prefill_blocks=attention.PREFILL_BLOCKS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_long_compiled_prefill_attends_in_blocks_and_gives_transformers_logits(monkeypatch):
    # As in a replica's engine process: one XLA:CPU thread per core.
    monkeypatch.setattr(pjrt, "_pool_threads", int(os.environ.get("CPU_NUM_DEVICES", "1")))
    assert attention.prefill_blocks() == attention.PREFILL_BLOCKS
    blocks, grouped = [], attention.grouped_attention

    def counted(*args, **kwargs):
        blocks.append((args[1].shape[2], kwargs.get("prefill_blocks", 0)))
        return grouped(*args, **kwargs)

    monkeypatch.setattr(attention, "grouped_attention", counted)
    lm = gm.build("llama", max_position_embeddings=320)
    model = compile_generation(lm, GenerationBuckets.build(1, 320, prefill=[64, 320], decode_rows=[1],
                                                           decode_context=[320]))
    # The 320-token prefill attends in blocks; the 64-token one and the decode as they were.
    assert set(blocks) == {(320, attention.PREFILL_BLOCKS), (64, attention.PREFILL_BLOCKS), (1, 0)}
    prompt = torch.randint(1, gm.VOCAB, (290,), generator=torch.Generator().manual_seed(2)).tolist()
    out, shape = model.prefill(prompt, 0)
    assert shape.tokens == 320
    with torch.no_grad():
        want = lm(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], want, rtol=1e-4, atol=1e-4)


def test_it_applies_to_llama_family_models_only():
    assert [arch for arch in sorted(gm.CONFIGS) if attention.applies(gm.build(arch))] == ["llama", "mistral", "qwen2", "qwen3"]


def test_the_compile_attends_grouped_then_leaves_the_models_own_attention_as_it_was(monkeypatch):
    calls, grouped = [], attention.grouped_attention

    def counted(*args, **kwargs):
        calls.append(args[1].shape)  # the query
        return grouped(*args, **kwargs)

    monkeypatch.setattr(attention, "grouped_attention", counted)
    lm = gm.build("llama")
    compile_generation(lm, GenerationBuckets.build(2, 16, prefill=[16], decode_rows=[2], decode_context=[16]))
    # Both layers of the prefill (16 tokens) and the decode (1 token) models were traced through it.
    assert {shape[2] for shape in calls} == {16, 1}
    assert lm.config._attn_implementation == "eager"


def test_grouped_attention_refuses_dropout():
    query, key = torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match="eval mode only; got dropout=0.1"):
        attention.grouped_attention(_Module(2), query, key, key, None, scaling=1.0, dropout=0.1)


def test_cores_sharing_every_cpu_attend_whole(monkeypatch):
    monkeypatch.setattr(pjrt, "_pool_threads", int(os.environ.get("CPU_NUM_DEVICES", "1")) + 1)
    assert attention.prefill_blocks() == 0
