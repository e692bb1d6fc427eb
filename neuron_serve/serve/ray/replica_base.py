"""What every model replica shares (deployment.py's ModelServer, generate_deployment.py's GenerateServer,
pooling_deployment.py's PoolingServer): building its plane off the event loop on construction, serving it and
publishing its state for ``neuron-serve status``, and stopping it all on ``__del__``.

The gRPC port the infer and pooling replicas serve is oip_replica.py's: a generate replica imports none of it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any, Callable

from ray import serve

from ... import logs
from ...config.schema import ModelConfig, parse_config
from ..http import auth
from . import compile_state, grpc_port, padding_state

logger = logging.getLogger("neuron_serve")

# model.yaml, its base directory, the replica's id -> the replica's plane
BuildPlane = Callable[[ModelConfig, str | None, str], Any]


class Replica:
    """One replica of one model: ``_build`` makes its plane (``self.plane``), ``_serve`` starts it; a subclass makes
    it the process's current plane for its routes (``_set_current``)."""

    async def _build(self, config: dict, base_dir: str | None, build: BuildPlane) -> tuple[ModelConfig, str]:
        """The parsed model.yaml and the replica's id, once ``build`` has made ``self.plane``."""
        # The process's own stderr, which Ray prints on deploy's output: under HAProxy Ray Serve
        # points a replica's sys.stderr at its log file only, and the build's progress belongs there.
        logs.configure(stream=sys.__stderr__ or sys.stderr)
        parsed = parse_config(config)
        auth.configure(auth.resolve_token(parsed))  # before anything can be served
        replica = serve.get_replica_context().replica_id.unique_id
        # Building compiles for seconds to minutes; run it off the event loop. The replica is ready
        # (its constructor returns) once its start-up models are compiled; with background_compile the
        # rest compile on the process's compile queue while it serves.
        self.plane = await asyncio.get_running_loop().run_in_executor(None, build, parsed, base_dir, replica)
        return parsed, replica

    def _serve(self, compiled: Any, replica: str) -> None:
        """Start the plane and make it current; publish its compiled models (``compiled``'s, the plane that
        counts them) and what its buckets padded."""
        self.plane.start()
        self._set_current(self.plane)
        self._untrack = compile_state.track(compiled, replica)
        self._unpublish = padding_state.track(self.plane, replica)

    def _set_current(self, plane: Any) -> None:
        """Make ``plane`` (None: none) the one this process's routes serve."""
        raise NotImplementedError

    async def __del__(self) -> None:
        for stop in (getattr(self, "_untrack", None), getattr(self, "_unpublish", None)):
            if stop is not None:
                stop()
        await stop_grpc(self)
        self._set_current(None)
        plane = getattr(self, "plane", None)  # absent when building failed
        if plane is not None:
            await plane.stop()


async def stop_grpc(holder: Any) -> None:
    """Stop the gRPC server, relay and registered address ``holder`` keeps (``_grpc``, ``_relay``, ``_grpc_key``;
    none when it serves no gRPC)."""
    if getattr(holder, "_grpc_key", None) is not None:
        try:  # no replica relays here once its list is read again (RELAY_TTL_S)
            await grpc_port.unregister(holder._grpc_key)
        except Exception as exc:  # Ray going down: the key goes with it
            logger.debug("gRPC address not unregistered: %s", exc)
    if getattr(holder, "_grpc", None) is not None:
        await holder._grpc.stop(grace=5)  # calls in flight finish; new connections go elsewhere
    if getattr(holder, "_relay", None) is not None:
        await holder._relay.close()
