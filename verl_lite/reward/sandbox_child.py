"""The reward process (``verl_lite.reward.sandbox.RewardProcess`` starts and guards it): imports the user's reward
file ONCE and scores batches sent by the driver. Run by path, standard library only (nothing of verl_lite or
torch is imported unless the user's file does); it exits at the end of its input and dies with its guard
(``PR_SET_PDEATHSIG``). The user's prints go to stderr (fd 1 is re-pointed there).

Requests and replies over stdin/stdout, length-prefixed pickles:
    ("init", path, name, mode, kwarg_names, memory_limit_bytes | None) -> ("ready", signature_problem | None)
                            | ("load_error", "import" | "missing" | "not_callable", message | "" | type name)
    ("call", mode, texts, data_sources, ground_truths, extra_infos, kwargs)
        -> ("progress", i) per sample (naive mode), then
           ("ok", results) | ("raised", sample | None, type name, message, pickled exception | None)
           | ("bad_result", message)
"""

import ctypes
import importlib.util
import inspect
import os
import pickle
import resource
import signal
import struct
import sys

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


def call_reward(fn, mode: str, texts, data_sources, ground_truths, extra_infos, kwargs, on_sample=None):
    """One batch call of ``fn`` in the manager's ``mode``: naive calls it per sample (``on_sample(i)`` first),
    batch once with the lists."""
    if mode != "naive":
        return fn(data_sources=data_sources, solution_strs=texts, ground_truths=ground_truths,
                  extra_infos=extra_infos, **kwargs)
    results = []
    for i, text in enumerate(texts):
        if on_sample is not None:
            on_sample(i)
        results.append(fn(data_source=data_sources[i], solution_str=text, ground_truth=ground_truths[i],
                          extra_info=extra_infos[i], **kwargs))
    return results


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(f"verl_lite_user_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so pickled results/exceptions of its classes resolve
    spec.loader.exec_module(module)
    return getattr(module, name, None)


def _init(path: str, name: str, mode: str, kwarg_names: list, limit_bytes):
    """(the reward function or None, the reply to ``init``)."""
    try:
        if limit_bytes:
            resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))
        fn = _load(path, name)
    except BaseException as e:  # the user's file fails at import
        return None, ("load_error", "import", f"{type(e).__name__}: {e}")
    if fn is None:
        return None, ("load_error", "missing", "")
    if not callable(fn):
        return None, ("load_error", "not_callable", type(fn).__name__)
    return fn, ("ready", _signature_problem(fn, mode, kwarg_names))


def _score(out, fn, request) -> tuple:
    """The reply to one ``call`` request (``("progress", i)`` sent before each sample of a naive call)."""
    sample = []

    def progress(i: int) -> None:
        sample.append(i)
        _send(out, ("progress", i))

    try:
        results = call_reward(fn, *request, on_sample=progress)
        if request[0] != "naive":
            try:
                results = list(results)
            except TypeError:
                pass  # the driver reports the type
    except BaseException as e:  # report every failure of user code, SystemExit included
        try:
            payload = pickle.dumps(e)
        except Exception:
            payload = None
        return ("raised", sample[-1] if sample else None, type(e).__name__, str(e), payload)
    return ("ok", results)


def main() -> None:
    _die_with_parent()
    inp = os.fdopen(0, "rb")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # user prints (also from C code) go to stderr, never into the protocol
    sys.stdout = sys.stderr
    fn = None
    while (msg := _recv(inp)) is not None:
        if msg[0] == "init":
            fn, reply = _init(*msg[1:])
        else:
            reply = _score(out, fn, msg[1:])
        try:
            _send(out, reply)
        except Exception as e:  # results that cannot be pickled
            _send(out, ("bad_result", f"returned values that cannot be sent back ({type(e).__name__}: {e}); "
                                      f"return plain numbers or dicts of them"))
    sys.stderr.flush()
    os._exit(0)  # the driver closed the pipe, or died: the guard ends what the reward file started


if __name__ == "__main__":
    main()
