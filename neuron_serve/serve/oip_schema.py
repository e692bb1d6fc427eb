"""Moved to `neuron_serve.serve.protocols.oip_rest_schema`; this name stays an alias of it."""

import sys

from .protocols import oip_rest_schema

sys.modules[__name__] = oip_rest_schema
