"""verl's command-line vocabulary that is not a field of the schema: each key gets one decision, by the first rule
of ``verl_keys.json`` (one rule a line) whose pattern matches it, before anything starts:

- ``alias``   the same setting under verl_lite's name; the value is kept (or mapped, ``dapo`` -> ``naive``) and
              then checked like any schema key;
- ``same``    accepted when the value states what verl_lite always does (``use_remove_padding=True``); any other
              value is rejected with the reason;
- ``equal``   accepted when the value equals another key's (checked after the whole command line is composed);
- ``reject``  does not apply here: the message says why and what to use instead.

No rule accepts a value and then ignores it. A key no rule matches gets the unknown-key message.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class Rule:
    pattern: str  # fnmatch pattern over the dotted key
    kind: str  # alias | same | equal | reject
    reason: str = ""  # reject / not-same: why it does not apply and what to use
    target: str = ""  # alias: verl_lite key (each '*' = what the pattern's '*' there matched); equal: the other key
    accepts: Callable[[Any], bool] | None = None  # same: the values that state what verl_lite does
    value_map: dict | None = None  # alias: verl value -> verl_lite value
    effect: str = ""  # same/alias: what accepting it means here (docs)
    implies: dict | None = None  # alias: verl_lite key (with '*' as target) -> verl's default that comes with the key


@dataclass(frozen=True)
class Decision:
    kind: str  # alias | accepted | equal | rejected
    key: str  # the verl key as given
    target: str = ""  # alias/equal: the verl_lite key
    value: Any = None  # alias: the (mapped) value to set
    message: str = ""  # rejected: the full problem line
    implies: dict | None = None  # alias: key -> value that applies unless the command line sets that key itself


def render(value) -> str:
    """A value as Hydra override text."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value) if not value or any(c in value for c in " ,[]{}=:'\"") else value
    return str(value)


def _is(*values) -> Callable[[Any], bool]:
    """Exactly these values (a bool is no number; strings in any case)."""
    def check(v):
        return any(v == x and type(v) is type(x) or (isinstance(x, str) and isinstance(v, str) and v.lower() == x)
                   for x in values)

    check.label = " / ".join(render(x) for x in values)
    return check


def _label(label: str):
    def named(fn):
        fn.label = label
        return fn
    return named


@_label("an integer >= 1")
def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@_label("cuda (GPU visible) / cpu (none)")
def _device_ok(v) -> bool:
    """The device this machine runs on: cuda where a GPU is visible, else cpu."""
    import torch

    return isinstance(v, str) and v.lower() == ("cuda" if torch.cuda.is_available() else "cpu")


CHECKPOINT_CONTENTS = {"model", "optimizer", "extra"}  # what every verl_lite checkpoint holds (+ the HF model)


@_label("all of ['model', 'optimizer', 'extra'] (+ 'hf_model')")
def _all_contents(v) -> bool:
    """verl's checkpoint ``save_contents`` / ``load_contents`` that name what verl_lite saves and loads anyway."""
    return isinstance(v, (list, tuple)) and CHECKPOINT_CONTENTS <= set(v) <= CHECKPOINT_CONTENTS | {"hf_model"}


# the predicates a rule's "accepts" can name (else a name of the table's "values", or a list of values)
ACCEPTS = {"positive_int": _positive_int, "device": _device_ok, "all_contents": _all_contents}


def _load_rules(path: Path) -> list[Rule]:
    """The rules of ``verl_keys.json`` (one per line, in matching order; its "about" says the form)."""
    table = json.loads(path.read_text())
    rules = []
    for pattern, kind, reason, *extra in table["rules"]:
        opts = dict(extra[0]) if extra else {}
        reason = table["reasons"][reason[1:]] if reason.startswith("$") else reason
        if "accepts" in opts:
            a = opts["accepts"]
            named = isinstance(a, str) and ACCEPTS.get(a)
            opts["accepts"] = named or _is(*(table["values"][a] if isinstance(a, str) else a))
        rules.append(Rule(pattern, kind, reason, **opts))
    return rules


RULES: list[Rule] = _load_rules(Path(__file__).with_name("verl_keys.json"))


def rule_for(key: str) -> Rule | None:
    """The first rule whose pattern matches ``key`` (None: no rule)."""
    return next((rule for rule in RULES if fnmatch.fnmatchcase(key, rule.pattern)), None)


def _aliased(rule: Rule, key: str, target: str | None = None) -> str:
    """An alias' verl_lite key for ``key`` (or for another ``target`` of the rule): each '*' of the target takes
    what the pattern's '*' matched."""
    matched = iter(re.fullmatch(re.escape(rule.pattern).replace(r"\*", "(.*)"), key).groups())
    return re.sub(r"\*", lambda _: next(matched), rule.target if target is None else target)


def decide(key: str, value: Any) -> Decision | None:
    """What happens to verl key ``key`` set to ``value`` (None when no rule covers the key)."""
    rule = rule_for(key)
    if rule is None:
        return None
    if rule.kind == "alias":
        mapped = rule.value_map.get(value, value) if rule.value_map and isinstance(value, str) else value
        implies = {_aliased(rule, key, k): v for k, v in (rule.implies or {}).items()} or None
        return Decision("alias", key, target=_aliased(rule, key), value=mapped, implies=implies)
    message = f"{key}={render(value)}: {rule.reason}" if rule.kind != "reject" else f"{key}: {rule.reason}"
    if rule.kind == "equal":
        return Decision("equal", key, target=rule.target, value=value, message=message)
    if rule.kind == "same" and rule.accepts is not None and rule.accepts(value):
        return Decision("accepted", key, value=value)
    return Decision("rejected", key, value=value, message=message)

