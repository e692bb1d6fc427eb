"""A small ResNet from public model code (transformers), random weights."""

import torch
from transformers import ResNetConfig, ResNetForImageClassification


def build(num_labels=10, seed=0):
    torch.manual_seed(seed)
    config = ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32, 64, 128],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        num_labels=num_labels,
    )
    return ResNetForImageClassification(config).eval()
