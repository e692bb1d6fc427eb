"""A generate model.yaml to running engines: the causal LM loaded (loading.py), its generation models compiled
(compile.py) and assembled (build.py), artifacts (artifact.py), analyze (analyze.py) and re-bucketing while serving
(rebucket.py)."""
