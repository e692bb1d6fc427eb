"""Ray: the replicas and their deployments, deploy's cluster, its ingress, and how it stops."""
