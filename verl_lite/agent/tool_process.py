"""Tool calls in processes of their own, so a tool that never returns, busy or blocked, can be stopped.

:class:`ToolProcessPool` keeps at most ``size`` reusable tool processes (``python -m
verl_lite.agent.tool_process``), each a :class:`verl_lite.utils.processes.GuardedProcess`: a call past its
timeout kills its process tree, and the next call that needs a process starts a fresh one. The pool waits on the
pipes in the caller's event loop (no thread). A call's time counts from its submission, less the start-up of a
process started for it, so a call still waiting for a free process at its deadline is a timeout too.

Protocol over stdin/stdout, length-prefixed frames: to the process, first the run's tools pickled by cloudpickle,
then one JSON object per call, ``{"tool": name, "arguments": {...}}``; from the process, JSON only (nothing a
tool returns is unpickled here): ``{"ready": true}`` or ``{"load_error": message}`` once, then per call
``{"text": str, "reward": float | null}`` or ``{"error": "TypeName: message"}``. Each process has its own copy
of every tool: state a class tool keeps in its instance is per process.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import weakref
from collections import deque

HEADER = struct.Struct("<Q")
START_TIMEOUT_S = 60.0  # a tool process imports the tools' modules before its first call
MAX_FRAME_BYTES = 256 << 20  # a reply beyond this is refused (the response is truncated afterwards anyway)
POOL_SIZE = max(4, min(16, os.cpu_count() or 1))


class ToolCallTimeout(Exception):
    """The call passed its timeout; its process was killed."""


class ToolProcessDied(Exception):
    """The tool process ended in the middle of a call (``os._exit``, a crash, the OOM killer)."""


class ToolProcessStartError(Exception):
    """A tool process could not load the tools, or did not start within :data:`START_TIMEOUT_S`."""


def pickled_tools(tools: list) -> bytes:
    """The tools as the first frame a tool process reads (raises what pickling raises)."""
    import cloudpickle  # tensordict's dependency; not Ray's vendored copy (importing it imports Ray)

    return cloudpickle.dumps(list(tools))


def _child_env() -> dict[str, str]:
    """This process's environment, with its import path: a tool pickled by reference (a function of an importable
    module) imports in the tool process from where it was imported here."""
    path = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def _frame(data: bytes) -> bytes:
    return HEADER.pack(len(data)) + data


# ============================================================================================== parent side
class ToolProcess:
    """One guarded tool process; :meth:`receive` waits for its next reply in the running event loop."""

    def __init__(self, payload: bytes):
        from verl_lite.utils.processes import GuardedProcess  # psutil: only when a tool process starts

        self.guard = GuardedProcess([sys.executable, "-u", "-m", "verl_lite.agent.tool_process"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_child_env())
        self.stdout_fd = self.guard.proc.stdout.fileno()
        os.set_blocking(self.stdout_fd, False)
        self.buffer = bytearray()
        self.send(payload)

    def send(self, data: bytes) -> None:
        try:
            self.guard.proc.stdin.write(_frame(data))
            self.guard.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died; receive() reports how

    def _take_frame(self) -> bytes | None:
        if len(self.buffer) < HEADER.size:
            return None
        (n,) = HEADER.unpack(self.buffer[:HEADER.size])
        if n > MAX_FRAME_BYTES:
            raise ToolProcessDied(f"its reply is {n} bytes, over the {MAX_FRAME_BYTES}-byte bound")
        if len(self.buffer) < HEADER.size + n:
            return None
        data = bytes(self.buffer[HEADER.size:HEADER.size + n])
        del self.buffer[:HEADER.size + n]
        return data

    async def receive(self, deadline: float) -> dict:
        """The next reply; :class:`ToolCallTimeout` at ``deadline`` (the loop's clock), :class:`ToolProcessDied`
        at the end of its output."""
        loop = asyncio.get_running_loop()
        while (data := self._take_frame()) is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ToolCallTimeout()
            readable = loop.create_future()
            loop.add_reader(self.stdout_fd, lambda: readable.done() or readable.set_result(None))
            try:
                await asyncio.wait_for(readable, remaining)
            except asyncio.TimeoutError:
                raise ToolCallTimeout() from None
            finally:
                loop.remove_reader(self.stdout_fd)
            try:
                chunk = os.read(self.stdout_fd, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                code = self.guard.proc.wait()  # the guard ends the rest of the tree first (bounded)
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                raise ToolProcessDied(f"its tool process {how}")
            self.buffer += chunk
        return json.loads(data)

    def kill(self) -> None:
        """End the process and everything it started (idempotent)."""
        self.guard.stop()


def _kill_all(processes: set) -> None:
    for p in list(processes):
        p.kill()
    processes.clear()


class ToolProcessPool:
    """At most ``size`` reusable tool processes for ``tools`` (see module docstring)."""

    def __init__(self, tools: list, size: int = POOL_SIZE):
        self.payload, self.size = pickled_tools(tools), size
        self.idle: list[ToolProcess] = []
        self.processes: set[ToolProcess] = set()  # every live one: idle, busy or starting
        self.waiters: deque[asyncio.Future] = deque()
        self._finalizer = weakref.finalize(self, _kill_all, self.processes)

    def close(self) -> None:
        """Kill every tool process (idempotent; also done when the pool is collected)."""
        self.idle.clear()
        self._finalizer()

    async def warm(self) -> None:
        """Start every process the pool may hold, concurrently, before the first calls need them: calls then
        never wait on a start-up (and a tool module that cannot load is reported before any rollout)."""
        missing = self.size - len(self.processes)
        if missing > 0:
            started = await asyncio.gather(*(self._start() for _ in range(missing)))
            for proc in started:
                self._handover(proc)

    async def call(self, name: str, arguments: dict, timeout_s: float) -> dict:
        """The tool process's reply to one call (see module docstring); raises :class:`ToolCallTimeout`,
        :class:`ToolProcessDied` or :class:`ToolProcessStartError`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        proc, start_up_s = await self._acquire(deadline)
        request = json.dumps({"tool": name, "arguments": arguments}).encode()
        try:
            proc.send(request)
            reply = await proc.receive(deadline + start_up_s)
        except BaseException:  # a timeout, its death, or the caller's cancellation mid-call: the process goes
            self._discard(proc)
            raise
        self._handover(proc)
        return reply

    async def _acquire(self, deadline: float) -> tuple[ToolProcess, float]:
        """An idle process, a new one (with its start-up time), or the next one freed before ``deadline``."""
        loop = asyncio.get_running_loop()
        while True:
            if self.idle:
                return self.idle.pop(), 0.0
            if len(self.processes) < self.size:
                started = loop.time()
                return await self._start(), loop.time() - started
            freed = loop.create_future()
            self.waiters.append(freed)
            try:
                got = await asyncio.wait_for(freed, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise ToolCallTimeout(f"every one of the {self.size} tool processes was busy") from None
            except BaseException:
                if freed.done() and not freed.cancelled():
                    self._handover(freed.result())
                raise
            finally:
                if freed in self.waiters:
                    self.waiters.remove(freed)
            if got is not None:
                return got, 0.0

    async def _start(self) -> ToolProcess:
        proc = ToolProcess(self.payload)
        self.processes.add(proc)
        try:
            reply = await proc.receive(asyncio.get_running_loop().time() + START_TIMEOUT_S)
        except BaseException as e:
            self._discard(proc)
            if isinstance(e, (ToolCallTimeout, ToolProcessDied)):
                raise ToolProcessStartError(f"a tool process did not start within {START_TIMEOUT_S:g}s"
                                            if isinstance(e, ToolCallTimeout) else f"{e} while loading the tools")
            raise
        if "load_error" in reply:
            self._discard(proc)
            raise ToolProcessStartError(f"a tool process could not load the tools: {reply['load_error']}")
        return proc

    def _handover(self, proc: ToolProcess | None) -> None:
        """``proc`` (None: a free slot) to the first caller still waiting, else ``proc`` to the idle list."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(proc)
                return
        if proc is not None:
            self.idle.append(proc)

    def _discard(self, proc: ToolProcess) -> None:
        self.processes.discard(proc)
        proc.kill()
        self._handover(None)


# ============================================================================================== child side
def _read_frame(inp) -> bytes | None:
    header = inp.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (n,) = HEADER.unpack(header)
    return inp.read(n)


def _send(out, message: dict) -> None:
    out.write(_frame(json.dumps(message).encode()))
    out.flush()


def _serve(inp, out) -> None:
    import pickle

    payload = _read_frame(inp)
    if payload is None:
        return
    try:
        tools = {t.name: t for t in pickle.loads(payload)}
    except BaseException as e:  # a tool's module cannot be imported here, a class tool's constructor raises, ...
        _send(out, {"load_error": f"{type(e).__name__}: {e}"})
        return
    _send(out, {"ready": True})
    while (frame := _read_frame(inp)) is not None:
        request = json.loads(frame)
        try:
            result = tools[request["tool"]].invoke(request["arguments"])
            reply = {"text": result.text, "reward": result.reward}
        except BaseException as e:  # every failure of user code, SystemExit included, is the call's error
            reply = {"error": f"{type(e).__name__}: {e}"}
        _send(out, reply)


def main() -> None:
    inp = os.fdopen(0, "rb")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a tool's prints (also from C code) go to stderr, never into the protocol
    sys.stdout = sys.stderr
    _serve(inp, out)
    sys.stderr.flush()
    os._exit(0)  # the end of its input: the pool closed it (the guard ends what the tools started)


if __name__ == "__main__":
    main()
