"""A tiny Llama-architecture causal LM with random weights, for task: generate examples and tests.

Nothing is downloaded: the architecture comes from transformers, the weights from a seed.
"""

from __future__ import annotations

import torch
import transformers


def build(seed: int = 0, vocab_size: int = 256, max_position_embeddings: int = 128) -> torch.nn.Module:
    """Two layers, grouped-query attention (4 heads, 2 key/value heads), eager attention."""
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_position_embeddings)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
