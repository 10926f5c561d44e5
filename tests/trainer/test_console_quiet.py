"""verl_lite/utils/quiet.py: the library messages a run hides by default come back with --debug.

The default CLI job's console is checked in tests/faults/test_runtime_faults.py; here the two
mechanisms are checked against the real libraries: the environment a Ray worker gets (a fresh
interpreter importing megatron's optimizer), and the driver's filters (Ray's token notice logger).
"""

import logging
import os
import subprocess
import sys

from verl_lite.utils import quiet

MEGATRON_IMPORT = "import megatron.core.optimizer"


def _worker_stderr(debug: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "VLLM_LOGGING_LEVEL")}
    env.update(quiet.worker_env(debug=debug))
    return subprocess.run([sys.executable, "-c", MEGATRON_IMPORT], env=env, capture_output=True, text=True,
                          timeout=300, check=True).stderr


def test_worker_env_hides_megatron_warnings_unless_debugging():
    assert "Transformer Engine and Apex are not installed" not in _worker_stderr(debug=False)
    assert "UserWarning: Transformer Engine and Apex are not installed" in _worker_stderr(debug=True)


def test_worker_env_follows_the_drivers_choice(monkeypatch):
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setitem(quiet._state, "debug", None)
    quiet.quiet_process(debug=True)
    assert quiet.worker_env() == {"VERL_LITE_DEBUG": "1", "PYTHONWARNINGS": "default"}
    quiet.quiet_process(debug=False)
    assert quiet.worker_env() == {"VERL_LITE_DEBUG": "0", "PYTHONWARNINGS": "ignore", "VLLM_LOGGING_LEVEL": "ERROR"}
    monkeypatch.setenv("PYTHONWARNINGS", "error")  # the user's own setting wins
    assert quiet.worker_env()["PYTHONWARNINGS"] == "error"


def test_driver_filters_megatron_warning_and_ray_notice_unless_debugging(monkeypatch):
    import warnings

    monkeypatch.setitem(quiet._state, "debug", None)
    logger = logging.getLogger(quiet.RAY_TOKEN_LOGGER)
    # a handler on the logger itself: what passes the logger's filter reaches it whatever an earlier test
    # in this process (ray.init) did to propagation or to the levels of the loggers above
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    level = logger.level
    logger.setLevel(logging.WARNING)  # setLevel, not the attribute: it also clears the loggers' level cache
    logger.addHandler(handler)

    def seen(debug: bool) -> tuple[list, list]:
        quiet.quiet_process(debug=debug)
        records.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.filters[:] = [f for f in warnings.filters if f[0] != "error"]
            warnings.warn_explicit("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                                   UserWarning, "optimizer.py", 24, module="megatron.core.optimizer")
            warnings.warn_explicit("Transformer Engine and Apex are not installed.", UserWarning, "mine.py", 1,
                                   module="my_package")  # not megatron's: never hidden
        logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled ...")
        logger.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
        return [str(w.message) for w in caught], [r.getMessage()[:40] for r in records]

    try:
        caught, logged = seen(debug=False)
        assert caught == ["Transformer Engine and Apex are not installed."]
        assert logged == ["Token authentication is disabled for thi"]
        caught, logged = seen(debug=True)
        assert len(caught) == 2 and len(logged) == 2
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        quiet.quiet_process(debug=False)
