"""Write tests/config/verl_0_9_1_defaults.json: verl 0.9.1's defaults of the verl keys verl_lite accepts.

Run once, by hand, against an unpacked verl 0.9.1 wheel (the data file is committed; tests never
need verl):

    pip download verl==0.9.1 --no-deps -d /tmp/verl_pkg && unzip -q /tmp/verl_pkg/verl-0.9.1-*.whl -d /tmp/verl_pkg/x
    python tests/config/record_verl_0_9_1_defaults.py /tmp/verl_pkg/x

It reads verl's flattened megatron trainer config (verl/trainer/config/_generated_ppo_megatron_trainer.yaml)
and records, for every key there that is a schema key or matched by an alias / same / equal rule of
verl_lite.config.verl_keys, its default: the literal value, or {"follows": key, "value": resolved}
for verl's ``${oc.select:...}`` / ``${.key}`` interpolations. Schema keys that verl 0.9.1 does not
have are listed under "not_in_verl". Keys and values only (data, no verl code or text).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import typing
from pathlib import Path

import yaml

from verl_lite.config.schema import PPOConfig
from verl_lite.config.verl_keys import rule_for

OUT = Path(__file__).with_name("verl_0_9_1_defaults.json")
GENERATED = "verl/trainer/config/_generated_ppo_megatron_trainer.yaml"
SELECT = re.compile(r"^\$\{oc\.select:\s*([^,}]+)\s*(?:,.*)?\}$")
RELATIVE = re.compile(r"^\$\{\.([A-Za-z_][\w.]*)\}$")


def schema_leaves(cls=PPOConfig, prefix: str = "") -> list[str]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        out += schema_leaves(tp, key) if isinstance(tp, type) and dataclasses.is_dataclass(tp) else [key]
    return out


def flatten(node: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in node.items():
        if k == "_target_":
            continue
        key = f"{prefix}.{k}" if prefix else str(k)
        flat.update(flatten(v, key) if isinstance(v, dict) and v else {key: v})
    return flat


def follows(key: str, value) -> str | None:
    if not isinstance(value, str):
        return None
    m = SELECT.match(value.strip())
    if m:
        target = m.group(1).strip()
        return key.rsplit(".", 1)[0] + target if target.startswith(".") else target
    m = RELATIVE.match(value.strip())
    return key.rsplit(".", 1)[0] + "." + m.group(1) if m else None


def resolve(key: str, flat: dict, seen=()):
    value = flat[key]
    target = follows(key, value)
    if target is None:
        return value
    if target in seen or target not in flat:
        return None
    return resolve(target, flat, seen + (key,))


def main(verl_root: str) -> None:
    flat = flatten(yaml.safe_load((Path(verl_root) / GENERATED).read_text()))
    schema = schema_leaves()
    accepted = [k for k in flat if k in schema or (rule_for(k) is not None and rule_for(k).kind != "reject")]
    defaults = {}
    for key in sorted(accepted):
        target = follows(key, flat[key])
        defaults[key] = flat[key] if target is None else {"follows": target, "value": resolve(key, flat)}
    OUT.write_text(json.dumps({
        "about": "verl 0.9.1's defaults (verl/trainer/config/_generated_ppo_megatron_trainer.yaml) of the verl keys "
                 "verl_lite accepts (schema keys and alias/same/equal rules); {follows, value} = an interpolation "
                 "of another key and its resolved default. Written by record_verl_0_9_1_defaults.py; data only.",
        "defaults": defaults,
        "not_in_verl": sorted(k for k in schema if k not in flat),
    }, indent=1, sort_keys=False) + "\n")
    print(f"wrote {OUT}: {len(defaults)} keys, {len([k for k in schema if k not in flat])} schema keys not in verl")


if __name__ == "__main__":
    main(sys.argv[1])
