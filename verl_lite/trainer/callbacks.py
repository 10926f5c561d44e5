"""Callbacks of the Python API (docs/python_api.md), under TRL's / transformers' event names. A plain object's
methods get the keyword arguments their signature names (``**kwargs``: all). Per record of the run, in order:

    on_step_end(trainer, step, metrics)         after RL step ``step`` (1, 2, ...): its training metrics
    on_evaluate(trainer, step, metrics)         when the record holds a validation: the ``val/*`` metrics
    on_save(trainer, step, checkpoint_dir)      when a checkpoint of ``step`` was written
    on_log(trainer, step, logs)                 every record (what the trackers log), last

A ``transformers.TrainerCallback`` is called as transformers calls it: ``event(args, state, control, ...)``
(``state.global_step`` = the step, ``state.log_history``; ``args``: output_dir, seed, max_steps);
``control.should_training_stop = True`` ends the run after that record. A callback that raises stops the run
with :class:`CallbackError` naming it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable
from types import SimpleNamespace
from pathlib import Path
from typing import Any

from verl_lite.errors import RunFailure

EVENTS = ("on_step_end", "on_evaluate", "on_save", "on_log")


class CallbackError(RunFailure):
    """A user callback raised; the message names the callback and the event."""


def _name(cb) -> str:
    return getattr(cb, "__name__", None) or type(cb).__name__


def _call(cb, event: str, at_step, /, *args, **kwargs) -> None:
    try:
        getattr(cb, event)(*args, **kwargs)
    except Exception as e:
        raise CallbackError(f"callback {_name(cb)}.{event} raised {type(e).__name__}: {e} at step {at_step}",
                            "fix the callback") from e


def _call_plain(cb, event: str, kwargs: dict[str, Any]) -> None:
    """The event with the keyword arguments its signature names (all of them with a ``**kwargs``)."""
    method = getattr(cb, event, None)
    if method is None:
        return
    params = inspect.signature(method).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    _call(cb, event, kwargs.get("step"), **kwargs)


def is_transformers_callback(cb) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(cb, transformers.TrainerCallback)


class CallbackList:
    """The ``callbacks=`` of ``PPOTrainer``: ``dispatch(trainer, record)`` calls their events for one record;
    ``stop_requested`` turns true when a transformers callback set ``control.should_training_stop``."""

    def __init__(self, callbacks: Iterable | None = None):
        self.callbacks = [] if callbacks is None else list(callbacks)
        for cb in self.callbacks:
            if not any(callable(getattr(cb, e, None)) for e in EVENTS):
                raise ValueError(f"callbacks: {_name(cb)} has none of the methods {list(EVENTS)}")
        self.state = self.control = None
        if any(is_transformers_callback(cb) for cb in self.callbacks):
            from transformers import TrainerControl, TrainerState

            self.state, self.control = TrainerState(), TrainerControl()

    @property
    def stop_requested(self) -> bool:
        return self.control is not None and bool(self.control.should_training_stop)

    def _call_transformers(self, cb, event: str, trainer, step: int, kwargs: dict) -> None:
        """``event(args, state, control, ...)`` as transformers' Trainer calls it."""
        self.state.global_step, self.state.max_steps = step, trainer.total_steps()
        args = SimpleNamespace(output_dir=trainer.cfg.trainer.output_dir, seed=trainer.cfg.trainer.seed,
                               max_steps=trainer.total_steps())
        passed = {k: v for k, v in kwargs.items() if k in ("metrics", "logs")}
        _call(cb, event, step, args, self.state, self.control, **passed)

    def dispatch(self, trainer, record: dict) -> None:
        if not self.callbacks:
            return
        step = int(record.get("step", 0))
        val = {k: v for k, v in record.items() if k.startswith("val/")}
        events: list[tuple[str, dict]] = []
        if step > 0 and "reward/mean" in record:
            events.append(("on_step_end", {"metrics": {k: v for k, v in record.items() if k not in val}}))
        if val:
            events.append(("on_evaluate", {"metrics": val}))
        if "timing_s/save_checkpoint" in record:
            events.append(("on_save", {"checkpoint_dir": Path(trainer.checkpoints.root) / f"global_step_{step}"}))
        events.append(("on_log", {"logs": record}))
        if self.state is not None:
            self.state.log_history.append(record)
        for event, kwargs in events:
            for cb in self.callbacks:
                if is_transformers_callback(cb):
                    self._call_transformers(cb, event, trainer, step, kwargs)
                else:
                    _call_plain(cb, event, {"trainer": trainer, "step": step, **kwargs})
