"""Speculative decoding: each round's proposals (n-gram or draft, proposer.py); the verify call is the runner's, what a
row takes the request states'."""
