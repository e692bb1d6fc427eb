"""A small BERT-style transformer encoder from public model code, random weights."""

import torch
from transformers import BertConfig, BertModel


def build(layers=4, hidden=256, heads=4, vocab=1000, max_positions=512, seed=0):
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=max_positions,
        attn_implementation="eager",
    )
    return BertModel(config, add_pooling_layer=True).eval()
