"""The torch.distributed rendezvous store, listening on loopback when the rendezvous address is loopback.

``init_method="tcp://127.0.0.1:port"`` makes rank 0's TCPStore listen on every interface. Here rank 0 binds the
listening socket itself, on ``master_addr``, and hands it to the store (``master_listen_fd``), so a local run
exposes nothing beyond 127.0.0.1. Other addresses (a multi-node cluster) get the ordinary store.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def rendezvous_store(master_addr: str, master_port: int, rank: int, world_size: int, timeout: timedelta):
    """A ``TCPStore`` for ``init_process_group(store=...)``; rank 0 hosts it (see module docstring)."""
    import torch.distributed as dist

    listen_fd = None
    if rank == 0 and is_loopback(master_addr):
        family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((master_addr, master_port))
        sock.listen(max(128, world_size))
        listen_fd = sock.detach()  # the store owns the descriptor from here on
    return dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout,
                         wait_for_workers=False, master_listen_fd=listen_fd)
