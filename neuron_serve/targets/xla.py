"""The `xla` target: placement decided only by what torch-xla lowers and compiles."""

from __future__ import annotations

from .base import Target


class XlaTarget(Target):
    name = "xla"
    device_label = "Device.XLA"
