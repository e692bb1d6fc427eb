"""Serving: protocol codecs (protocols/), the infer and generate planes, HTTP and gRPC, and Ray (ray/)."""
