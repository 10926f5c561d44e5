"""The ranks of a multi-process test, started from a fork server that has imported torch, megatron-core and
transformers once (``multiprocessing``'s ``forkserver`` with a preload), instead of a fresh interpreter per rank
that imports them again: on a CPU machine that import is most of a short launch's cost.

As with ``spawn``, a rank gets the launching process's ``sys.path`` and working directory at the launch
(multiprocessing's preparation data) and its arguments pickled; the environment is the one thing a fork server's
child would take from the server (as it was when the server started), so ``start_ranks`` passes the launching
process's environment along and the rank sets it before running. The server only imports: no rank state, RNG or
thread lives there.

- ``start_ranks(fn, args, nprocs)``: ``torch.multiprocessing.spawn(fn, args, nprocs)`` with that start method;
- ``context()``: the ``multiprocessing`` context, for code that manages its processes itself (wrap their target
  with ``with_launch_env``).
"""

from __future__ import annotations

import multiprocessing
import os

import torch.multiprocessing as torch_mp

PRELOAD = ("torch", "megatron.core", "transformers")


def context():
    """The forkserver context, its server (started on first use) preloading ``PRELOAD``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def with_launch_env(rank: int, env: dict, fn, args: tuple):
    """Run ``fn(rank, *args)`` in the launching process's environment ``env``."""
    os.environ.clear()
    os.environ.update(env)
    return fn(rank, *args)


def start_ranks(fn, args: tuple = (), nprocs: int = 1, join: bool = True):
    """``torch.multiprocessing.spawn`` from the preloaded fork server: ``fn(rank, *args)`` in ``nprocs`` processes;
    an exception in any rank fails the launch (the others are terminated)."""
    context()
    return torch_mp.start_processes(with_launch_env, args=(dict(os.environ), fn, tuple(args)), nprocs=nprocs,
                                    join=join, start_method="forkserver")
