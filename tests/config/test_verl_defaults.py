"""Every accepted verl key keeps verl 0.9.1's default, or docs/config.md lists it with the reason.

`verl_0_9_1_defaults.json` (next to this file) is DATA recorded once from the verl 0.9.1 wheel by
`record_verl_0_9_1_defaults.py`. `VERL_DEFAULTS` of scripts/config_docs.py is the one list of the
deliberate differences (docs/config.md's "Defaults that differ from verl's" is rendered from it):
each listed key really differs and states both defaults right; no unlisted key differs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.config.config_docs import docs

VERL_DEFAULTS, verl_default_ours = docs.VERL_DEFAULTS, docs.verl_default_ours
from verl_lite.config.loader import INHERITED
from verl_lite.config.schema import PPOConfig
from verl_lite.config.verl_keys import rule_for

RECORD = json.loads((Path(__file__).with_name("verl_0_9_1_defaults.json")).read_text())
VERL = RECORD["defaults"]
MISSING = object()


def schema_default(key: str):
    """The schema's default of a dotted key (MISSING when the key is not a schema leaf)."""
    node = PPOConfig()
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return MISSING
        node = getattr(node, part)
    return MISSING if dataclasses.is_dataclass(node) else node


def inherited_from(key: str) -> str | None:
    section, name = key.rsplit(".", 1)
    return next((src for sec, k, src in INHERITED if sec == section and k == name), None)


def ours(key: str):
    """('value', default) for a schema / alias / equal key; ('same', rule) for a fixed-behaviour key."""
    if schema_default(key) is not MISSING:
        return "value", key
    rule = rule_for(key)
    assert rule is not None and rule.kind != "reject", key
    if rule.kind == "alias":
        from verl_lite.config.verl_keys import _aliased

        return "value", _aliased(rule, key)
    if rule.kind == "equal":
        return "value", rule.target
    return "same", rule


def same_default(key: str) -> bool:
    """Does verl_lite's default of verl key ``key`` mean what verl 0.9.1's does?"""
    verl = VERL[key]
    kind, what = ours(key)
    if kind == "same":
        value = verl["value"] if isinstance(verl, dict) else verl
        return bool(what.accepts(value))
    if rule_for(key) is not None and rule_for(key).kind == "equal" and schema_default(key) is MISSING and verl is None:
        return schema_default(rule_for(key).target) is None  # else verl's null = "the other key's", listed
    mine = schema_default(what)
    if isinstance(verl, dict):  # verl: "= another key"; ours must follow the same key when unset
        return mine is None and inherited_from(what) == verl["follows"] or what == verl["follows"]
    return _equal(mine, verl)


def _equal(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def test_the_record_is_verl_data():
    assert len(VERL) > 150 and "about" in RECORD
    assert VERL["actor_rollout_ref.actor.policy_loss.ppo_kl_coef"] == 0.1
    assert VERL["actor_rollout_ref.actor.optim.lr"] == 1e-6


def test_every_schema_key_is_recorded_or_verl_lite_only():
    from tests.config.record_verl_0_9_1_defaults import schema_leaves

    unknown = [k for k in schema_leaves() if k not in VERL and k not in RECORD["not_in_verl"]]
    assert not unknown, f"re-record verl's defaults (record_verl_0_9_1_defaults.py) for the new keys {unknown}"


def test_no_unlisted_key_differs_from_verl():
    differ = sorted(k for k in VERL if k not in VERL_DEFAULTS and not same_default(k))
    assert not differ, "defaults that differ from verl 0.9.1's without a reason in docs.VERL_DEFAULTS: " + \
        ", ".join(f"{k} (verl {VERL[k]!r})" for k in differ)


@pytest.mark.parametrize("key", sorted(VERL_DEFAULTS))
def test_each_listed_difference_is_stated_right(key):
    """The stated verl default is verl 0.9.1's, the stated (rendered) ours is the schema's, and they differ."""
    assert key in VERL, f"{key} is not an accepted verl key with a verl 0.9.1 default"
    entry, verl = VERL_DEFAULTS[key], VERL[key]
    if isinstance(verl, dict):
        assert entry[0] == {"follows": verl["follows"]}, (key, entry[0], verl)
    else:
        assert _equal(entry[0], verl), (key, entry[0], verl)
    assert len(entry[1]) > 10, key
    from tests.config.record_verl_0_9_1_defaults import schema_leaves

    kind, what = ours(key)
    stated = verl_default_ours(key, {k: schema_default(k) for k in schema_leaves()})
    if kind == "same":  # a fixed behaviour, in words
        assert len(entry) == 3 and stated == entry[2]
        return
    assert len(entry) == 2 and _equal(stated, schema_default(what)), (key, stated, schema_default(what))
    assert not same_default(key), f"{key}: listed, but the default now means verl's: drop the entry"


def test_the_changed_defaults_are_verls():
    """The defaults this list no longer excuses (issue 19): verl's values, on the loaded config too."""
    from verl_lite.config import load_config

    cfg = load_config([])
    actor = cfg.actor_rollout_ref.actor
    assert actor.policy_loss.ppo_kl_coef == 0.1
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.2)
    cfg = load_config(["actor_rollout_ref.actor.clip_ratio=0.3"])  # verl: clip_ratio alone changes neither bound
    assert (cfg.actor_rollout_ref.actor.clip_ratio_low, cfg.actor_rollout_ref.actor.clip_ratio_high) == (0.2, 0.2)
    cfg = load_config(["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.shuffle=true"])
    assert cfg.critic.use_dynamic_bsz is True and cfg.critic.shuffle is True  # verl: the critic follows the actor
