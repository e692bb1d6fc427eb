"""neuron-serve: torch-neuronx's compile pipeline on torch.fx and torch-xla, and a server.

The public API is named like ``torch_neuronx`` so code ports by changing an import.
"""

__version__ = "0.1.0"

from .api import analyze, dynamic_batch, trace  # noqa: E402
from .errors import ConfigError, PartitionError, UnsupportedModelError  # noqa: E402
from .partition.config import PartitionerConfig  # noqa: E402

__all__ = [
    "ConfigError",
    "PartitionError",
    "PartitionerConfig",
    "UnsupportedModelError",
    "__version__",
    "analyze",
    "dynamic_batch",
    "trace",
]
