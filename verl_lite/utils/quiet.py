"""The libraries' console noise: quiet by default, all of it back with ``--debug`` / ``VERL_LITE_DEBUG=1``.

What a run would otherwise print on every start, none of it actionable for the user:

- megatron-core's import-time ``UserWarning``/``DeprecationWarning``\\ s ("Transformer Engine and Apex
  are not installed. Falling back to ...", "Apex is not installed", "full scope is deprecated", ...);
- Ray's "Token authentication is enabled for this Ray cluster" line at ``ray.init``. Token
  authentication itself stays on: only that notice is dropped ("... is disabled ..." still shows);
- vLLM's INFO/WARNING logging (engine set-up, every weight sync).

Two places apply it:

- :func:`quiet_process` in the driver (``main_ppo``): ``warnings`` filters for the known megatron
  messages (by message and module) and a filter on Ray's token-setup logger;
- :func:`worker_env` for every Ray worker (``controller/worker_env.py``: the environment the local Ray's
  workers inherit, or the actor's ``runtime_env`` env vars): ``PYTHONWARNINGS=ignore``, ``VLLM_LOGGING_LEVEL=ERROR`` and the debug
  flag itself, so a worker and whatever it spawns are quiet too. A value the user set in the
  environment wins.

In debug mode nothing is filtered: the driver drops its filters, workers get ``PYTHONWARNINGS=default``
and vLLM's own log level.
"""

from __future__ import annotations

import logging
import os
import warnings

from verl_lite.compat.ray_names import TOKEN_SETUP_LOGGER

DEBUG_ENV = "VERL_LITE_DEBUG"

# (message regex, category): megatron-core's warnings about optional accelerated kernels and
# its own deprecations; emitted from megatron modules only (the module regex below)
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

_OURS = {(msg, cat) for msg, cat in MEGATRON_WARNINGS}


def debugging(debug: bool | None = None) -> bool:
    """``debug`` when given, else whether ``VERL_LITE_DEBUG`` is set to anything but ''/'0'."""
    if debug is not None:
        return bool(debug)
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class _DropRayTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(RAY_TOKEN_NOTICE)


_RAY_FILTER = _DropRayTokenNotice()
_state = {"debug": None}


def _remove_our_warning_filters() -> None:
    """Drop the filters :func:`quiet_process` added, through the public API only: ``resetwarnings`` empties the
    list and marks the filters changed (as ``filterwarnings`` does after a change), then the other filters go back
    in their order."""
    kept = [f for f in warnings.filters
            if not (f[0] == "ignore" and f[1] is not None and (f[1].pattern, f[2]) in _OURS)]
    warnings.resetwarnings()
    warnings.filters[:] = kept


def quiet_process(debug: bool | None = None) -> bool:
    """Quiet (or, debugging, un-quiet) the known library messages in this process; idempotent.
    Remembers the choice for :func:`worker_env`. Returns whether this process is debugging."""
    debug = debugging(debug)
    _state["debug"] = debug
    ray_logger = logging.getLogger(RAY_TOKEN_LOGGER)
    _remove_our_warning_filters()
    ray_logger.removeFilter(_RAY_FILTER)
    if not debug:
        for message, category in MEGATRON_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category, module=MEGATRON_MODULE)
        ray_logger.addFilter(_RAY_FILTER)
    return debug


def _resolved(debug: bool | None) -> bool:
    """``debug`` when given, else this process's last :func:`quiet_process` choice, else the env var."""
    if debug is None and _state["debug"] is not None:
        return _state["debug"]
    return debugging(debug)


def worker_env(debug: bool | None = None) -> dict[str, str]:
    """Environment variables for a Ray worker: quiet libraries unless debugging (the last
    :func:`quiet_process` choice of this process, else ``VERL_LITE_DEBUG``); the user's own
    ``PYTHONWARNINGS`` / ``VLLM_LOGGING_LEVEL`` win."""
    debug = _resolved(debug)
    env = {DEBUG_ENV: "1" if debug else "0",
           "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "default" if debug else "ignore")}
    if "VLLM_LOGGING_LEVEL" in os.environ or not debug:
        env["VLLM_LOGGING_LEVEL"] = os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")
    return env


# vLLM logs (with its traceback) a ValueError it raised and caught itself when an engine runs with
# skip_tokenizer_init=True, which the rollout sets on purpose (token ids in, token ids out)
VLLM_BENIGN = ("Tokenizer not available when skip_tokenizer_init=True",)


class _DropVllmBenign(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            text += f" {record.exc_info[1]}"
        return not any(m in text for m in VLLM_BENIGN)


_VLLM_FILTER = _DropVllmBenign()


def quiet_vllm(debug: bool | None = None) -> None:
    """Call before ``import vllm``: its log level (``VLLM_LOGGING_LEVEL``, read at import) to ERROR
    unless debugging or the user set it. Call again after the import: the known benign records are
    dropped at vLLM's handlers (its loggers do not propagate to the root)."""
    if _resolved(debug):
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for handler in logging.getLogger("vllm").handlers:
        if _VLLM_FILTER not in handler.filters:
            handler.addFilter(_VLLM_FILTER)
