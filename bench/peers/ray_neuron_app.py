"""The peer an Inf2 user writes today from Ray Serve's NeuronCore tutorial: Ray Serve over
the module ``neuron_serve`` compiles, so it runs the same compiled compute as neuron-serve.

    python -m bench.peers.ray_neuron_app --port 18600 --haproxy           # traced at batch 1, one request per call
    python -m bench.peers.ray_neuron_app --port 18700 --haproxy --batch   # @serve.batch over dynamic_batch

Without ``--batch`` each model is compiled at batch 1 (the tutorial's ``trace`` of one
example) and called once per request. With it, each model is compiled at its
model.yaml's trace batch (dim 0 of its inputs, one size, as torch-neuronx's
``trace`` + ``dynamic_batch``) and ``@serve.batch`` groups requests with the
model.yaml's ``batching`` bounds. The encoder keeps its model.yaml sequence buckets in
both. ``--haproxy`` is as in :mod:`bench.peers.ray_app`.
"""

from __future__ import annotations

import argparse
import os

from bench.peers.ray_app import ROOT, configure_ingress, serve_models

OUTPUTS = {"mlp": "output_0", "encoder": "pooler_output"}


def compiled(name: str, batch: bool):
    """The deployments/<name>.yaml model, compiled at one batch size: 1, or its trace batch with ``batch``."""
    from pathlib import Path  # noqa: PLC0415

    from neuron_serve.assembly.from_config import build  # noqa: PLC0415
    from neuron_serve.config.schema import load_config  # noqa: PLC0415

    path = Path(__file__).resolve().parents[2] / "deployments" / f"{name}.yaml"
    config = load_config(path)
    rows = config.inputs[0].shape[0] if batch else 1
    inputs = [i.model_copy(update={"shape": [rows, *i.shape[1:]]}) for i in config.inputs]
    config = config.model_copy(update={"batch_sizes": [rows], "inputs": inputs})
    return config, build(config, path.parent)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=18600)
    parser.add_argument("--haproxy", action="store_true")
    parser.add_argument("--batch", action="store_true", help="@serve.batch over a dynamic_batch module")
    args = parser.parse_args()
    configure_ingress(args.port, args.haproxy)

    from ray import serve  # noqa: PLC0415
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import Response  # noqa: PLC0415

    class Compiled:
        def __init__(self, name: str) -> None:
            self.name = name
            config, self.model = compiled(name, batch=False)
            self.output = self.model.output_names.index(OUTPUTS[name])

        def run(self, inputs):
            import numpy as np  # noqa: PLC0415
            import torch  # noqa: PLC0415
            import torch.utils._pytree as pytree  # noqa: PLC0415

            tensors = [torch.from_numpy(np.ascontiguousarray(inputs[n])) for n in self.model.input_names]
            with torch.no_grad():
                flat = pytree.tree_flatten(self.model(*tensors))[0]
            return {OUTPUTS[self.name]: flat[self.output].numpy()}

        async def __call__(self, request: Request) -> Response:
            from bench.peers import codec  # noqa: PLC0415

            inputs, wanted, binary = codec.decode(await request.body(), request.headers)
            body, headers = codec.encode(self.name, self.run(inputs), wanted, binary)
            return Response(body, headers=headers)

    class Batched(Compiled):
        def __init__(self, name: str) -> None:
            self.name = name
            config, self.model = compiled(name, batch=True)
            self.output = self.model.output_names.index(OUTPUTS[name])
            limits = config.batching
            self.handle_batch.set_max_batch_size(limits.max_batch_size)
            self.handle_batch.set_batch_wait_timeout_s(limits.max_queue_delay_ms / 1000)

        @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.002)
        async def handle_batch(self, items: list) -> list:
            from bench.peers.models import pad_batch, split_rows  # noqa: PLC0415

            batch, rows = pad_batch(items)
            return split_rows(self.run(batch), rows)

        async def __call__(self, request: Request) -> Response:
            from bench.peers import codec  # noqa: PLC0415

            inputs, wanted, binary = codec.decode(await request.body(), request.headers)
            body, headers = codec.encode(self.name, await self.handle_batch(inputs), wanted, binary)
            return Response(body, headers=headers)

    deployment = serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})(Batched if args.batch else Compiled)
    serve_models(deployment, args.port, {"PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
                                         "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"})


if __name__ == "__main__":
    main()
