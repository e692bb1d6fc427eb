"""Small pooling models with random weights, saved as sentence-transformers saves them (nothing is downloaded).

The unit tests compile them in process and the served tests deploy the same directories
(same seeds, same tokenizers), so the server's replicas find their compiled graphs in the
run's compile cache. Each maker writes one directory and returns it:

- ``bert_embedder``: a BertModel, then Pooling (``pooling``) and Normalize (when ``normalize``),
  with SentenceTransformer.save (deployments/example_models/make_embedders.py's maker);
- ``cross_encoder``: a BertForSequenceClassification with ``labels`` labels, with CrossEncoder.save;
- ``qwen3_embedder``: a decoder embedder as Qwen3-Embedding is made: a Qwen3Model, last-token
  pooling and Normalize, its byte-level BPE tokenizer appending <|endoftext|>, padding left;
- ``xlmr_model``: an XLMRobertaModel saved by transformers alone (no sentence-transformers files);
- ``modernbert_embedder``: a ModernBertModel with mean pooling, normalised.
"""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

import tokenizers
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deployments" / "example_models"))
import make_embedders  # noqa: E402

VOCAB = 1000
SMALL = {"hidden": 32, "layers": 2, "heads": 2}


@functools.lru_cache(maxsize=None)
def wordpiece() -> transformers.PreTrainedTokenizerFast:
    """The examples' WordPiece tokenizer with a small vocabulary."""
    return make_embedders.tokenizer(VOCAB)


def bert_embedder(out: Path, pooling: str = "mean", normalize: bool = True, max_seq_length: int = 64) -> Path:
    return make_embedders.embedder(out, wordpiece(), pooling=pooling, normalize=normalize,
                                   max_seq_length=max_seq_length, **SMALL)


def cross_encoder(out: Path, labels: int = 1, max_seq_length: int = 64) -> Path:
    return make_embedders.cross_encoder(out, wordpiece(), labels=labels, max_seq_length=max_seq_length, seed=labels,
                                        **SMALL)


def _sentence_transformer(out: Path, model: torch.nn.Module, tok, pooling: str, normalize: bool = True,
                          max_seq_length: int = 64) -> Path:
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415
    from sentence_transformers.base.modules import Normalize, Transformer  # noqa: PLC0415
    from sentence_transformers.sentence_transformer.modules import Pooling  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        encoder = Transformer(folder, max_seq_length=max_seq_length)
        modules = [encoder, Pooling(encoder.get_embedding_dimension(), pooling_mode=pooling)]
        SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu").save(str(out))
    return out


@functools.lru_cache(maxsize=None)
def byte_bpe() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer as Qwen's: every text ends in <|endoftext|> (as Qwen3-Embedding's); pads left."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(make_embedders.corpus(), tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    end = tok.token_to_id("<|endoftext|>")
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", end)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>", padding_side="left")


def qwen3_embedder(out: Path) -> Path:
    tok = byte_bpe()
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id)
    return _sentence_transformer(out, transformers.Qwen3Model(config).eval(), tok, "lasttoken")


def xlmr_model(out: Path) -> Path:
    """An XLMRobertaModel and its Unigram tokenizer (sentencepiece's model, as XLM-R's) saved by transformers: no
    sentence-transformers files."""
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = tokenizers.Tokenizer(tokenizers.models.Unigram())
    tok.normalizer = tokenizers.normalizers.NFKC()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    tok.train_from_iterator(make_embedders.corpus(), tokenizers.trainers.UnigramTrainer(
        vocab_size=VOCAB, special_tokens=special, unk_token="<unk>", show_progress=False))
    tok.post_processor = tokenizers.processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                                 ("<s>", tok.token_to_id("<s>")))
    fast = transformers.XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                cls_token="<s>", sep_token="</s>", pad_token="<pad>",
                                                unk_token="<unk>", mask_token="<mask>")
    torch.manual_seed(0)
    config = transformers.XLMRobertaConfig(vocab_size=len(fast), hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=64, max_position_embeddings=66,
                                           pad_token_id=fast.pad_token_id, bos_token_id=fast.cls_token_id,
                                           eos_token_id=fast.sep_token_id)
    transformers.XLMRobertaModel(config, add_pooling_layer=False).save_pretrained(out)
    fast.save_pretrained(out)
    return out


