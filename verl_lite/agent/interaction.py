"""Interactions: an environment that plays the user over several turns and may reward each turn.

After a model turn without a tool call, ``respond(state, messages)`` (the conversation so far, decoded text; ``start``
and ``respond`` may be ``async``) returns an :class:`InteractionTurn`; verl's classes run as they are through
:class:`VerlInteraction` (docs/agents.md, "Interactions").
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Optional

from verl_lite.agent.tools import ToolConfigError, _import_class, imports_missing_verl, maybe_await, yaml_entries


@dataclass
class InteractionTurn:
    text: str  # the user's next message
    reward: Optional[float] = 0.0  # the reward of the model turn just taken; None: no turn score
    done: bool = False  # end the trajectory here (text is then not added)


class Interaction:
    """Base class of a simulated user / environment (docs/agents.md, "Interactions")."""

    def __init__(self, config: dict | None = None):
        self.config = dict(config or {})

    def start(self, row: dict) -> Any:
        return None

    def respond(self, state: Any, messages: list[dict]) -> InteractionTurn:
        raise NotImplementedError

    def finish(self, state: Any) -> None:
        """Called once when the trajectory ends (any reason), with ``start``'s state."""


class BaseInteraction:
    """verl's interaction class shape (subclass it, or any class with these methods): one instance per config
    entry, one ``instance_id`` per trajectory."""

    def __init__(self, config: dict):
        self.config, self.name = config, config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: Optional[str] = None, **kwargs) -> str:
        return instance_id or uuid.uuid4().hex

    async def generate_response(self, instance_id: str, messages: list[dict], **kwargs
                                ) -> tuple[bool, str, Optional[float], dict]:
        raise NotImplementedError

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        return None


class VerlInteraction(Interaction):
    """A verl-shaped interaction object as an :class:`Interaction`: ``start`` opens an instance with the row's
    ``extra_info.interaction_kwargs`` (verl passes them to every call), ``respond`` maps ``generate_response``'s
    tuple onto :class:`InteractionTurn`, ``finish`` finalizes the instance."""

    def __init__(self, verl_interaction):
        super().__init__(getattr(verl_interaction, "config", None))
        self.verl = verl_interaction

    async def start(self, row: dict) -> tuple[str, dict]:
        kwargs = dict((row.get("extra_info") or {}).get("interaction_kwargs") or {})
        instance_id = uuid.uuid4().hex
        return await maybe_await(self.verl.start_interaction(instance_id, **kwargs)) or instance_id, kwargs

    async def respond(self, state: tuple[str, dict], messages: list[dict]) -> InteractionTurn:
        instance_id, kwargs = state
        reply = await maybe_await(self.verl.generate_response(instance_id, messages, **kwargs))
        if not isinstance(reply, (tuple, list)) or len(reply) != 4:
            raise TypeError(f"{type(self.verl).__name__}.generate_response returned {reply!r}; verl's shape is "
                            f"(should_terminate, response_text, score, extra)")
        done, text, score, _extra = reply
        return InteractionTurn(str(text), None if score is None else float(score), bool(done))

    async def finish(self, state: tuple[str, dict]) -> None:
        if callable(getattr(self.verl, "finalize_interaction", None)):
            await maybe_await(self.verl.finalize_interaction(state[0]))


def as_interaction(obj) -> Interaction | None:
    """``obj`` as an :class:`Interaction`: itself (``respond``), a verl-shaped one wrapped (``generate_response``),
    else None."""
    if callable(getattr(obj, "respond", None)):
        return obj
    if callable(getattr(obj, "generate_response", None)):
        return VerlInteraction(obj)
    return None


VERL_IMPORT_FIX = ("; verl is not installed here: import verl's base class from verl_lite instead "
                   "(from verl_lite.agent.interaction import BaseInteraction), the rest of the class runs as it is")


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
            inst = as_interaction(_import_class(e["class_name"])(config=e.get("config") or {}))
        except Exception as err:
            fix = VERL_IMPORT_FIX if imports_missing_verl(err) else ""
            problems.append(f"{where}: {e['class_name']} cannot be loaded ({type(err).__name__}: {err}){fix}")
            continue
        if inst is None:
            problems.append(f"{where}: {e['class_name']} has neither respond(state, messages) nor verl's "
                            f"generate_response(instance_id, messages, **kwargs)")
            continue
        if name in out:
            problems.append(f"{where}: the name {name!r} is used twice")
        out[name] = inst
    if problems:
        raise ToolConfigError("\n".join(problems))
    return out
