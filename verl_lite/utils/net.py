"""Loopback networking helpers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (for a torch.distributed rendezvous).

    The port is released before it is returned, so another process could take it first; callers
    that lose that race fail fast at rendezvous (process groups have timeouts), they do not hang.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
