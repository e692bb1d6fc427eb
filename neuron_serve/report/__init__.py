"""The partition report: why each operator runs where, the rules a config breaks, configs
worth trying, measured subgraph times, drawn as one HTML page. It reads the results of
analysis and partitioning; nothing in neuron-serve but the CLI imports it."""
