"""verl's command-line vocabulary that is not a field of the schema: each key gets one decision.

verl's launch scripts set keys for features verl_lite builds differently (or not at all). A key
of the schema is simply a key; every OTHER key that verl's scripts use is matched here, in order,
against a rule that decides, before anything starts:

- ``alias``   the same setting under verl_lite's name (``custom_reward_function.path`` ->
              ``reward.custom_reward_function.path``); the value is kept (or mapped, ``dapo`` ->
              ``naive``) and then checked like any schema key;
- ``same``    accepted when the value states what verl_lite always does (``use_remove_padding=True``:
              verl_lite always packs THD); any other value is rejected with the reason;
- ``equal``   accepted when the value equals another key's (the reference model shares the actor's
              process group, so ``ref.megatron.tensor_model_parallel_size`` must equal the actor's);
              checked after the whole command line is composed;
- ``reject``  does not apply here: the message says why and what to use instead.

No rule accepts a value and then ignores it: ``same`` accepts only what is already true. Keys that
match no rule and are not in the schema get the generic unknown-key message (with a close key
from the same section when there is one). The rules are data: ``verl_keys.json``, one rule a line.

    decide(key, value) -> Decision | None        # None: no rule (a schema key or a typo)
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class Rule:
    pattern: str  # fnmatch pattern over the dotted key
    kind: str  # alias | same | equal | reject
    reason: str = ""  # reject / not-same: why it does not apply and what to use
    target: str = ""  # alias: verl_lite key ('*' in pattern -> the same tail); equal: the other key
    accepts: Callable[[Any], bool] | None = None  # same: the values that state what verl_lite does
    value_map: dict | None = None  # alias: verl value -> verl_lite value
    effect: str = ""  # same/alias: what accepting it means here (docs)


@dataclass(frozen=True)
class Decision:
    kind: str  # alias | accepted | equal | rejected
    key: str  # the verl key as given
    target: str = ""  # alias/equal: the verl_lite key
    value: Any = None  # alias: the (mapped) value to set
    message: str = ""  # rejected: the full problem line


def _is(*values) -> Callable[[Any], bool]:
    def check(v):
        return any(v == x and type(v) is type(x) or (isinstance(x, str) and isinstance(v, str) and v.lower() == x)
                   for x in values)

    check.label = " / ".join(str(x).lower() if isinstance(x, bool) else str(x) for x in values)
    return check


def _falsy(v) -> bool:
    return v in (False, None, 0) and not (isinstance(v, float) and v != 0)


def _one_or_null(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v == 1)


def _zero(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


def _empty(v) -> bool:
    return v is None or v == "" or v == [] or v == {}


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _null_or_verl_default(v) -> bool:
    return v is None or v == "custom_reward_manager"


def _device_ok(v) -> bool:
    """The device this machine runs on: cuda where a GPU is visible, else cpu."""
    if not isinstance(v, str):
        return False
    import torch

    return v.lower() == ("cuda" if torch.cuda.is_available() else "cpu")


_positive_int.label, _null_or_verl_default.label = "an integer >= 1", "null / custom_reward_manager"
_falsy.label, _one_or_null.label, _zero.label, _empty.label = "false", "1 / null", "0 / null", "null / empty"
_device_ok.label = "cuda (GPU visible) / cpu (none)"
# the named predicates a rule's "accepts" can give (a list of values instead: exactly those, strings in any case)
ACCEPTS = {"false": _falsy, "one_or_null": _one_or_null, "zero": _zero, "empty": _empty,
           "positive_int": _positive_int, "null_or_verl_default": _null_or_verl_default, "device": _device_ok}


def _load_rules(path: Path) -> list[Rule]:
    """The rules of ``verl_keys.json`` (one per line, in matching order; its "about" says the form)."""
    table = json.loads(path.read_text())
    rules = []
    for pattern, kind, reason, *extra in table["rules"]:
        opts = dict(extra[0]) if extra else {}
        if reason.startswith("$"):
            reason = table["reasons"][reason[1:]]
        if "accepts" in opts:
            a = opts["accepts"]
            opts["accepts"] = ACCEPTS[a] if isinstance(a, str) else _is(*a)
        rules.append(Rule(pattern, kind, reason, **opts))
    return rules


RULES: list[Rule] = _load_rules(Path(__file__).with_name("verl_keys.json"))


def rule_for(key: str) -> Rule | None:
    """The first rule whose pattern matches ``key`` (None: no rule)."""
    for rule in RULES:
        if fnmatch.fnmatchcase(key, rule.pattern):
            return rule
    return None


def _aliased(rule: Rule, key: str) -> str:
    if "*" not in rule.target:
        return rule.target
    head = rule.pattern.split("*", 1)[0]
    return rule.target.replace("*", key[len(head):], 1)


def decide(key: str, value: Any) -> Decision | None:
    """What happens to verl key ``key`` set to ``value`` (None when no rule covers the key)."""
    rule = rule_for(key)
    if rule is None:
        return None
    shown = _show(value)
    if rule.kind == "alias":
        mapped = rule.value_map.get(value, value) if rule.value_map and isinstance(value, str) else value
        return Decision("alias", key, target=_aliased(rule, key), value=mapped)
    if rule.kind == "equal":
        return Decision("equal", key, target=rule.target, value=value, message=f"{key}={shown}: {rule.reason}")
    if rule.kind == "same":
        if rule.accepts is not None and rule.accepts(value):
            return Decision("accepted", key, value=value)
        return Decision("rejected", key, value=value, message=f"{key}={shown}: {rule.reason}")
    return Decision("rejected", key, value=value, message=f"{key}: {rule.reason}")


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def render(value) -> str:
    """A value as Hydra override text."""
    import json

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value) if any(c in value for c in " ,[]{}=:'\"") else value
    return str(value)
