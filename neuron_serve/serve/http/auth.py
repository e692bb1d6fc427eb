"""Optional bearer-token authentication for the HTTP apps.

Off unless a model.yaml has ``http.auth`` or ``$NEURON_SERVE_AUTH_TOKEN`` is set. When
on, every route except the health probes (``/v2/health/live``, ``/v2/health/ready``)
needs ``Authorization: Bearer <token>``; anything else gets 401 with a JSON error and a
``WWW-Authenticate`` header. Tokens are compared with ``hmac.compare_digest`` so the
time taken does not reveal how much of a guess was right.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Mapping

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from ...config.schema import AUTH_TOKEN_ENV, MIN_TOKEN_LENGTH, ModelConfig
from ...errors import ConfigError

OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="neuron-serve"'}

_token: str | None = None  # this process's required token; None: authentication off


def resolve_token(config: ModelConfig | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The token a deployment requires (None: auth off), from http.auth or the environment.

    Raises ConfigError naming the field when http.auth is set but its token is missing,
    unreadable or too short.
    """
    auth = config.http.auth if config is not None else None
    if auth is None:
        token, field = environ.get(AUTH_TOKEN_ENV) or None, f"${AUTH_TOKEN_ENV}"
        if token is None:
            return None
    elif auth.token_file is not None:
        field = "http.auth.token_file"
        try:
            token = Path(auth.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{field}: cannot read {auth.token_file!r} ({exc.strerror}); "
                              "point it at a file holding the token.") from None
    else:
        var = auth.token_env or AUTH_TOKEN_ENV
        field = "http.auth.token_env"
        token = environ.get(var, "")
        if not token:
            raise ConfigError(f"{field}: environment variable {var} is not set or empty; "
                              "set it to the bearer token clients must send.")
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(f"{field}: the token has {len(token)} characters; use at least "
                          f"{MIN_TOKEN_LENGTH} (e.g. `openssl rand -hex 32`).")
    return token


def token_env_vars(config: ModelConfig | None, token: str | None) -> dict[str, str]:
    """Environment a replica needs to resolve the same token as the deploying process."""
    if token is None:
        return {}
    auth = config.http.auth if config is not None else None
    if auth is not None and auth.token_file is not None:
        return {}  # the file is read where the replica runs (a mounted Secret)
    return {(auth.token_env if auth is not None and auth.token_env else AUTH_TOKEN_ENV): token}


def configure(token: str | None) -> None:
    """Set the token this process's apps require (None turns authentication off)."""
    global _token
    _token = token


def current_token() -> str | None:
    """The token this process's apps require now (None: authentication off)."""
    return _token


def authorized(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries exactly ``token`` as a Bearer credential."""
    scheme, _, given = (header or "").partition(" ")
    # Compared even when the scheme is wrong, so a bad scheme takes as long as a bad token.
    same = hmac.compare_digest(given.strip().encode(), token.encode())
    return scheme.lower() == "bearer" and same


class BearerAuth:
    """Pure ASGI middleware: 401 for a request without the configured token.

    Written against ASGI rather than as ``@app.middleware("http")``: Starlette's
    BaseHTTPMiddleware runs every request through an extra task and memory streams,
    which cost a visible share of a small model's request time whether auth is on or not.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Looked up through a module function, not a global: Ray Serve ships the app to
        # replicas by value, and each replica configures its own token.
        token = current_token()
        if token is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization")
        if authorized(header, token):
            await self.app(scope, receive, send)
            return
        problem = "missing Authorization header" if header is None else "invalid bearer token"
        message = f"unauthorized: {problem}; send 'Authorization: Bearer <token>'"
        # OpenAI's clients read OpenAI's error object on its routes; OIP's is a string.
        error = ({"message": message, "type": "authentication_error", "param": None, "code": "invalid_api_key"}
                 if "/v1/" in scope["path"] else message)
        response = JSONResponse({"error": error}, status_code=401, headers=CHALLENGE)
        await response(scope, receive, send)


def install(app: FastAPI) -> None:
    """Refuse requests to every non-health route of ``app`` without the configured token."""
    app.add_middleware(BearerAuth)
