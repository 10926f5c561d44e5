"""The environment of a role's worker processes.

Every worker gets: ``OMP_NUM_THREADS`` (:func:`worker_threads`), glibc's heap settings
(:data:`HEAP_TUNABLES`), the quiet flags of ``utils.quiet.worker_env`` (``PYTHONWARNINGS``,
``VLLM_LOGGING_LEVEL``, the debug flag) and transformers' / the hub's / tqdm's quiet switches. Two ways
to give it:

- an actor's ``runtime_env``: Ray's runtime-env agent builds an environment for the actor, and no idle
  worker can serve it, which lengthens every actor start;
- inheritance: the local Ray started by this process (``local_ray.start_ray``) starts its raylet with
  :func:`role_env` of a one-process role in the environment, and every worker it starts inherits it.

``WorkerGroup`` passes a ``runtime_env`` only when the role's environment differs from what its workers
inherit (a joined cluster: always; the local Ray: a role with other threads, or an environment that changed
since Ray started).
"""

from __future__ import annotations

import os

from verl_lite.utils.quiet import worker_env


# glibc's malloc serves an allocation above its mmap threshold (dynamic, at most 32 MB by default) with a
# fresh mmap and unmaps it at free, so each of a train step's large activations ([tokens, 2 x ffn] fp32 is
# 100 MB at bench/rl_step_vs_trl.py's compute point) is page-faulted in again, page by page, every time it
# is allocated. With allocations up to 1 GB served from the (main-thread) heap and up to 1 GB of its free
# top kept, a large train step reuses its pages (far fewer page faults) at the price of a larger peak RSS;
# the measured effect on the train step is in docs/performance.md.
# A GLIBC_TUNABLES of the user's own is kept as given. Other C libraries ignore the variable.
HEAP_TUNABLES = "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824"


def worker_threads(concurrent_ranks: int) -> int:
    """Threads of one worker process: the machine's cores split between the processes that compute at the
    same time (roles colocated on one rank take turns, so each may use the cores its peers leave), at most
    an inherited ``OMP_NUM_THREADS`` (an upper bound, never a reason to oversubscribe: with split placement on
    2 cores, an inherited 2 gave the actor and the rollout worker 2 threads each, and the one-step-off job
    ran far slower than with the rollout worker at 1 thread)."""
    threads = max(1, (os.cpu_count() or 1) // max(1, concurrent_ranks))
    inherited = os.environ.get("OMP_NUM_THREADS", "")
    return min(threads, int(inherited)) if inherited.isdigit() and int(inherited) > 0 else threads


def role_env(concurrent_ranks: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables of a role's workers, ``concurrent_ranks`` processes computing at once."""
    return {
        "OMP_NUM_THREADS": str(worker_threads(concurrent_ranks)),
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", HEAP_TUNABLES),
        # quiet workers: library warnings and progress bars once per process add nothing
        **worker_env(),  # PYTHONWARNINGS, VLLM_LOGGING_LEVEL; all shown with --debug
        "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "error"),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TQDM_DISABLE": "1",
        **(extra or {}),
    }
