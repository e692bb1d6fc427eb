"""The model zoo: real architectures from transformers, torchvision and timm.

Each entry builds the library's own model class from a small config with random
weights (nothing is downloaded) and example inputs with batch 2. Where a model's
forward takes keyword-only inputs or returns values that are not per-example (CLIP's
image-text similarity matrix), a thin wrapper passes the inputs by keyword or picks
the per-example outputs; the model's code is never replaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

VOCAB = 100
BATCH = 2


@dataclass(frozen=True)
class Entry:
    name: str  # the matrix's id, e.g. "transformers/gpt2"
    kind: str  # encoder, decoder, vision, ... (the zoo table's column, docs/reference/zoo.md)
    build: Callable[[], tuple[torch.nn.Module, tuple]]
    fails_at: str | None = None  # for models that cannot be captured: the construct trace() must name


def _ids(seq: int = 8, batch: int = BATCH) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq))


def _text(model: torch.nn.Module) -> tuple[torch.nn.Module, tuple]:
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return model.eval(), (ids, mask)


class KeywordInputs(torch.nn.Module):
    """Calls ``model(**dict(zip(names, args)), **fixed)``: trace() passes inputs by position."""

    def __init__(self, model: torch.nn.Module, names: list[str], **fixed) -> None:
        super().__init__()
        self.model, self.names, self.fixed = model, names, fixed

    def forward(self, *args):
        return self.model(**dict(zip(self.names, args)), **self.fixed)


class PerExampleOutputs(torch.nn.Module):
    """Returns only the named outputs of ``model``, those with the batch in dim 0."""

    def __init__(self, model: torch.nn.Module, names: list[str], outputs: list[str]) -> None:
        super().__init__()
        self.model, self.names, self.outputs = model, names, outputs

    def forward(self, *args):
        out = self.model(**dict(zip(self.names, args)))
        return tuple(out[k] for k in self.outputs)


def _tf():
    import transformers  # noqa: PLC0415

    return transformers


def _small(**extra) -> dict:
    return dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                vocab_size=VOCAB, max_position_embeddings=64, **extra)


def bert():
    t = _tf()
    return _text(t.BertModel(t.BertConfig(**_small())))


def distilbert():
    t = _tf()
    return _text(t.DistilBertModel(t.DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=VOCAB,
                                                      max_position_embeddings=64)))


def roberta():
    t = _tf()
    return _text(t.RobertaModel(t.RobertaConfig(**_small(pad_token_id=1))))


def albert():
    t = _tf()
    return _text(t.AlbertModel(t.AlbertConfig(embedding_size=16, **_small())))


def electra():
    t = _tf()
    return _text(t.ElectraModel(t.ElectraConfig(embedding_size=16, **_small())))


def _decoder(model: torch.nn.Module) -> tuple[torch.nn.Module, tuple]:
    return model.eval(), (_ids(),)


def gpt2():
    t = _tf()
    return _decoder(t.GPT2Model(t.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                             use_cache=False)))


def gpt2_kv_cache():
    """GPT-2 with its LM head returning logits and the KV cache (past_key_values).

    transformers' own export support registers DynamicCache as a pytree node; without
    it trace() refuses the model, naming DynamicCache and this call.
    """
    t = _tf()
    from transformers.integrations.executorch import register_dynamic_cache_export_support  # noqa: PLC0415

    register_dynamic_cache_export_support()
    return _decoder(t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                                   use_cache=True)))


def gpt_neox():
    t = _tf()
    return _decoder(t.GPTNeoXModel(t.GPTNeoXConfig(**_small(use_cache=False))))


def opt():
    t = _tf()
    return _decoder(t.OPTModel(t.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                                           vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=32,
                                           use_cache=False)))


def llama():
    t = _tf()
    return _decoder(t.LlamaModel(t.LlamaConfig(**_small(num_key_value_heads=1, use_cache=False))))


def mistral():
    t = _tf()
    return _decoder(t.MistralModel(t.MistralConfig(**_small(num_key_value_heads=1, use_cache=False))))


def t5():
    t = _tf()
    model = t.T5Model(t.T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2, vocab_size=VOCAB,
                                 use_cache=False, decoder_start_token_id=0))
    return KeywordInputs(model.eval(), ["input_ids", "decoder_input_ids"]), (_ids(), _ids(4))


def bart():
    t = _tf()
    model = t.BartModel(t.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                     vocab_size=VOCAB, max_position_embeddings=64, use_cache=False))
    return KeywordInputs(model.eval(), ["input_ids", "decoder_input_ids"]), (_ids(), _ids(4))


def _images(size: int = 32, channels: int = 3) -> tuple:
    return (torch.rand(BATCH, channels, size, size),)


def _vision(model: torch.nn.Module, size: int = 32) -> tuple[torch.nn.Module, tuple]:
    """The model with weights that give outputs of ordinary size, and its example images.

    Freshly initialised torchvision and timm models give near-zero outputs (zero-initialised
    heads, batch-norm statistics of 0 and 1 after dozens of layers: 1e-14 for
    EfficientNet-B0), which would make any comparison pass. As a trained model would,
    these get batch-norm statistics from a few training-mode passes over random images,
    and zero-initialised weight matrices get small random values.
    """
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and not param.any():
                param.normal_(0, 0.05)
        norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        momenta = [m.momentum for m in norms]
        for norm in norms:  # a plain average over the passes, whatever momentum the model uses
            norm.reset_running_stats()
            norm.momentum = None
        model.train()
        for _ in range(3):
            model(torch.rand(8, 3, size, size))
        for norm, momentum in zip(norms, momenta):
            norm.momentum = momentum
    return model.eval(), _images(size)


def vit():
    t = _tf()
    model = t.ViTModel(t.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=64))
    return model.eval(), _images()


def swin():
    t = _tf()
    model = t.SwinModel(t.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                     window_size=4))
    return model.eval(), _images()


def clip():
    t = _tf()
    config = t.CLIPConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         vocab_size=VOCAB, max_position_embeddings=16),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           image_size=32, patch_size=8),
        projection_dim=16,
    )
    model = PerExampleOutputs(t.CLIPModel(config).eval(), ["input_ids", "pixel_values"],
                              ["text_embeds", "image_embeds"])
    return model, (_ids(), torch.rand(BATCH, 3, 32, 32))


def whisper():
    t = _tf()
    model = t.WhisperModel(t.WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                           decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                           num_mel_bins=16, max_source_positions=16, max_target_positions=16,
                                           vocab_size=VOCAB, use_cache=False, pad_token_id=1, bos_token_id=1,
                                           eos_token_id=2, decoder_start_token_id=1))
    return KeywordInputs(model.eval(), ["input_features", "decoder_input_ids"]), (torch.rand(BATCH, 16, 32), _ids(4))


def wav2vec2():
    t = _tf()
    model = t.Wav2Vec2Model(t.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                             conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                             num_conv_pos_embedding_groups=2))
    return model.eval(), (torch.rand(BATCH, 400),)


def yolos():
    t = _tf()
    model = t.YolosForObjectDetection(t.YolosConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=[32, 32],
        patch_size=8, num_detection_tokens=5, num_labels=3))
    return model.eval(), _images()


def _tv():
    import torchvision  # noqa: PLC0415

    return torchvision.models


def tv_resnet18():
    return _vision(_tv().resnet18(weights=None, num_classes=10))


def tv_mobilenet_v3_small():
    return _vision(_tv().mobilenet_v3_small(weights=None, num_classes=10))


def tv_efficientnet_b0():
    return _vision(_tv().efficientnet_b0(weights=None, num_classes=10))


def tv_convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt  # noqa: PLC0415

    model = ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], num_classes=10)
    return _vision(model)


def tv_regnet():
    return _vision(_tv().regnet_y_400mf(weights=None, num_classes=10))


def tv_swin():
    from torchvision.models.swin_transformer import SwinTransformer  # noqa: PLC0415

    model = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=[4, 4],
                            num_classes=10)
    return _vision(model)


def tv_vit():
    from torchvision.models.vision_transformer import VisionTransformer  # noqa: PLC0415

    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                              num_classes=10)
    return _vision(model)


def tv_lraspp():
    model = _tv().segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3)
    return _vision(model, 64)


def _detection(builder: str):
    models = _tv().detection
    model = getattr(models, builder)(weights=None, weights_backbone=None, num_classes=3)
    return model.eval(), (torch.rand(BATCH, 3, 64, 64),)


def tv_ssdlite():
    return _detection("ssdlite320_mobilenet_v3_large")


def tv_fasterrcnn():
    return _detection("fasterrcnn_mobilenet_v3_large_320_fpn")


# Every torchvision detector ends in batched_nms, whose `if boxes.numel() == 0:` branches
# on how many boxes passed the score threshold: a size only the input's values decide.
NMS_BRANCH = "boxes.py(97): if boxes.numel() == 0:"


def _timm(name: str, **kwargs):
    import timm  # noqa: PLC0415

    return timm.create_model(name, pretrained=False, num_classes=10, **kwargs).eval()


def timm_resnet10t():
    return _vision(_timm("resnet10t"))


def timm_vit_tiny():
    return _vision(_timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2))


def timm_convnext_atto():
    return _vision(_timm("convnext_atto"))


def timm_mobilenetv3():
    return _vision(_timm("mobilenetv3_small_050"))


ZOO = [
    Entry("transformers/bert", "encoder", bert),
    Entry("transformers/distilbert", "encoder", distilbert),
    Entry("transformers/roberta", "encoder", roberta),
    Entry("transformers/albert", "encoder", albert),
    Entry("transformers/electra", "encoder", electra),
    Entry("transformers/gpt2", "decoder", gpt2),
    Entry("transformers/gpt2-lm-kv-cache", "decoder + KV cache", gpt2_kv_cache),
    Entry("transformers/gpt-neox", "decoder", gpt_neox),
    Entry("transformers/opt", "decoder", opt),
    Entry("transformers/llama", "decoder", llama),
    Entry("transformers/mistral", "decoder", mistral),
    Entry("transformers/t5", "encoder-decoder", t5),
    Entry("transformers/bart", "encoder-decoder", bart),
    Entry("transformers/vit", "vision", vit),
    Entry("transformers/swin", "vision", swin),
    Entry("transformers/clip", "multimodal", clip),
    Entry("transformers/whisper", "speech", whisper),
    Entry("transformers/wav2vec2", "speech", wav2vec2),
    Entry("transformers/yolos", "detection", yolos),
    Entry("torchvision/resnet18", "vision", tv_resnet18),
    Entry("torchvision/mobilenet_v3_small", "vision", tv_mobilenet_v3_small),
    Entry("torchvision/efficientnet_b0", "vision", tv_efficientnet_b0),
    Entry("torchvision/convnext", "vision", tv_convnext),
    Entry("torchvision/regnet_y_400mf", "vision", tv_regnet),
    Entry("torchvision/swin", "vision", tv_swin),
    Entry("torchvision/vit", "vision", tv_vit),
    Entry("torchvision/lraspp_mobilenet_v3_large", "segmentation", tv_lraspp),
    Entry("torchvision/ssdlite320_mobilenet_v3_large", "detection", tv_ssdlite, fails_at=NMS_BRANCH),
    Entry("torchvision/fasterrcnn_mobilenet_v3_large_320_fpn", "detection", tv_fasterrcnn, fails_at=NMS_BRANCH),
    Entry("timm/resnet10t", "vision", timm_resnet10t),
    Entry("timm/vit_tiny", "vision", timm_vit_tiny),
    Entry("timm/convnext_atto", "vision", timm_convnext_atto),
    Entry("timm/mobilenetv3_small_050", "vision", timm_mobilenetv3),
]
