"""Stopping processes by pid (never by name: other users' and other runs' processes stay alone)."""

from __future__ import annotations

import psutil


def kill_and_wait(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """SIGKILL every process of ``procs`` (gone ones are skipped) and wait up to ``timeout_s`` for
    them to exit; returns those still alive."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return alive
