"""Callbacks of the Python API, under TRL's / transformers' event names.

    class Printer:                                   # a plain object: any subset of the four methods
        def on_step_end(self, step, metrics, **kwargs): ...
        def on_log(self, step, logs, **kwargs): ...

    PPOTrainer(cfg, ..., callbacks=[Printer()]).fit()

Each method is called with the keyword arguments its signature names (a ``**kwargs`` parameter
receives all of them); none has to be declared. Per record of the run, in this order:

    on_step_end(trainer, step, metrics)         after RL step ``step`` (1, 2, ...): its training metrics
    on_evaluate(trainer, step, metrics)         when the record holds a validation (step 0 with
                                                trainer.val_before_train): the ``val/*`` metrics
    on_save(trainer, step, checkpoint_dir)      when a checkpoint of ``step`` was written
    on_log(trainer, step, logs)                 every record (what the trackers log), last

``step`` is the RL step the record belongs to (``trainer.global_step`` after it). The callbacks see
the record after the trainer has finished it (``fit()`` calls them before the trackers log it).
A callback that raises stops the run with :class:`CallbackError` naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from verl_lite.errors import RunFailure

EVENTS = ("on_step_end", "on_evaluate", "on_save", "on_log")


class CallbackError(RunFailure):
    """A user callback raised; the message names the callback and the event."""


def _name(cb) -> str:
    return getattr(cb, "__name__", None) or type(cb).__name__


def _call(cb, event: str, kwargs: dict[str, Any]) -> None:
    method = getattr(cb, event, None)
    if method is None:
        return
    params = inspect.signature(method).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    try:
        method(**kwargs)
    except Exception as e:
        raise CallbackError(f"callback {_name(cb)}.{event} raised {type(e).__name__}: {e} at step {kwargs.get('step')}",
                            "fix the callback") from e


class CallbackList:
    """The ``callbacks=`` of ``PPOTrainer``: ``dispatch(trainer, record)`` calls their events for one record."""

    def __init__(self, callbacks: Iterable | None = None):
        self.callbacks = [] if callbacks is None else list(callbacks)
        for cb in self.callbacks:
            if not any(callable(getattr(cb, e, None)) for e in EVENTS):
                raise ValueError(f"callbacks: {_name(cb)} has none of the methods {list(EVENTS)}")

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
        for event, kwargs in events:
            for cb in self.callbacks:
                _call(cb, event, {"trainer": trainer, "step": step, **kwargs})
