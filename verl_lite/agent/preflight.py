"""Before any worker starts: build the run's agent spec and check everything it names."""

from __future__ import annotations

import dataclasses

from verl_lite.agent.interaction import as_interaction, load_interaction_config
from verl_lite.agent.loop import AGENT_LOOPS, AgentSpec, ChatGlue, agent_loops, row_agent_name
from verl_lite.agent.tool_calls import FORMATS, format_problem
from verl_lite.agent.tools import ToolConfigError, build_tools

M = "actor_rollout_ref.rollout.multi_turn"


def multi_turn_values(mt) -> dict:
    """The multi_turn section (a ``MultiTurnConfig``) as a plain dict (what the workers read)."""
    return dataclasses.asdict(mt)


def _collect(problems: list[str], fn, *args):
    try:
        return fn(*args)
    except ToolConfigError as e:
        problems.extend(str(e).splitlines())
        return None


def agent_spec(cfg, tools=None, interactions=None, tokenizer=None) -> AgentSpec | None:
    """None when ``multi_turn.enable`` is false (then Python-API ``tools`` / ``interactions`` are an error), else
    the :class:`AgentSpec` the workers build their runner from, after loading on the driver what the workers
    will load: the tool-config classes, the functions' schemas, the interactions, the custom agent loops, the
    default loop's name, and the chat template (it must render ``tool`` turns when there are tools and ``user``
    turns when there are interactions). Every problem is one line of a ``ToolConfigError`` (exit 2)."""
    rollout = cfg.actor_rollout_ref.rollout
    mt, ag = rollout.multi_turn, rollout.agent
    if not mt.enable:
        if tools or interactions:
            raise ToolConfigError(f"tools / interactions were given but {M}.enable=false",
                                  f"set {M}.enable=true (PPOTrainer(tools=...) does so unless the config says false)")
        return None
    problems: list[str] = []
    built = _collect(problems, build_tools, list(tools or []), mt.tool_config_path) or []
    given = {name: as_interaction(inst) for name, inst in (interactions or {}).items()}
    for name, inst in (interactions or {}).items():
        if given[name] is None:
            problems.append(f"interactions[{name!r}]: {type(inst).__name__} has neither respond(state, messages) "
                            f"nor verl's generate_response(instance_id, messages, **kwargs)")
    if mt.interaction_config_path:
        given.update(_collect(problems, load_interaction_config, mt.interaction_config_path) or {})
    loops = _collect(problems, agent_loops, ag.agent_loop_config_path) or AGENT_LOOPS
    if ag.default_agent_loop not in loops:
        problems.append(f"actor_rollout_ref.rollout.agent.default_agent_loop={ag.default_agent_loop!r} is not a "
                        f"registered agent loop; registered: {sorted(loops)}")
    if tokenizer is not None:
        glue = ChatGlue(tokenizer, [t.schema for t in built])
        # what the run names, loaded or not: a tool class that fails to import still needs tool turns rendered
        for role, needed in (("tool", built or tools or mt.tool_config_path),
                             ("user", given or mt.interaction_config_path)):
            why = glue.problem(role) if needed else None
            if why:
                problems.append(f"{M}: {why}; give actor_rollout_ref.model.tokenizer_path a tokenizer whose chat "
                                f"template renders {role!r} turns")
        if why := format_problem(tokenizer, mt.format):
            problems.append(f"{M}.format={mt.format}: {why}; set it to the model family's format (one of "
                            f"{list(FORMATS)})")
    if problems:
        raise ToolConfigError("\n".join(problems))
    return AgentSpec(multi_turn=multi_turn_values(mt), default_agent_loop=ag.default_agent_loop,
                     agent_loop_config_path=ag.agent_loop_config_path, functions=list(tools or []),
                     interactions={n: i for n, i in given.items() if n in (interactions or {})},
                     max_response_length=cfg.data.max_response_length,
                     tool_schemas=[t.schema for t in built])


def single_turn_rows_warning(spec: AgentSpec | None, rows) -> str | None:
    """The warning for a multi-turn run with tools or interactions whose rows mostly run single-turn: rows without
    ``agent_name`` take ``agent.default_agent_loop``, and verl's default (single_turn_agent) never offers a tool."""
    if spec is None or spec.default_agent_loop != "single_turn_agent" or not (spec.tool_schemas or spec.interactions):
        return None
    count = sum(1 for i in range(len(rows)) if not row_agent_name(rows[i]))
    if not count:
        return None
    return (f"{count} of the {len(rows)} training rows have no agent_name, so they run "
            f"actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent: one model turn, the configured "
            f"tools and interactions never used (verl does the same); set agent.default_agent_loop=tool_agent, or give "
            f"the rows an agent_name")


def enable_for_python_tools(cfg) -> None:
    """``PPOTrainer(tools=...)``: multi-turn rollouts on, and the tool loop for rows without ``agent_name``
    when the config still names verl's default ``single_turn_agent``."""
    rollout = cfg.actor_rollout_ref.rollout
    rollout.multi_turn.enable = True
    if rollout.agent.default_agent_loop == "single_turn_agent":
        rollout.agent.default_agent_loop = "tool_agent"


def pickle_user_code_by_value(spec: AgentSpec) -> None:
    """The Python API's tools and interactions travel to the workers by value (cloudpickle), also when they
    live in a module the workers cannot import (a script loaded by path, a test file); verl_lite's own and
    installed packages' objects still go by reference."""
    import sys
    import sysconfig

    from ray import cloudpickle

    site = (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"])
    for obj in list(spec.functions) + list(spec.interactions.values()):
        name = getattr(obj, "__module__", None) or type(obj).__module__
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None) or ""
        if module is None or name == "__main__" or name.split(".")[0] == "verl_lite" or path.startswith(site):
            continue
        cloudpickle.register_pickle_by_value(module)
