"""What one compiled generation call gives back: each row's token, and the logits left on the core.

A call returns as soon as the core has it; :class:`StepOutput` brings home one token id a row
(and, for a sampled call, whether the core could choose it) when first read, all in one
transfer, and the logits only for a row the host chooses for. The time a thread spends waiting for
them is counted (:func:`waited`): an engine step's time less it is the host's part of the step.
"""

from __future__ import annotations

import threading
import time

import torch

from ...targets import xla_state
from ...targets.pjrt import xla

_waiting = threading.local()


def waited() -> float:
    """Seconds the calling thread has waited so far for calls' outputs to come home (the core computing them)."""
    return getattr(_waiting, "seconds", 0.0)


def _count_wait(started: float) -> None:
    _waiting.seconds = waited() + time.perf_counter() - started


class _Outputs:
    """A call's outputs, on the core until first read; tokens and flags then cross in one transfer."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor, done: torch.Tensor | None,
                 sampled: bool = False) -> None:
        self.logits = logits
        self.sampled = sampled  # the sampler chose the tokens (else argmax)
        self.on_core = [tokens] if done is None else [tokens, done]
        self._home: list[torch.Tensor] | None = None

    def home(self) -> list[torch.Tensor]:
        """[tokens] or [tokens, done] on the host; the first read waits for the call to finish."""
        if self._home is None:
            moving = [t for t in self.on_core if t.device.type == "xla"]
            started = time.perf_counter()
            fetched = iter(xla()._XLAC._xla_get_cpu_tensors(moving) if moving else [])
            _count_wait(started)
            self._home = [next(fetched) if t.device.type == "xla" else t for t in self.on_core]
        return self._home


class StepOutput:
    """One compiled call's rows: the tokens chosen on the core (and, sampled, whether each was), and the
    logits, on the core until asked for."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor, done: torch.Tensor | None = None,
                 index: torch.Tensor | None = None, outputs: _Outputs | None = None, sampled: bool = False) -> None:
        self._outputs = outputs or _Outputs(logits, tokens, done, sampled)
        self._index = index

    @property
    def sampled(self) -> bool:
        """Whether the sampler chose the tokens (a row it left undone follows its own host rule), or argmax."""
        return self._outputs.sampled

    def rows(self, index: torch.Tensor) -> "StepOutput":
        """The same output, for rows ``index`` only, in that order."""
        return StepOutput(None, None, index=index, outputs=self._outputs)

    def with_done(self, done: torch.Tensor) -> "StepOutput":
        """The same output, each row's token final only where ``done`` (a host tensor, one flag a row) says."""
        return StepOutput(self._outputs.logits, self._outputs.on_core[0], done, self._index)

    def next_input(self, rows: int) -> torch.Tensor:
        """This decode's tokens as the next decode's token input, never read home: (rows, 1) on the core, row r
        the token of slot r (a decode's rows are its slots). One small executable (compiled once a row count)
        that the core runs after this call; the next call is queued behind it."""
        with torch.no_grad(), xla_state.exclusive():  # its pending graph must not meet a trace's sync or clear
            tokens = self._outputs.on_core[0].to(torch.long)
            given = tokens.shape[0]
            fed = tokens[:rows] if given >= rows else torch.cat([tokens, tokens.new_zeros(rows - given)])
            fed = fed.reshape(rows, 1)
            xla()._XLAC._xla_sync_multi([fed], devices=[], wait=False)
        return fed

    @property
    def tokens(self) -> list:
        """Each row's token (a list of each step's, for a call of several steps or positions)."""
        return self._outputs.home()[0][self._index].tolist()

    @property
    def done(self) -> list | None:
        """Whether the core chose each token (as :attr:`tokens`); where not, the host chooses from :attr:`logits`
        (sampler.sample_on_host). None for an argmax call: every token is chosen."""
        home = self._outputs.home()
        return home[1][self._index].tolist() if len(home) > 1 else None

    @property
    def logits(self) -> torch.Tensor:
        """Each row's logits (rows, [steps,] vocab), copied to the host: for penalties, logprobs and the
        choices the core left to the host."""
        started = time.perf_counter()
        logits = self._outputs.logits.cpu()
        _count_wait(started)
        return logits[self._index]
