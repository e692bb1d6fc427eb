"""sentence-transformers behind Ray Serve: the embeddings peer of bench/embeddings.py.

    python -m bench.peers.ray_embed_app --model DIR --port 18931 [--haproxy] [--batch 16]

One replica holds ``SentenceTransformer(DIR)`` and batches requests with Ray Serve's own
``@serve.batch`` (up to ``--batch`` texts, waiting at most 2 ms, as neuron-serve's queue
does), calling ``encode`` once per batch on a thread, so the replica's loop keeps taking
requests. It answers OpenAI's ``POST /v1/embeddings`` (float lists), the route the other
servers are measured on. Behind Serve's default HTTP proxy, or HAProxy with ``--haproxy``.
"""

import argparse
import os

from bench.peers.ray_app import ROOT, configure_ingress

BATCH_WAIT_S = 0.002


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--haproxy", action="store_true")
    args = parser.parse_args()
    configure_ingress(args.port, args.haproxy)

    import asyncio  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    import ray  # noqa: PLC0415
    from fastapi import FastAPI, Request  # noqa: PLC0415
    from fastapi.responses import JSONResponse  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    app = FastAPI()

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    @serve.ingress(app)
    class Embedder:
        def __init__(self, directory: str) -> None:
            from sentence_transformers import SentenceTransformer  # noqa: PLC0415

            self.model = SentenceTransformer(directory, device="cpu")

        @serve.batch(max_batch_size=args.batch, batch_wait_timeout_s=BATCH_WAIT_S)
        async def encode(self, texts: list[str]) -> list[list[float]]:
            vectors = await asyncio.get_running_loop().run_in_executor(None, self.model.encode, texts)
            return vectors.tolist()

        @app.post("/v1/embeddings")
        async def embeddings(self, request: Request) -> JSONResponse:
            body = await request.json()
            texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
            vectors = await asyncio.gather(*(self.encode(t) for t in texts))
            return JSONResponse({"object": "list", "model": body.get("model"),
                                 "data": [{"object": "embedding", "index": i, "embedding": v}
                                          for i, v in enumerate(vectors)]})

    ray.init(include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(Embedder.bind(os.path.abspath(args.model)), name="embedder", route_prefix="/")
    print("ready", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
