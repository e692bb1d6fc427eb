"""The compiled-model type: what building produces and the runtime, artifacts and server take.

It imports nothing of the compiler (capture, analysis, partitioning, compiling), so a
process that only runs a built model never loads it.
"""

from .bucket import Bucket, Partition
from .compiled import BuildInfo, CompiledModel
from .signature import DYNAMIC, Signature, TensorSig

__all__ = ["Bucket", "BuildInfo", "CompiledModel", "DYNAMIC", "Partition", "Signature", "TensorSig"]
