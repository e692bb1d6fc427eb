"""Protocols as codecs at the edge of the data plane.

Each module decodes one wire format into the protocol-neutral `infer.InferRequest` and
encodes `infer.InferResponse` back, with its own checks and messages; none translates a
request into another protocol. ``oip_rest`` (JSON and the binary tensor extension, with
``oip_rest_schema`` and ``oip_tensors``), ``oip_grpc`` (``ModelInferRequest``); OpenAI
and the generate extension join them here.
"""
