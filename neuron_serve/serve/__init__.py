"""Serving layers: protocol codecs, data plane, HTTP routes."""
