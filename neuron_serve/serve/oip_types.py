"""Moved to `neuron_serve.serve.protocols.infer`; this name stays an alias of it."""

import sys

from .protocols import infer

sys.modules[__name__] = infer
