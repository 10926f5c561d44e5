"""verl's launch-script vocabulary: every key is accepted (and does what it does in verl) or rejected
before start with a reason that names it; none gets the generic unknown-key message.

`verl_vocabulary.json` (next to this file) is DATA: the keys that verl's GRPO / PPO / GSPO / DAPO
launch scripts set, one example value each. The spot checks below prove that accepted keys
change what they should (the resulting config, the engine's config, the trainer's step count).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_lite.config import ConfigError, load_config, validate_config
from verl_lite.config.verl_keys import decide

VOCAB = json.loads((Path(__file__).parent / "verl_vocabulary.json").read_text())["keys"]
A, R, REF, M = ("actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref",
                "actor_rollout_ref.actor.megatron")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def outcome(override: str, world_size: int = 64) -> tuple[str, list[str]]:
    """('accepted', []) or ('rejected', the problems that name the key)."""
    key = override.lstrip("+").split("=", 1)[0]
    decision = decide(key, None)
    names = [key] + ([decision.target] if decision is not None and decision.kind == "alias" else [])
    try:
        cfg = load_config([override])
    except ConfigError as e:
        return "rejected", list(e.problems)
    try:
        validate_config(cfg, world_size=world_size)
    except ConfigError as e:
        # Only problems about this key count: the example values name files and layouts of verl's machines.
        mine = [p for p in e.problems if any(p.startswith(n) or f" {n}" in p for n in names)]
        if mine:
            return "rejected", mine
    return "accepted", []


def test_vocabulary_is_verl_data():
    assert len(VOCAB) >= 250
    for key in ("actor_rollout_ref.model.use_remove_padding", "trainer.balance_batch", "model_engine",
                f"{REF}.megatron.tensor_model_parallel_size", "custom_reward_function.path", "data.gen_batch_size"):
        assert key in VOCAB, key


def test_every_verl_key_is_accepted_or_rejected_with_a_reason():
    counts = {"accepted": 0, "rejected": 0}
    for key, entry in VOCAB.items():
        kind, problems = outcome(f"{key}={entry['example']}")
        counts[kind] += 1
        for p in problems:
            assert "unknown config key" not in p, (key, p)
        if kind == "rejected":  # the message names the key (or, for an alias, verl_lite's name of it)
            target = decide(key, None)
            names = [key] + ([target.target] if target is not None and target.kind == "alias" else [])
            assert any(n in p for p in problems for n in names), (key, problems)
            assert all(len(p.split(":", 1)[-1].strip()) > 20 for p in problems), (key, problems)  # a reason, not a bare "no"
    assert counts["accepted"] > 100 and counts["rejected"] > 50, counts


# An independent expectation per key, from verl's meaning of the key and what verl_lite builds.
EXPECTED = [
    ("actor_rollout_ref.model.use_remove_padding=True", "accepted"),
    ("actor_rollout_ref.model.use_remove_padding=False", "rejected"),
    ("trainer.balance_batch=True", "accepted"),
    ("trainer.balance_batch=False", "rejected"),
    ("model_engine=megatron", "accepted"),
    ("model_engine=fsdp", "rejected"),
    (f"{A}.strategy=fsdp2", "rejected"),
    (f"{A}.fsdp_config.param_offload=False", "rejected"),
    (f"{M}.param_offload=True", "rejected"),
    (f"{M}.param_offload=False", "accepted"),
    (f"{M}.expert_model_parallel_size=8", "rejected"),
    (f"{M}.expert_model_parallel_size=1", "accepted"),
    (f"{REF}.megatron.tensor_model_parallel_size=1", "accepted"),
    (f"{REF}.megatron.tensor_model_parallel_size=2", "rejected"),  # the actor's is 1
    ("actor_rollout_ref.model.lora.rank=64", "accepted"),
    ("actor_rollout_ref.model.lora_rank=0", "accepted"),
    ("actor_rollout_ref.model.lora_rank=8", "accepted"),
    ("actor_rollout_ref.model.lora.rank=-1", "rejected"),
    ("actor_rollout_ref.model.lora.type=dora", "rejected"),
    ("actor_rollout_ref.model.lora.merge=False", "rejected"),
    ("actor_rollout_ref.model.lora.dropout_position=post", "rejected"),
    ("actor_rollout_ref.model.lora.lora_A_init_method=xavier", "rejected"),
    ("actor_rollout_ref.model.lora.a2a_experimental=True", "rejected"),
    ("critic.model.lora_rank=8", "accepted"),
    ("reward_model.enable=False", "accepted"),
    ("reward_model.enable=True", "rejected"),
    ("reward_model.reward_manager=dapo", "accepted"),
    ("reward_model.reward_manager=prime", "rejected"),
    ("reward_manager.name=batch", "accepted"),
    ("reward.reward_manager.name=naive", "accepted"),
    ("reward.reward_manager=naive", "accepted"),
    ("custom_reward_function.name=compute_score", "accepted"),
    ("trainer.logger=['console','wandb']", "accepted"),
    ("trainer.device=npu", "rejected"),
    ("trainer.log_val_generations=0", "accepted"),
    ("trainer.log_val_generations=10", "accepted"),
    ("data.gen_batch_size=16", "accepted"),
    ("data.gen_batch_size=48", "rejected"),
    (f"{R}.tensor_model_parallel_size=1", "accepted"),
    (f"{R}.tensor_model_parallel_size=2", "rejected"),
    (f"{R}.gpu_memory_utilization=0.6", "accepted"),
    (f"{R}.mode=async", "accepted"),
    (f"{R}.max_num_batched_tokens=8192", "rejected"),
    (f"+{M}.override_transformer_config.deallocate_pipeline_outputs=True", "accepted"),
    (f"+{M}.override_transformer_config.moe_grouped_gemm=True", "rejected"),
    (f"+{M}.override_transformer_config.apply_rope_fusion=True", "rejected"),
    (f"+{M}.override_transformer_config.apply_rope_fusion=False", "accepted"),
    (f"+{M}.override_transformer_config.not_a_field=1", "rejected"),
    ("actor_rollout_ref.model.enable_gradient_checkpointing=True", "accepted" if _cuda() else "rejected"),
    (f"+{M}.override_transformer_config.recompute_granularity=full", "accepted" if _cuda() else "rejected"),
    ("data.return_raw_chat=True", "accepted"),
    (f"{A}.optim.lr_warmup_steps_ratio=0.1", "rejected"),
    ("trainer.total_training_steps=null", "accepted"),
    ("algorithm.rollout_correction.rollout_is_threshold=2.0", "accepted"),
    ("async_training.partial_rollout=true", "rejected"),
]


def test_expected_decisions():
    wrong = []
    for override, expected in EXPECTED:
        kind, problems = outcome(override, world_size=8)
        if kind != expected:
            wrong.append((override, expected, kind, problems))
    assert not wrong, wrong


# ---------------------------------------------------------------- accepted keys change what they should


def test_aliases_set_verl_lite_keys():
    cfg = load_config([
        "custom_reward_function.path=/tmp/r.py", "custom_reward_function.name=my_score",
        "reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=5", "+reward_model.reward_kwargs.max_resp_len=12",
        "actor_rollout_ref.nccl_timeout=1234", f"{A}.grad_clip=0.5",
    ])
    rw = cfg.reward
    assert (rw.custom_reward_function.path, rw.custom_reward_function.name) == ("/tmp/r.py", "my_score")
    assert rw.reward_manager == "naive" and rw.overlong_buffer.enable and rw.overlong_buffer.len == 5
    assert cfg.actor_rollout_ref.actor.megatron.timeout_s == 1234
    assert cfg.actor_rollout_ref.actor.optim.clip_grad == 0.5
    for override in ("reward_manager.name=batch", "reward.reward_manager.name=batch", "reward.reward_manager=batch"):
        assert load_config([override]).reward.reward_manager == "batch", override


def test_max_resp_len_must_match_the_response_length():
    with pytest.raises(ConfigError, match="data.max_response_length"):
        load_config(["+reward_model.reward_kwargs.max_resp_len=8192"])


def test_ref_layout_equal_to_the_actors_is_accepted_in_any_order():
    overrides = [f"{REF}.megatron.tensor_model_parallel_size=2", f"{M}.tensor_model_parallel_size=2",
                 f"{REF}.megatron.pipeline_model_parallel_size=2", f"{M}.pipeline_model_parallel_size=2"]
    cfg = load_config(overrides)
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match="process group"):
        load_config(overrides[:3])  # actor pp stays 1, ref pp 2


def test_log_prob_keys_follow_the_actor_unless_set():
    cfg = load_config([f"{A}.use_dynamic_bsz=true", f"{A}.ppo_max_token_len_per_gpu=512",
                       f"{R}.log_prob_max_token_len_per_gpu=256"])
    ref, rollout = cfg.actor_rollout_ref.ref, cfg.actor_rollout_ref.rollout
    assert ref.log_prob_use_dynamic_bsz is True and rollout.log_prob_use_dynamic_bsz is True
    assert ref.log_prob_max_token_len_per_gpu == 512 and rollout.log_prob_max_token_len_per_gpu == 256
    cfg = load_config([f"{REF}.log_prob_use_dynamic_bsz=true"])
    assert cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz is True
    assert cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz is False  # the actor's default


def test_total_training_steps_null_derives_from_epochs():
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    assert load_config([]).trainer.total_training_steps is None
    steps = {}
    for epochs in (1, 3):
        trainer = PPOTrainer(load_config([f"trainer.total_epochs={epochs}"]))
        try:
            steps[epochs] = (trainer.total_steps(), trainer.steps_per_epoch())
        finally:
            trainer.reward_manager.close()
    assert steps[1] == (60, 60)  # the default job: 960 built-in prompts / 16 per step
    assert steps[3] == (180, 60)


def test_default_train_split_gives_the_same_batches_as_the_full_split():
    """The shipped 960-prompt split replays the first 60 batches a run over all 8000 would see."""
    import pyarrow.parquet as pq

    from verl_lite.config import default_data_files
    from verl_lite.data.dataset import iterate_batches

    train = pq.read_table(default_data_files()[0][0]).to_pylist()
    full = pq.read_table(Path(default_data_files()[0][0]).with_name("sft_train.parquet")).to_pylist()
    got = [[r["prompt"][0]["content"] for r in b] for b in iterate_batches(train, 16, True, 0, 0)]
    want = [[r["prompt"][0]["content"] for r in b] for b, _ in zip(iterate_batches(full, 16, True, 0, 0), range(60))]
    assert len(got) == 60 and got == want


def test_gradient_checkpointing_and_transformer_overrides_reach_the_engine_config(tmp_path):
    """model.enable_gradient_checkpointing -> megatron activation recompute in the TransformerConfig the
    engine builds; override_transformer_config fields land there too (and win)."""
    from transformers import AutoConfig

    from verl_lite.engine.config import MegatronConfig
    from verl_lite.engine.model import transformer_config_from_hf
    from verl_lite.workers.from_config import actor_worker_config

    # load_config accepts them on every machine; validate_config rejects recompute on CPU (see EXPECTED)
    cfg = load_config(["actor_rollout_ref.model.enable_gradient_checkpointing=true",
                       f"+{M}.override_transformer_config.deallocate_pipeline_outputs=true",
                       f"+{M}.override_transformer_config.recompute_num_layers=2"])
    arr = cfg.actor_rollout_ref
    overrides = actor_worker_config(cfg, 10, False).engine.model_overrides
    assert overrides == {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2,
                         "deallocate_pipeline_outputs": True}
    tc = transformer_config_from_hf(AutoConfig.from_pretrained(arr.model.path), MegatronConfig.layout(), **overrides)
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "uniform", 2)
    assert tc.deallocate_pipeline_outputs is True
    plain = transformer_config_from_hf(AutoConfig.from_pretrained(arr.model.path), MegatronConfig.layout(),
                                        **actor_worker_config(load_config([]), 10, False).engine.model_overrides)
    assert plain.recompute_granularity is None


def test_docs_config_md_is_generated_from_the_schema():
    from tests.config.config_docs import docs

    assert docs.DOC_PATH.read_text() == docs.render(), "docs/config.md is stale: run `python scripts/config_docs.py`"


def test_vllm_engine_keys_reach_vllm():
    """rollout.enable_chunked_prefill / max_num_batched_tokens / max_num_seqs go to vllm.LLM as they are;
    with the hf rollout they are rejected (it has no such setting)."""
    from verl_lite.rollout import rollout_kwargs, vllm_unavailable_reason

    keys = [f"{R}.enable_chunked_prefill=False", f"{R}.max_num_batched_tokens=512", f"{R}.max_num_seqs=7"]
    with pytest.raises(ConfigError, match="vLLM engine setting"):
        validate_config(load_config(keys))
    cfg = load_config([f"{R}.name=vllm", *keys])
    kw = rollout_kwargs(cfg.actor_rollout_ref.rollout, 28)
    assert kw["engine_args"] == {"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_num_seqs": 7}
    assert "engine_args" not in rollout_kwargs(load_config([]).actor_rollout_ref.rollout, 28)
    if vllm_unavailable_reason() is not None:
        pytest.skip(f"vLLM not importable here ({vllm_unavailable_reason()[:60]}...): checked up to rollout_kwargs")
    from transformers import AutoTokenizer

    from verl_lite.rollout import make_rollout

    path = cfg.actor_rollout_ref.model.path
    rollout = make_rollout("vllm", path, AutoTokenizer.from_pretrained(path), **kw)
    sched = rollout.llm.llm_engine.vllm_config.scheduler_config
    rollout.close()  # one vLLM engine per process at a time (VLLMRollout)
    assert (sched.enable_chunked_prefill, sched.max_num_batched_tokens, sched.max_num_seqs) == (False, 512, 7)
