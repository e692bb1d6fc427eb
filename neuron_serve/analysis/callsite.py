"""Where in the user's code an operator came from, read off export's stack traces."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.fx

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)(?:\n(?P<code>    [^\n]*))?')
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class CallSite:
    file: str
    line: int
    code: str

    @property
    def short(self) -> str:
        """'model.py 28', the form of the analyze report's "call" field."""
        return f"{os.path.basename(self.file)} {self.line}"

    @property
    def log_form(self) -> str:
        """'model.py(28): x = torch.sort(y)', the form of the partitioner's log."""
        return f"{os.path.basename(self.file)}({self.line}): {self.code}"


def call_site(node: torch.fx.Node) -> CallSite | None:
    """The innermost frame outside torch itself, i.e. the model's own line."""
    frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
    for frame in reversed(frames):
        if not frame["file"].startswith(_TORCH_DIR):
            return CallSite(frame["file"], int(frame["line"]), (frame["code"] or "").strip())
    return None
