"""Free TCP ports that stay free until the server that was given them binds them.

A port from ``bind(("", 0))`` comes from the kernel's ephemeral range, the same range
every outgoing connection and every port-0 listener of an embedded Ray (tens of
processes starting during a deploy) draws from, so by the time HAProxy binds it,
seconds later, it can be taken ("Address already in use"). Ports are drawn instead
from a band that nothing of ours allocates from: above Ray's worker ports
(10002-19999 by default), below Serve's direct-ingress replica ports (30000 up) and
below the kernel's ephemeral range.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

BAND = (20000, 30000)  # [low, high)
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
ATTEMPTS = 200


def _band() -> tuple[int, int]:
    low, high = BAND
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return low, high
    return (low, min(high, ephemeral_low)) if ephemeral_low > low + 1000 else (low, high)


def free_port(host: str = "", avoid: Collection[int] = ()) -> int:
    """A TCP port nothing listens on now (on every interface by default), not in ``avoid``.

    ``avoid`` holds ports promised to something that has not bound them yet (the
    deploy's own --port and --grpc-port, bound by replicas seconds later): a free-looking
    port there would be handed out twice.
    """
    low, high = _band()
    rng = random.SystemRandom()  # processes started together must not draw the same sequence
    for _ in range(ATTEMPTS):
        port = rng.randrange(low, high)
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the band is full: let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]
