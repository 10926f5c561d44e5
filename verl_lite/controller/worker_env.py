"""The environment of a role's worker processes: ``OMP_NUM_THREADS`` (:func:`worker_threads`), glibc's heap
settings (:data:`HEAP_TUNABLES`), ``utils.quiet.worker_env`` and transformers' / the hub's / tqdm's quiet
switches. The local Ray started by ``local_ray.start_ray`` gives its workers :func:`role_env` of a one-process
role; ``WorkerGroup`` passes a ``runtime_env`` (built per actor by Ray's agent, which lengthens every actor
start) only when a role's environment differs from that.
"""

from __future__ import annotations

import os

from verl_lite.utils.quiet import worker_env

# glibc's malloc serves an allocation above its mmap threshold (dynamic, at most 32 MB by default) with a fresh
# mmap and unmaps it at free, so each of a train step's large activations is page-faulted in again, page by page,
# every time it is allocated. With allocations up to 1 GB served from the heap and up to 1 GB of its free top
# kept, a large train step reuses its pages at the price of a larger peak RSS (docs/performance.md). A
# GLIBC_TUNABLES of the user's own is kept as given; other C libraries ignore the variable.
HEAP_TUNABLES = "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824"


def worker_threads(concurrent_ranks: int) -> int:
    """Threads of one worker process: the cores split between the processes computing at the same time (colocated
    roles take turns), at most an inherited ``OMP_NUM_THREADS`` (never a reason to oversubscribe)."""
    threads = max(1, (os.cpu_count() or 1) // max(1, concurrent_ranks))
    inherited = os.environ.get("OMP_NUM_THREADS", "")
    return min(threads, int(inherited)) if inherited.isdigit() and int(inherited) > 0 else threads


def role_env(concurrent_ranks: int) -> dict[str, str]:
    """The environment variables of a role's workers, ``concurrent_ranks`` processes computing at once."""
    return {
        "OMP_NUM_THREADS": str(worker_threads(concurrent_ranks)),
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", HEAP_TUNABLES),
        **worker_env(),  # PYTHONWARNINGS, VLLM_LOGGING_LEVEL; all shown with --debug
        "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "error"),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TQDM_DISABLE": "1",
    }
