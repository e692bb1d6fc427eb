"""OIP v2 over gRPC: the service in each model replica, and gRPC over HTTP/1 behind HAProxy."""
