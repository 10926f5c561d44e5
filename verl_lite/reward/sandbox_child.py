"""The reward process: imports the user's reward file ONCE and scores batches sent by the driver.

Run by path (``python sandbox_child.py``, standard library only, so nothing of verl_lite or torch
is imported unless the user's file does). Protocol over stdin/stdout: length-prefixed pickles
(see ``verl_lite.reward.sandbox``). The user's prints go to stderr (fd 1 is re-pointed there).
The driver starts it under a guard (``verl_lite/utils/process_guard.py``), which ends whatever the
reward file started when this process exits, when the driver closes it and when the driver dies; this
process exits at the end of its input (the driver's close, or its death) and dies with its guard
(``PR_SET_PDEATHSIG``). The memory limit (``RLIMIT_DATA``) is set before the file is imported; the guard
holds the whole tree's memory under the same limit.

Requests and replies:
    ("init", path, name, mode, kwarg_names, memory_limit_bytes | None) -> ("ready", signature_problem | None)
                                             | ("load_error", "import", message)
                                             | ("load_error", "missing", "" | type name of a non-callable)
    ("call", mode, texts, data_sources, ground_truths, extra_infos, kwargs)
        -> ("progress", i) per sample (naive mode), then
           ("ok", results) | ("raised", sample | None, type name, message, pickled exception | None, traceback)
           | ("bad_result", message)
"""

import ctypes
import resource
import importlib.util
import inspect
import os
import pickle
import signal
import struct
import sys
import traceback

HEADER = struct.Struct("<Q")


def _die_with_parent() -> None:
    """The guard's death -> SIGKILL here (Linux; the guard ends this process's descendants itself)."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the guard died before the prctl took effect
        os._exit(1)


def _limit_memory(limit_bytes) -> None:
    if limit_bytes:
        resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))


def _send(out, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(HEADER.pack(len(data)) + data)
    out.flush()


def _recv(inp):
    header = inp.read(HEADER.size)
    if len(header) < HEADER.size:
        return None  # the driver closed the pipe
    (n,) = HEADER.unpack(header)
    return pickle.loads(inp.read(n))


def _signature_problem(fn, mode: str, kwarg_names: list) -> str | None:
    """Why fn cannot be called the way the manager calls it with these reward_kwargs (None = it can)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # builtins etc.: cannot tell, let the call decide
    names = (["data_source", "solution_str", "ground_truth", "extra_info"] if mode == "naive"
             else ["data_sources", "solution_strs", "ground_truths", "extra_infos"])
    try:
        sig.bind(**{k: None for k in names + list(kwarg_names)})
    except TypeError as e:
        return f"{e} (the function's signature is {sig}; it is called with {names + list(kwarg_names)})"
    return None


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(f"verl_lite_user_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so pickled results/exceptions of its classes resolve
    spec.loader.exec_module(module)
    return getattr(module, name, None)


def _exception_payload(e: BaseException):
    try:
        return pickle.dumps(e)
    except Exception:
        return None


def main() -> None:
    _die_with_parent()
    inp = os.fdopen(0, "rb")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # user prints (also from C code) go to stderr, never into the protocol
    sys.stdout = sys.stderr
    fn = None
    while True:
        msg = _recv(inp)
        if msg is None:  # the driver closed the pipe, or died: the guard ends what the reward file started
            sys.stderr.flush()
            os._exit(0)
        if msg[0] == "init":
            _, path, name, mode, kwarg_names, limit_bytes = msg
            try:
                _limit_memory(limit_bytes)
                fn = _load(path, name)
            except BaseException as e:  # the user's file fails at import
                _send(out, ("load_error", "import", f"{type(e).__name__}: {e}"))
                continue
            if not callable(fn):
                _send(out, ("load_error", "missing", "" if fn is None else type(fn).__name__))
                continue
            _send(out, ("ready", _signature_problem(fn, mode, kwarg_names)))
            continue
        _, mode, texts, data_sources, ground_truths, extra_infos, kwargs = msg
        sample = None
        try:
            if mode == "naive":
                results = []
                for i, text in enumerate(texts):
                    sample = i
                    _send(out, ("progress", i))
                    results.append(fn(data_source=data_sources[i], solution_str=text, ground_truth=ground_truths[i],
                                      extra_info=extra_infos[i], **kwargs))
                sample = None
            else:
                results = fn(data_sources=data_sources, solution_strs=texts, ground_truths=ground_truths,
                             extra_infos=extra_infos, **kwargs)
                try:
                    results = list(results)
                except TypeError:
                    pass  # the driver reports the type
        except BaseException as e:  # report every failure of user code, SystemExit included
            _send(out, ("raised", sample, type(e).__name__, str(e), _exception_payload(e), traceback.format_exc()))
            continue
        try:
            _send(out, ("ok", results))
        except Exception as e:  # results that cannot be pickled
            _send(out, ("bad_result", f"returned values that cannot be sent back ({type(e).__name__}: {e}); "
                                      f"return plain numbers or dicts of them"))


if __name__ == "__main__":
    main()
