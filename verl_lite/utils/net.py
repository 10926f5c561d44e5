"""Loopback networking helpers."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_PORTS_FLOOR = 20000  # above Ray's default worker ports (10002-19999)
_PICK_ATTEMPTS = 64
MIN_DRAW_RANGE = 1024  # a narrower room between the floor and the ephemeral range: the kernel picks
_RANDOM = random.SystemRandom()  # not the global generator: a seeded run would pick the same ports as its twin


def _ephemeral_low() -> int | None:
    """The lowest port the kernel hands to outgoing connections, or None where it cannot be read."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(host: str = "127.0.0.1", exclude: set[int] | frozenset[int] = frozenset()) -> int:
    """A TCP port free on ``host`` now, for a server that binds it soon after (a rendezvous, a Ray head). It is
    released before it is returned, so it is drawn at random from ``[LISTEN_PORTS_FLOOR, ephemeral low)``, below
    the range every outgoing connection draws from (Ray alone opens hundreds), and checked by binding it; a
    caller that still loses a race fails fast at rendezvous. Without room there: the kernel's ``bind(0)`` choice."""
    low = _ephemeral_low()
    if low is not None and low - LISTEN_PORTS_FLOOR >= MIN_DRAW_RANGE:
        for _ in range(_PICK_ATTEMPTS):
            port = _RANDOM.randrange(LISTEN_PORTS_FLOOR, low)
            if port not in exclude and _binds(host, port):
                return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in exclude:
            return port
