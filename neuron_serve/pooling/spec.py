"""What a replica knows of a pooling model besides its compiled graph: a `PoolingSpec`.

Plain data, resolved once from model.yaml and the model directory by source.py when the
model is built; the serving plane, the tokenizer and the codecs read it and never the
directory. It imports nothing of torch, transformers or the compiler.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# sentence-transformers' pooling modes under vLLM's names, and back.
POOLING_MODES = {"CLS": "cls", "MEAN": "mean", "LAST": "lasttoken"}
POOLING_NAMES = {mode: name for name, mode in POOLING_MODES.items()}

# What the compiled graph returns, by task (with use_activation, else "logits" for score and classify).
OUTPUTS = {"embed": "embedding", "score": "score", "classify": "probs"}


@dataclass(frozen=True)
class PoolingSpec:
    """One pooling model as served: its task, inputs and output, lengths, and how its output is read."""

    task: str  # embed, score or classify
    input_names: tuple[str, ...]  # input_ids, attention_mask[, token_type_ids]: the compiled graph's inputs
    output_name: str  # embedding, score, probs or logits
    max_model_len: int  # the most tokens of one input
    length_buckets: tuple[int, ...]  # the compiled sequence lengths, smallest first
    pad_token_id: int
    vocab_size: int  # token ids a request may send are below it
    prompt: str = ""  # put before every text (before the query of a pair): the directory's default prompt
    # task: embed
    pooling_type: str | None = None  # CLS, MEAN, LAST, or a sentence-transformers mode of the directory
    normalize: bool = False
    hidden_size: int = 0  # the dimensions of a full embedding (the graph's output)
    dimensions: int | None = None  # a request's dimensions when it gives none (None: all)
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # task: score and classify
    labels: tuple[str, ...] = field(default_factory=tuple)  # id2label, in order
    activation: str | None = None  # the activation applied in the graph (Sigmoid, Softmax, ...), None: logits
    dtype: str = "float32"  # what the weights and activations compute in (model.yaml's dtype); outputs are float32
    buckets_from: str = "defaults"  # where length_buckets come from: model.yaml, defaults, traffic (N inputs)
    segments: int = 1  # texts a compiled row holds at most (1: one text a row, padded)
    packing: str = "off"  # "on", or "off" and why (model.yaml, or what the model cannot do packed)

    def with_hidden_size(self, size: int) -> "PoolingSpec":
        """This spec once the compiled graph says how wide an embedding is."""
        return replace(self, hidden_size=size)

    def describe(self) -> dict:
        """The fields model metadata and ``GET /v1/models`` show (``parameters`` of OIP's metadata)."""
        found = {"task": self.task, "max_model_len": self.max_model_len, "length_buckets": list(self.length_buckets),
                 "length_buckets_from": self.buckets_from, "dtype": self.dtype, "packing": self.packing,
                 "texts_per_row": self.segments}
        if self.task == "embed":
            found.update(pooling_type=self.pooling_type, normalize=self.normalize, dimensions=self.hidden_size,
                         is_matryoshka=self.is_matryoshka)
            if self.matryoshka_dimensions is not None:
                found["matryoshka_dimensions"] = list(self.matryoshka_dimensions)
        else:
            found.update(labels=list(self.labels), activation=self.activation)
        return found
