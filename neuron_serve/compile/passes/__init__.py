"""FX passes applied to an accelerator subgraph before it is compiled; one pass per module."""