def modernbert_embedder(out: Path) -> Path:
    tok = wordpiece()
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=128,
                                           pad_token_id=tok.pad_token_id, cls_token_id=tok.cls_token_id,
                                           sep_token_id=tok.sep_token_id, bos_token_id=tok.cls_token_id,
                                           eos_token_id=tok.sep_token_id, global_attn_every_n_layers=2,
                                           local_attention=16)
    return _sentence_transformer(out, transformers.ModernBertModel(config).eval(), tok, "mean")


MAKERS = {
    "embedder": bert_embedder,
    "embedder-cls": lambda out: bert_embedder(out, pooling="cls", normalize=False),  # the same weights (seed)
    "reranker": cross_encoder,
    "classifier": lambda out: cross_encoder(out, labels=3),
    "qwen3": qwen3_embedder,
    "xlmr": xlmr_model,
    "modernbert": modernbert_embedder,
}

# The model.yaml (less its model.pretrained) of the models the served test deploys together: the embedder with two
# length buckets (requests of mixed lengths use both), each model at one batch size (each graph compiled takes
# seconds, on every start: XLA:CPU executables are not cached).
CONFIGS = {
    "embedder": {"task": "embed", "pooling": {"length_buckets": [16, 64], "matryoshka_dimensions": [8, 16]},
                 "batch_sizes": [8], "batching": {"max_batch_size": 8, "max_queue_delay_ms": 2}},
    "reranker": {"task": "score", "pooling": {"length_buckets": [64]}, "batch_sizes": [8],
                 "batching": {"max_batch_size": 8, "max_queue_delay_ms": 2}},
    "classifier": {"task": "classify", "pooling": {"length_buckets": [64]}, "batch_sizes": [8],
                   "batching": {"max_batch_size": 8, "max_queue_delay_ms": 2}},
}
# The unit tests' models, each compiled in process at one length and one batch size.
ONE_SHAPE = {"pooling": {"length_buckets": [32]}, "batch_sizes": [4], "batching": {"max_batch_size": 4}}
CONFIGS.update({
    "embedder-one": {**ONE_SHAPE, "task": "embed", "pooling": {"length_buckets": [64],
                                                               "matryoshka_dimensions": [8, 16]}},
    # the embedder's directory served otherwise than it was saved
    "embedder-cls": {**ONE_SHAPE, "task": "embed", "pooling": {"length_buckets": [32], "pooling_type": "CLS",
                                                               "normalize": False}},
})


def on_plane(built: tuple, calls):
    """Start a pooling plane on ``built`` (config, compiled model, spec, tokenizer: what the unit tests' ``pooled``
    returns) in process, run ``await calls(plane)``, stop it; what ``calls`` returned."""
    import asyncio  # noqa: PLC0415

    from neuron_serve.pooling.tokens import Tokens  # noqa: PLC0415
    from neuron_serve.serve.infer.plane import ModelDataPlane  # noqa: PLC0415
    from neuron_serve.serve.pooling.plane import PoolingPlane  # noqa: PLC0415

    config, model, spec, tokenizer = built

    async def main():
        plane = PoolingPlane(config, ModelDataPlane(config, model, "test", spec.describe()), Tokens(tokenizer, spec),
                             spec)
        plane.start()
        try:
            return await calls(plane)
        finally:
            await plane.stop()

    return asyncio.run(main())


async def answer(plane, request):
    """The plane's answer to one PoolingRequest, counted as a request."""
    with plane.data.begin() as call:
        return await plane.pool(request, call)


class Directories:
    """The model directories of one test session, each written when first asked for."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __getitem__(self, name: str) -> Path:
        path = self.root / name
        if not (path / "config.json").is_file():
            MAKERS[name](path)
        return path

    def config(self, name: str, source: str | None = None, **changes) -> dict:
        """The model.yaml of ``name`` (CONFIGS', else ONE_SHAPE with task embed) serving directory ``source``."""
        base = CONFIGS.get(name, {"task": "embed", **ONE_SHAPE})
        return {"name": name, "model": {"pretrained": str(self[source or name])}, **base, **changes}
