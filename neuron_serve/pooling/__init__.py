"""The pooling tasks (``embed``, ``score``, ``classify``): a sentence-transformers or transformers model
served as vectors or scores.

source.py reads the model directory with sentence-transformers' own loaders and resolves
model.yaml's ``pooling`` settings into a `PoolingSpec`; graph.py is the module compiled one
text a row (the transformer, then the pooling, projection and normalisation modules after it,
then the activation, so only one vector or a few scores a row leave the core), packed_graph.py
the module compiled for rows of several texts (the default where the model is exact packed);
build.py compiles it over sequence-length buckets and batch sizes (the compiler); tokens.py
turns text into token rows and packing.py packs them into the rows the compiled model takes
(what a replica runs on the host). Each is imported by its own name.
"""
