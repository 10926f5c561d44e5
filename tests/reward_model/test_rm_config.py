"""reward_model.*: what is checked before start (reward/config.py) and what verl's keys mean here."""

from __future__ import annotations

import json

import pytest

from verl_lite.config import ConfigError, load_config, validate_config


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
    """A valid one-logit sequence classifier, a two-label one and a causal LM (config + tokenizer only)."""
    from verl_lite.data.char_tokenizer import save_char_tokenizer

    root = tmp_path_factory.mktemp("rm_cfg")
    base = dict(model_type="qwen2", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=104, max_position_embeddings=128)
    out = {}
    for name, extra in {"rm": {"architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "LABEL_0"}},
                        "two_labels": {"architectures": ["Qwen2ForSequenceClassification"],
                                       "id2label": {"0": "a", "1": "b"}},
                        "causal_lm": {"architectures": ["Qwen2ForCausalLM"]}}.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **extra}))
        save_char_tokenizer(d)
        out[name] = str(d)
    return out


def problems(overrides, world_size=2) -> list[str]:
    try:
        validate_config(load_config(overrides), world_size=world_size)
    except ConfigError as e:
        return [p for p in e.problems if "reward_model" in p]
    return []


def test_a_one_logit_classifier_is_accepted_and_inherits_the_micro_batch(rm_dirs):
    cfg = load_config(["reward_model.enable=true", f"reward_model.model.path={rm_dirs['rm']}",
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"])
    validate_config(cfg, world_size=2)
    rm = cfg.reward_model
    assert rm.micro_batch_size_per_gpu == 8 and rm.model.tokenizer_path == rm_dirs["rm"]
    assert rm.rule_reward_weight == 0.0  # verl: the RM alone


def test_the_worker_config_carries_the_rm_layout(rm_dirs):
    from verl_lite.workers.from_config import reward_model_worker_config

    cfg = load_config(["reward_model.enable=true", f"reward_model.model.path={rm_dirs['rm']}",
                       "reward_model.megatron.tensor_model_parallel_size=2", "reward_model.megatron.dtype=bfloat16"])
    wc = reward_model_worker_config(cfg).engine
    assert (wc.model_path, wc.megatron.tp, wc.megatron.pp, wc.megatron.dtype, wc.lora) == (rm_dirs["rm"], 2, 1, "bfloat16", None)
    assert wc.value_head and wc.forward_only and wc.optim is None
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 1  # its own layout


@pytest.mark.parametrize("case, expected", [
    ("no_path", "needs reward_model.model.path"),
    ("causal_lm", "AutoModelForSequenceClassification"),
    ("two_labels", "has 2 labels"),
    ("micro_batch", "reward_model.micro_batch_size_per_gpu=0"),
    ("layout", "reward_model.megatron"),
    ("weight", "reward_model.rule_reward_weight"),
])
def test_bad_settings_are_rejected_before_start_naming_the_key(rm_dirs, case, expected):
    overrides = {"no_path": [], "causal_lm": [f"reward_model.model.path={rm_dirs['causal_lm']}"],
                 "two_labels": [f"reward_model.model.path={rm_dirs['two_labels']}"]}.get(
        case, [f"reward_model.model.path={rm_dirs['rm']}"])
    overrides += {"micro_batch": ["reward_model.micro_batch_size_per_gpu=0"],
                  "layout": ["reward_model.megatron.tensor_model_parallel_size=3"],
                  "weight": ["reward_model.rule_reward_weight=inf"]}.get(case, [])
    found = problems(["reward_model.enable=true", *overrides])
    assert found and all(expected in f for f in found), found


def test_disabled_rm_checks_nothing(rm_dirs):
    assert problems([f"reward_model.model.path={rm_dirs['causal_lm']}"]) == []  # verl's yaml sets a path too


@pytest.mark.parametrize("override, accepted, says", [
    ("reward_model.use_reward_loop=True", True, None),
    ("reward_model.model.use_remove_padding=True", True, None),
    ("reward_model.enable_resource_pool=False", True, None),
    ("reward_model.num_workers=8", False, "one reward process"),
    ("reward_model.micro_batch_size=32", False, "micro_batch_size_per_gpu"),
    ("reward_model.rollout.name=vllm", True, None),  # the RM is off: nothing is checked (as verl's yaml sets keys)
    ("reward_model.rollout.prompt_length=8192", True, None),
    ("reward_model.rollout.tensor_model_parallel_size=1", True, None),
    ("reward_model.rollout.tensor_model_parallel_size=2", False, "one full model"),
    ("reward_model.rollout.n=2", False, "one judgement per response"),
    ("reward_model.rollout.max_model_len=4096", False, "prompt_length + reward_model.rollout.response_length"),
    ("reward_model.rollout.cudagraph_capture_sizes=[1]", False, "judge-rollout setting of verl's is not built"),
    ("reward_model.rollout.engine_kwargs.vllm.swap_space=4", False, "judge-rollout setting of verl's is not built"),
    ("reward_model.n_gpus_per_node=8", False, "colocated"),
    ("reward_model.model.fsdp_config.param_offload=True", False, "megatron"),
    ("reward_model.sandbox_fusion.url=http://x", False, "sandbox"),
    ("reward_model.strategy=fsdp", False, "megatron"),
    ("reward_model.max_length=4096", False, "reward_model takes enable"),
    ("reward_model.model.input_tokenizer=/elsewhere", False, "actor_rollout_ref.model.tokenizer_path"),
])
def test_verl_reward_model_keys(override, accepted, says):
    key = override.split("=", 1)[0]
    try:
        validate_config(load_config([override]), world_size=2)
        found = []
    except ConfigError as e:
        found = [p for p in e.problems if key in p]
    assert (not found) == accepted, found
    if says:
        assert says in found[0], found


def test_reward_funcs_beside_a_reward_model_at_weight_zero_are_refused_before_start(rm_dirs):
    """They would never be called (the RM's score is the reward): one line at pre-flight, not a crash at step 1."""
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    def exact(completions, **kwargs):
        return [1.0 for _ in completions]

    cfg = load_config(["reward_model.enable=true", f"reward_model.model.path={rm_dirs['rm']}",
                       "trainer.n_gpus_per_node=2"])
    with pytest.raises(ConfigError) as err:
        PPOTrainer(cfg, reward_funcs=[exact])
    lines = [p for p in err.value.problems if "reward_funcs=" in p]
    assert len(lines) == 1 and "rule_reward_weight" in lines[0] and "never be called" in lines[0], err.value.problems
    cfg.reward_model.rule_reward_weight = 0.5
    with pytest.raises(ConfigError) as err:  # other problems may remain (this RM has no weights), not this one
        PPOTrainer(cfg, reward_funcs=[exact])
    assert not [p for p in err.value.problems if "reward_funcs=" in p]
