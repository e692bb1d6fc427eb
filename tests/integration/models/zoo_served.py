"""Library models served by tests/integration/test_zoo_serving.py, random weights fixed by a seed.

The same small configs as tests/zoo.py; nothing is downloaded.
"""

import torch


def gpt2(seed: int = 0) -> torch.nn.Module:
    """transformers' GPT-2 with its LM head (2 layers, hidden 32, vocabulary 100), no KV cache."""
    import transformers  # noqa: PLC0415

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, use_cache=False)
    return transformers.GPT2LMHeadModel(config).eval()


def lraspp(seed: int = 0) -> torch.nn.Module:
    """torchvision's LR-ASPP MobileNetV3-Large segmentation model, 3 classes."""
    import torchvision  # noqa: PLC0415

    torch.manual_seed(seed)
    return torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3).eval()


def yolos(seed: int = 0) -> torch.nn.Module:
    """transformers' YOLOS object detector (2 layers, hidden 32, 5 detection tokens, 3 classes)."""
    import transformers  # noqa: PLC0415

    torch.manual_seed(seed)
    config = transformers.YolosConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                      image_size=[32, 32], patch_size=8, num_detection_tokens=5, num_labels=3)
    return transformers.YolosForObjectDetection(config).eval()
