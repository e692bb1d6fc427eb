"""What the replicas that serve OIP v2 share (deployment.py's ModelServer, pooling_deployment.py's PoolingServer):
the shared gRPC port, their own model's calls run on their infer data plane and the other models' forwarded."""

from __future__ import annotations

from ..grpc import service as grpc_service
from ..infer import plane as dataplane
from ..infer.plane import ModelDataPlane
from . import grpc_port
from .applications import call_model, model_states
from .replica_base import Replica


class OipReplica(Replica):
    """A replica whose model answers OIP v2 on its infer data plane (``_data``), over HTTP and gRPC."""

    def _data(self) -> ModelDataPlane:
        """The infer data plane OIP v2 calls run on."""
        return self.plane

    async def _serve_grpc(self, grpc_options: dict | None, name: str, replica: str) -> None:
        """Serve gRPC for model ``name`` when ``grpc_options`` says where (see grpc_port.options)."""
        self._grpc = self._relay = self._grpc_key = None
        if grpc_options:
            self._grpc, self._relay, self._grpc_key = await grpc_port.start_for_replica(
                grpc_options, model_states, self._call_model, name, replica)

    async def _call_model(self, name: str, method: str, payload) -> tuple:
        if name == self.plane.name:
            return await grpc_service.replica_call(self._data(), method, payload)
        return await call_model(name, method, payload)

    async def grpc_call(self, method: str, payload: bytes = b"") -> tuple:
        """A gRPC call forwarded by another replica's gRPC server (see grpc_service)."""
        answer = await grpc_service.replica_call(dataplane.current(), method, payload)
        if answer[0] == "ok" and hasattr(answer[1], "SerializeToString"):
            return ("ok", answer[1].SerializeToString())
        return answer
