"""neuron-serve: torch-neuronx's compile pipeline on torch.fx and torch-xla, and a server.

The public API is named like ``torch_neuronx`` so code ports by changing an import.
"""

from .version import __version__
from .api import analyze, bucket_model_trace, dynamic_batch, trace, trace_buckets
from .artifact import load, save  # noqa: E402
from .bucketing import BucketModelConfig, BucketSpec  # noqa: E402
from .errors import ConfigError, PartitionError, UnsupportedModelError  # noqa: E402
from .model import CompiledModel  # noqa: E402
from .partition.config import PartitionerConfig  # noqa: E402

__all__ = [
    "ConfigError",
    "PartitionError",
    "PartitionerConfig",
    "UnsupportedModelError",
    "__version__",
    "BucketModelConfig",
    "BucketSpec",
    "CompiledModel",
    "analyze",
    "bucket_model_trace",
    "trace_buckets",
    "dynamic_batch",
    "trace",
    "save",
    "load",
]
