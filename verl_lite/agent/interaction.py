"""Interactions: an environment that plays the user over several turns and may reward each turn.

When the model ends a turn without a tool call and the row has an interaction, the loop asks it
for the next user message (verl's ``BaseInteraction`` shape)::

    class Tutor(Interaction):
        def start(self, row: dict) -> Any:                      # per trajectory; the state it keeps
            return {"tries": 0}
        def respond(self, state, messages: list[dict]) -> InteractionTurn:
            return InteractionTurn("Try again.", reward=0.0, done=False)

``respond`` sees the conversation so far (``messages``: the prompt's messages, then the model's
turns as decoded text and the environment's turns) and returns the user's next message, the reward
of the turn just taken (collected per trajectory as ``turn_scores``) and ``done=True`` to end the
trajectory (then ``text`` is not added). ``start`` / ``respond`` may be ``async``.

A row chooses its interaction with ``extra_info["interaction_kwargs"]["name"]`` (verl's key); the
config file ``multi_turn.interaction_config_path`` (verl's shape) names the classes::

    interaction:
      - name: tutor
        class_name: my_pkg.envs.Tutor
        config: {...}                 # passed to the class as ``config``

The Python API takes instances directly: ``PPOTrainer(..., interactions={"tutor": Tutor({})})``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from verl_lite.agent.tools import ToolConfigError, _import_class, yaml_entries


@dataclass
class InteractionTurn:
    text: str  # the user's next message
    reward: float = 0.0  # the reward of the model turn just taken
    done: bool = False  # end the trajectory here (text is then not added)


class Interaction:
    """Base class of a simulated user / environment (see module docstring)."""

    def __init__(self, config: dict | None = None):
        self.config = dict(config or {})

    def start(self, row: dict) -> Any:
        return None

    def respond(self, state: Any, messages: list[dict]) -> InteractionTurn:
        raise NotImplementedError


async def maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def load_interaction_config(path: str) -> dict[str, Interaction]:
    """name -> instance from a verl interaction-config YAML; every problem raises :class:`ToolConfigError`."""
    entries = yaml_entries("actor_rollout_ref.rollout.multi_turn.interaction_config_path", path, "interaction",
                           "name, class_name, config")
    out, problems = {}, []
    for i, e in enumerate(entries):
        where = f"{path}: interaction[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("class_name"), str):
            problems.append(f"{where} needs class_name (module.Class) and optionally name and config")
            continue
        name = e.get("name") or e["class_name"].rsplit(".", 1)[-1].lower()
        try:
            cls = _import_class(e["class_name"])
            inst = cls(config=e.get("config") or {})
        except Exception as err:
            problems.append(f"{where}: {e['class_name']} cannot be loaded ({type(err).__name__}: {err})")
            continue
        if not callable(getattr(inst, "respond", None)):
            problems.append(f"{where}: {e['class_name']} has no respond(state, messages) method")
            continue
        if name in out:
            problems.append(f"{where}: the name {name!r} is used twice")
        out[name] = inst
    if problems:
        raise ToolConfigError("\n".join(problems))
    return out
