"""Running reward code where a hang or a crash cannot take the driver down, with a time bound per call.

- :class:`RewardProcess`: a user reward FILE, imported once in its own persistent process (``sandbox_child.py``)
  under a :class:`verl_lite.utils.processes.GuardedProcess`. A batch call waits at most ``timeout_s``; past it the
  process tree is killed and :class:`RewardCallFailed` names the sample it was stuck on; a process that dies fails
  the call at once, naming its exit status. ``reward.max_memory_gb`` holds twice: ``RLIMIT_DATA`` on the process
  (a leak of private memory is a ``MemoryError`` on its sample) and the guard's bound on the whole tree's
  proportional set size (shared memory and subprocesses included). Both messages name the limit and the key.
- :class:`InProcessReward`: a Python callable (the Python API's ``reward_fn``, or the built-in scorer) in a daemon
  thread of the driver, awaited with the same bound (:func:`call_bounded`); a call past it is abandoned.

Both return the raw results (one per sample, or the batched function's return value); the manager checks them.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from verl_lite.reward.sandbox_child import HEADER, _send, _signature_problem, call_reward
from verl_lite.utils.processes import GuardedProcess

CHILD = Path(__file__).with_name("sandbox_child.py")
START_TIMEOUT_S = 60.0  # importing a reward file (it may import torch, a tokenizer, ...)
MEMORY_KEY = "reward.max_memory_gb"
_LIVE: "set[RewardProcess]" = set()  # strong refs: a manager dropped mid-construction is still closed


def close_all() -> None:
    """Stop every reward process of this driver (the CLI calls it on the way out, whatever happened)."""
    for proc in list(_LIVE):
        proc.close()


class RewardCallFailed(Exception):
    """A reward call failed. ``kind``: raised | timeout | died | bad_result, or at start-up import | missing |
    not_callable (the message: the import error | "" | the type of what the name binds); ``sample``: index or None."""

    def __init__(self, kind: str, message: str, sample: int | None = None, cause: BaseException | None = None):
        super().__init__(message)
        self.kind, self.sample, self.cause = kind, sample, cause


def memory_limit_message(used_bytes: int | None, limit_gb: float) -> str:
    """The one message of a reward that reached its memory limit (``used_bytes``: what the guard measured)."""
    what = ("the reward process reached its memory limit" if used_bytes is None else
            f"the reward process and what it started reached {used_bytes / 2**30:.2f} GiB (shared memory and "
            f"subprocesses count), over its memory limit")
    return (f"MemoryError: {what} {MEMORY_KEY}={limit_gb:g} GiB; free what the function keeps between calls or "
            f"raise {MEMORY_KEY}")


def call_bounded(fn: Callable[[], Any], timeout_s: float | None, thread_name: str) -> concurrent.futures.Future:
    """``fn()`` in a daemon thread, awaited at most ``timeout_s`` seconds (None: no bound); returns its
    finished future (its result or the exception ``fn`` raised). Past the bound raises
    :class:`concurrent.futures.TimeoutError` and abandons the thread (a daemon: it never holds up the
    driver's exit, which an executor's worker would). A signal handler's exception raised while
    waiting propagates as it is (it is never taken for ``fn``'s failure)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target():
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to the caller through the future
            future.set_exception(e)

    threading.Thread(target=target, name=thread_name, daemon=True).start()
    done, _ = concurrent.futures.wait([future], timeout=timeout_s)
    if not done:
        raise concurrent.futures.TimeoutError(f"did not return within {timeout_s}s")
    return future


class InProcessReward:
    """A callable awaited in a daemon thread for at most ``timeout_s`` per call."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def signature_problem(self, mode: str, kwarg_names: list[str]) -> str | None:
        return _signature_problem(self.fn, mode, kwarg_names)

    def __call__(self, mode, texts, data_sources, ground_truths, extra_infos, kwargs, timeout_s: float | None):
        started: list[int] = []  # the samples begun (naive mode)
        try:
            future = call_bounded(lambda: call_reward(self.fn, mode, texts, data_sources, ground_truths, extra_infos,
                                                      kwargs, started.append), timeout_s, "verl_lite-reward")
        except concurrent.futures.TimeoutError:
            raise RewardCallFailed("timeout", f"did not return within {timeout_s}s",
                                   sample=started[-1] if started else None) from None
        if (e := future.exception()) is not None:
            raise RewardCallFailed("raised", f"{type(e).__name__}: {e}", started[-1] if started else None, e)
        return future.result()

    def close(self) -> None:
        pass


class RewardProcess:
    """The reward file ``path``:``name`` in its own process (see module docstring)."""

    def __init__(self, path: str, name: str, mode: str, kwarg_names: list[str], max_memory_gb: float | None = None):
        self.path, self.name, self.mode, self.kwarg_names = str(path), name, mode, list(kwarg_names)
        self.max_memory_gb = max_memory_gb if max_memory_gb is not None and max_memory_gb > 0 else None
        self.proc: subprocess.Popen | None = None
        self.guard: GuardedProcess | None = None
        self.signature = None
        self._start()

    def _start(self) -> None:
        _LIVE.add(self)
        limit = int(self.max_memory_gb * 2**30) if self.max_memory_gb else None
        self.guard = GuardedProcess([sys.executable, "-u", str(CHILD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"), memory_limit_bytes=limit)
        self.proc = self.guard.proc
        self._send(("init", self.path, self.name, self.mode, self.kwarg_names, limit))
        reply = self._recv(time.monotonic() + START_TIMEOUT_S, during="importing the reward file")
        if reply[0] == "load_error":
            self.close()
            raise RewardCallFailed(reply[1], reply[2])
        self.signature = reply[1]

    def pid(self) -> int | None:
        """The pid of the reward process's guard (its parent; the reward process tree is below it)."""
        return self.proc.pid if self.proc is not None else None

    def close(self) -> None:
        """End the reward process and everything it started (idempotent)."""
        _LIVE.discard(self)
        guard, self.proc, self.guard = self.guard, None, None
        if guard is not None:
            guard.stop()

    def _send(self, message) -> None:
        try:
            _send(self.proc.stdin, message)
        except (BrokenPipeError, OSError):
            pass  # the process died; _recv reports how

    def _read_exact(self, n: int, deadline: float, during: str, sample) -> bytes:
        fd = self.proc.stdout.fileno()
        chunks, got = [], 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RewardCallFailed("timeout", "timeout", sample=sample)
            ready, _, _ = select.select([fd], [], [], min(remaining, 1.0))
            if not ready:
                continue
            chunk = os.read(fd, n - got)
            if not chunk:
                self._died(during, sample)
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _died(self, during: str, sample) -> None:
        """Raise what ended the process (the guard ends the rest of the tree first, bounded)."""
        code = self.proc.wait(timeout=30.0)
        used = self.guard.memory_used()
        if used is not None:
            raise RewardCallFailed("raised", memory_limit_message(used, self.max_memory_gb), sample=sample)
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        limit = (f" (its memory limit is {MEMORY_KEY}={self.max_memory_gb:g} GiB)"
                 if self.max_memory_gb and code < 0 else "")  # a failed allocation in C code can crash it
        raise RewardCallFailed("died", f"the reward process {how} while {during}{limit}", sample=sample)

    def _recv(self, deadline: float, during: str, sample=None):
        (n,) = HEADER.unpack(self._read_exact(HEADER.size, deadline, during, sample))
        return pickle.loads(self._read_exact(n, deadline, during, sample))

    def signature_problem(self, mode: str, kwarg_names: list[str]) -> str | None:
        return self.signature

    def __call__(self, mode, texts, data_sources, ground_truths, extra_infos, kwargs, timeout_s: float | None):
        if self.proc is None:  # killed by an earlier timeout: start afresh
            self._start()
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
        self._send(("call", mode, list(texts), list(data_sources), list(ground_truths), list(extra_infos),
                    dict(kwargs)))
        sample = None
        try:
            while (reply := self._recv(deadline, during="scoring", sample=sample))[0] == "progress":
                sample = reply[1]
        except RewardCallFailed as e:
            self.close()
            if e.kind == "timeout":
                raise RewardCallFailed("timeout", f"did not return within {timeout_s}s", sample=sample) from None
            raise
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "bad_result":
            raise RewardCallFailed("bad_result", reply[1])
        _, sample, type_name, message, payload = reply
        if type_name == "MemoryError" and self.max_memory_gb:
            raise RewardCallFailed("raised", memory_limit_message(None, self.max_memory_gb), sample=sample)
        try:
            cause = pickle.loads(payload) if payload is not None else None
        except Exception:
            cause = None
        raise RewardCallFailed("raised", f"{type_name}: {message}", sample=sample, cause=cause)
