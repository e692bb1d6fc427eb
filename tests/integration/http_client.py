"""A small HTTP client for the reliability tests: keep-alive connections per thread,
raw bodies and headers (the tests send what no well-behaved client would)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float

    def json(self):
        return json.loads(self.body)


class Client:
    """Sends requests to one server over a keep-alive connection per thread."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30, keep_alive: bool = True):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.token = token
        self.timeout = timeout
        # Without keep-alive every request has its own connection, so a dropped
        # connection always means a dropped request, never a stale idle socket.
        self.keep_alive = keep_alive
        self._local = threading.local()
        self._lock = threading.Lock()
        self._opened: list[http.client.HTTPConnection] = []

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            with self._lock:
                self._opened.append(conn)
        return conn

    def close(self) -> None:
        """Close every connection opened so far (a closed one reopens on next use)."""
        with self._lock:
            for conn in self._opened:
                conn.close()
            # kept: a closed connection reopens on its next request and must be closed again

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                auth: bool = True, chunked: bool = False) -> Answer:
        """One request; raises OSError/HTTPException when the connection fails."""
        headers = dict(headers or {})
        if auth and self.token is not None:
            headers.setdefault("Authorization", f"Bearer {self.token}")
        conn = self._connection()
        started = time.perf_counter()
        try:
            if chunked:
                conn.request(method, path, body=iter([body[i:i + 8192] for i in range(0, len(body), 8192)]),
                             headers=headers, encode_chunked=True)
            else:
                conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except BaseException:
            conn.close()
            self._local.conn = None
            raise
        if not self.keep_alive or response.getheader("connection", "").lower() == "close":
            conn.close()
            self._local.conn = None
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, data,
                      time.perf_counter() - started)

    def infer(self, model: str, body: bytes | dict, headers: dict | None = None, **kwargs) -> Answer:
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        return self.request("POST", f"/v2/models/{model}/infer", body, headers, **kwargs)


def infer_body(rows: list[list[float]], name: str = "x") -> dict:
    """The JSON infer request of one FP32 input."""
    return {"inputs": [{"name": name, "datatype": "FP32", "shape": [len(rows), len(rows[0])],
                        "data": [v for row in rows for v in row]}]}


def outputs(answer: Answer) -> list[list[float]]:
    """The first output of a JSON infer answer, as rows."""
    out = answer.json()["outputs"][0]
    width = out["shape"][1]
    return [out["data"][i:i + width] for i in range(0, len(out["data"]), width)]
