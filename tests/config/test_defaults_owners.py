"""The schema's optimizer and layout sections against the engine's own config classes: every schema
key is a field the engine has and is forwarded to it (so the engine's defaults never apply to a
configured run), and every default that differs from the engine's (which are verl's) is listed in
docs/config.md's "Defaults that differ from verl's" with the reason."""

from __future__ import annotations

import dataclasses

from verl_lite.config import load_config
from verl_lite.config.docs import DIFFERENT_DEFAULTS
from verl_lite.config.schema import MegatronConfig, OptimConfig


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def test_every_optim_key_is_forwarded_to_the_engine():
    from verl_lite.engine.config import OptimConfig as EngineOptim
    from verl_lite.trainer.ppo_trainer import _engine_fields

    cfg = load_config(["actor_rollout_ref.actor.optim.lr=0.00123", "actor_rollout_ref.actor.optim.weight_decay=0.07",
                       "actor_rollout_ref.actor.optim.betas=[0.8,0.95]", "actor_rollout_ref.actor.optim.min_lr=1e-5",
                       "actor_rollout_ref.actor.optim.lr_warmup_steps=3", "actor_rollout_ref.actor.optim.clip_grad=0.3",
                       "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
                       "actor_rollout_ref.actor.megatron.timeout_s=77"])
    arr = cfg.actor_rollout_ref
    fields = _engine_fields(arr.model.path, arr.actor.megatron, arr.actor.optim, 10, 0, model=arr.model)
    engine_optim = EngineOptim(**fields["optim"])
    schema_optim = dataclasses.asdict(arr.actor.optim)
    assert set(schema_optim) <= {f.name for f in dataclasses.fields(EngineOptim)}
    for name, value in schema_optim.items():
        got = getattr(engine_optim, name)
        assert (list(got) if isinstance(got, tuple) else got) == value, name
    assert fields["timeout_s"] == 77


def test_defaults_that_differ_from_the_engines_are_documented():
    from verl_lite.engine.config import OptimConfig as EngineOptim
    from verl_lite.engine.distributed import ParallelConfig

    documented = " ".join(k for k, *_ in DIFFERENT_DEFAULTS)
    engine = _defaults(EngineOptim)
    for name, ours in _defaults(OptimConfig).items():
        theirs = list(engine[name]) if isinstance(engine[name], tuple) else engine[name]
        if ours != theirs:
            assert f"optim.{name}" in documented, f"optim.{name}: {ours} vs the engine's {theirs} is not documented"
    if _defaults(MegatronConfig)["timeout_s"] != ParallelConfig().timeout_s:
        assert "megatron.timeout_s" in documented
