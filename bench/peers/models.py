"""The eager models every peer serves: the same factories and weights as deployments/."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deployments"))

from example_models import encoder as _encoder  # noqa: E402
from example_models import mlp as _mlp  # noqa: E402

MLP_OUTPUT = "output_0"
ENCODER_OUTPUT = "pooler_output"


class EagerModels:
    """Both benchmark models, eager on CPU; each call takes and returns numpy arrays."""

    def __init__(self) -> None:
        torch.set_grad_enabled(False)
        self.mlp = _mlp.build()
        self.encoder = _encoder.build(layers=4, hidden=256)

    def run_mlp(self, x: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            return {MLP_OUTPUT: self.mlp(torch.from_numpy(np.asarray(x, np.float32))).numpy()}

    def run_encoder(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            out = self.encoder(input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention_mask))
        return {ENCODER_OUTPUT: out.pooler_output.numpy()}

    def run(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if model == "mlp":
            return self.run_mlp(inputs["x"])
        return self.run_encoder(inputs["input_ids"], inputs["attention_mask"])


def pad_batch(items: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], list[int]]:
    """Concatenate requests along dim 0, padding sequence inputs to the longest (zeros)."""
    rows = [next(iter(i.values())).shape[0] for i in items]
    batch = {}
    for name in items[0]:
        arrays = [i[name] for i in items]
        if arrays[0].ndim == 2 and name != "x":
            width = max(a.shape[1] for a in arrays)
            arrays = [np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays]
        batch[name] = np.concatenate(arrays)
    return batch, rows


def split_rows(outputs: dict[str, np.ndarray], rows: list[int]) -> list[dict[str, np.ndarray]]:
    """The inverse of pad_batch for outputs whose dim 0 is the batch."""
    result, start = [], 0
    for n in rows:
        result.append({k: v[start:start + n] for k, v in outputs.items()})
        start += n
    return result
