"""Where each compile of one trace writes into ``compiler_workdir``.

torch-neuronx compiles one graph per trace call, so it writes straight into the
directory. A trace here may compile several (one per bucket and per batch size), and
each writes ``accel_0.hlo.txt``; each therefore gets its own subdirectory, named like
the artifact's folders: ``bucket_0/``, ``bucket_0/batch_4/`` (``batch_4/`` for a
one-bucket trace with several batch sizes).
"""

from __future__ import annotations

import os


def subdir(workdir: str | None, *parts: str) -> str | None:
    """``workdir`` joined with ``parts`` (None stays None)."""
    return os.path.join(workdir, *parts) if workdir else None


def bucket_part(index: int, count: int) -> tuple[str, ...]:
    """The folder of bucket ``index`` of ``count`` (none when there is one bucket)."""
    return (f"bucket_{index}",) if count > 1 else ()


def batch_part(size: int, count: int) -> tuple[str, ...]:
    """The folder of batch size ``size`` of ``count`` compiled sizes (none when one)."""
    return (f"batch_{size}",) if count > 1 else ()
