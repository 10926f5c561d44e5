"""The libraries' console noise: quiet by default, all of it back with ``--debug`` / ``VERL_LITE_DEBUG=1``.

Quieted: megatron-core's import-time warnings about optional kernels and its own deprecations; Ray's "Token
authentication is enabled" notice (the authentication stays on); vLLM's INFO/WARNING logging.
:func:`quiet_process` filters them in the driver; :func:`worker_env` gives every Ray worker
``PYTHONWARNINGS=ignore``, ``VLLM_LOGGING_LEVEL=ERROR`` and the debug flag (``controller/worker_env.py``), so
whatever a worker spawns is quiet too. A value the user set in the environment wins. In debug mode nothing is
filtered: workers get ``PYTHONWARNINGS=default`` and vLLM's own level.
"""

from __future__ import annotations

import logging
import os
import warnings

from verl_lite.compat.ray_names import TOKEN_SETUP_LOGGER

DEBUG_ENV = "VERL_LITE_DEBUG"

# (message regex, category): emitted from megatron modules only (MEGATRON_MODULE)
MEGATRON_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"(Transformer Engine and )?Apex (is|are) not installed", UserWarning),
    (r"full scope is deprecated", UserWarning),
    (r"The following imports from `dynamic_context\.py`", DeprecationWarning),
    (r"MLP requires ffn_hidden_size", DeprecationWarning),
    (r"Warning: tp_group is None", DeprecationWarning),
)
MEGATRON_MODULE = r"megatron(\.|$)"

RAY_TOKEN_LOGGER = TOKEN_SETUP_LOGGER
RAY_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"
# vLLM logs (with its traceback) a ValueError it raised and caught itself when an engine runs with
# skip_tokenizer_init=True, which the rollout sets on purpose (token ids in, token ids out)
VLLM_BENIGN = ("Tokenizer not available when skip_tokenizer_init=True",)


def _not_ray_token_notice(record: logging.LogRecord) -> bool:  # a logging filter: False drops the record
    return not str(record.msg).startswith(RAY_TOKEN_NOTICE)


def _not_vllm_benign(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    text = str(record.msg) if exc is None else f"{record.msg} {exc}"
    return not any(m in text for m in VLLM_BENIGN)


_state = {"debug": None}


def debugging(debug: bool | None = None) -> bool:
    """``debug`` when given, else whether ``VERL_LITE_DEBUG`` is set to anything but ''/'0'."""
    return bool(debug) if debug is not None else os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _remove_our_warning_filters() -> None:
    """Drop the filters :func:`quiet_process` added, through the public API only: ``resetwarnings`` empties the
    list and marks the filters changed, then the other filters go back in their order."""
    kept = [f for f in warnings.filters
            if not (f[0] == "ignore" and f[1] is not None and (f[1].pattern, f[2]) in MEGATRON_WARNINGS)]
    warnings.resetwarnings()
    warnings.filters[:] = kept


def quiet_process(debug: bool | None = None) -> bool:
    """Quiet (debugging: un-quiet) the known library messages here, idempotent; returns whether debugging."""
    debug = debugging(debug)
    _state["debug"] = debug
    ray_logger = logging.getLogger(RAY_TOKEN_LOGGER)
    _remove_our_warning_filters()
    ray_logger.removeFilter(_not_ray_token_notice)
    if not debug:
        for message, category in MEGATRON_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category, module=MEGATRON_MODULE)
        ray_logger.addFilter(_not_ray_token_notice)
    return debug


def _resolved(debug: bool | None) -> bool:
    """``debug`` when given, else this process's last :func:`quiet_process` choice, else the env var."""
    return _state["debug"] if debug is None and _state["debug"] is not None else debugging(debug)


def worker_env(debug: bool | None = None) -> dict[str, str]:
    """Environment variables for a Ray worker: quiet libraries unless debugging (:func:`_resolved`)."""
    debug = _resolved(debug)
    env = {DEBUG_ENV: "1" if debug else "0",
           "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "default" if debug else "ignore")}
    if "VLLM_LOGGING_LEVEL" in os.environ or not debug:
        env["VLLM_LOGGING_LEVEL"] = os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")
    return env


def quiet_vllm(debug: bool | None = None) -> None:
    """Call before ``import vllm`` (its log level to ERROR unless debugging or set) and after it (the known
    benign records dropped at vLLM's handlers: its loggers do not propagate to the root)."""
    if _resolved(debug):
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for handler in logging.getLogger("vllm").handlers:
        if _not_vllm_benign not in handler.filters:
            handler.addFilter(_not_vllm_benign)
