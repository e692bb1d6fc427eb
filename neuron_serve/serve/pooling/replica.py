"""What a pooling replica builds: the compiled model on its cores through the infer data plane, the pooling plane
over it, and (``pooling.length_buckets: auto``) what changes its length buckets while it serves (rebucket.py).

Apart from the Ray deployment (serve/ray/pooling_deployment.py) so that a test builds a replica's plane as the
replica does, in process.
"""

from __future__ import annotations

from ...assembly.queue import READY, compile_queue
from ...config.pooling import AUTO_LEARN_AFTER
from ...config.schema import ModelConfig
from ...pooling.tokens import Tokens
from ..infer.plane import ModelDataPlane
from .plane import PoolingPlane


def build_plane(config: ModelConfig, base_dir: str | None, replica: str) -> PoolingPlane:
    """The replica's pooling plane over its data plane, as an infer model's: ready once the longest length bucket
    at the largest batch size is compiled and loaded (any input fits it); the other compiled models join it as each
    is compiled, in the background (model.yaml's ``background_compile``), all of it on the compile queue."""
    from ...pooling.build import described, staged  # noqa: PLC0415 - the compiler is loaded by replicas only
    from .rebucket import Rebucketing  # noqa: PLC0415 - as the build

    # The model's directory is read and its graph made on the queue's thread, as every trace.
    loading = compile_queue().submit(f"load {config.name} (pooling model)", lambda: staged(config, base_dir),
                                     priority=READY, group=config.name, kind="load")
    build, spec, tokenizer = loading.future.result()
    planes: list[PoolingPlane] = []

    def load(model) -> PoolingPlane:
        known = described(model, spec)
        data = ModelDataPlane(config, model, replica, parameters=known.describe(), compiles=build.compiles)
        planes.append(PoolingPlane(config, data, Tokens(tokenizer, known), known))
        return planes[0]

    plane = build.start(load, grow=lambda model: planes[0].data.grow(model))
    settings = config.pooling
    if settings is not None and settings.length_buckets == "auto":
        plane.rebucket = Rebucketing(plane, config, base_dir, build.source.module,
                                     settings.learn_buckets_after or AUTO_LEARN_AFTER, build.finished.is_set)
    return plane
