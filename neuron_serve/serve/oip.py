"""Moved to `neuron_serve.serve.protocols.oip_rest`; this name stays an alias of it."""

import sys

from .protocols import oip_rest

sys.modules[__name__] = oip_rest
