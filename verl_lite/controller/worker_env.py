"""The environment of a role's worker processes (:func:`role_env`). The local Ray gives its workers a one-process
role's; ``WorkerGroup`` passes a ``runtime_env`` (which lengthens every actor start) only for a role that differs.
"""

from __future__ import annotations

import os

from verl_lite.utils.quiet import worker_env

# glibc serves allocations above its mmap threshold (at most 32 MB) by fresh mmaps, page-faulted in again at every
# allocation; serving up to 1 GB from the heap and keeping 1 GB of its free top reuses a train step's pages at the
# price of a larger peak RSS (docs/performance.md). A user's own GLIBC_TUNABLES is kept.
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
