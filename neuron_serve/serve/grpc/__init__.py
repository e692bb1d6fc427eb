"""OIP v2 over gRPC: the service in each model replica, HTTP/1 relaying, and who holds the shared port."""
