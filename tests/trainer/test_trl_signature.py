"""TRL 1.16's GRPOTrainer and GRPOConfig, read from trl itself: every parameter of ``GRPOTrainer.__init__`` and every
field of ``GRPOConfig`` (its own and transformers' TrainingArguments) has one outcome in ``trl_args`` (a field TRL
adds fails here), each translated field lands in its verl key with TRL's meaning (PPOTrainer built pre-flight,
nothing started), each refused field is named in the one ConfigError, and a config key the user set that
disagrees with ``args`` is refused. Every file written stays under the test's tmp dir (args.output_dir)."""

from __future__ import annotations

import dataclasses
import inspect
from operator import attrgetter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trl

from verl_lite.config import load_config
from verl_lite.errors import ConfigError
from verl_lite.trainer import trl_args
from verl_lite.trainer.ppo_trainer import PPOTrainer
from verl_lite.trainer.trl_args import NO_DUAL_CLIP, REFUSED, SAME, TO, TRL_FIELDS, TRL_TRAINER_ARGUMENTS

A, R, RC = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "algorithm.rollout_correction"
CUDA = torch.cuda.is_available()
VLLM = {"use_vllm": True}
CONSTANT = {"lr_scheduler_type": "constant", "loss_type": "grpo"}  # several optimizer steps per RL step allowed
FIELDS = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}


def _fields(kind: str) -> list[str]:
    return sorted(name for name, outcome in TRL_FIELDS.items() if outcome.kind == kind)


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


# a representative non-default value of each translated field: (GRPOConfig arguments, {where: expected}); where
# is a config key, or "trainer.<attribute>" of the PPOTrainer built; lambdas are read on the built trainer
TRANSLATED = {
    "num_generations": ({"num_generations": 2}, {f"{R}.n": 2, "data.train_batch_size": 4}),
    "num_generations_eval": ({"num_generations_eval": 2}, {f"{R}.val_kwargs.n": 2}),
    "max_completion_length": ({"max_completion_length": 10, "loss_type": "dr_grpo"},
                              {"data.max_response_length": 10, f"{A}.loss_scale_factor": 10.0}),
    "shuffle_dataset": ({"shuffle_dataset": False}, {"data.shuffle": False}),
    "generation_batch_size": ({"generation_batch_size": 16, **CONSTANT, "logging_steps": 2},
                              {"data.train_batch_size": 4, f"{A}.ppo_mini_batch_size": 2, f"{A}.shuffle": True}),
    "steps_per_generation": ({"steps_per_generation": 3, **CONSTANT, "logging_steps": 4, "max_steps": 3},
                             {"data.train_batch_size": 6, f"{A}.ppo_mini_batch_size": 2, "trainer.log_freq": 2,
                              "trainer.save_freq": 167, "trainer.total_training_steps": 1}),
    "temperature": ({"temperature": 0.7}, {f"{R}.temperature": 0.7, f"{R}.val_kwargs.temperature": 0.7}),
    "top_p": ({"top_p": 0.9}, {f"{R}.top_p": 0.9, f"{R}.val_kwargs.top_p": 0.9}),
    "top_k": ({"top_k": 5}, {f"{R}.top_k": 5, f"{R}.val_kwargs.top_k": 5}),
    "min_p": ({"min_p": 0.1}, {"trainer.generation_kwargs": {"min_p": 0.1}}),
    "generation_kwargs": ({"generation_kwargs": {"min_p": 0.2}, "min_p": 0.1},
                          {"trainer.generation_kwargs": {"min_p": 0.2}}),
    "repetition_penalty": ({"repetition_penalty": 1.1}, {"trainer.generation_kwargs": {"repetition_penalty": 1.1}}),
    "use_vllm": (VLLM, {f"{R}.name": "vllm", "actor_rollout_ref.hybrid_engine": True}),
    "vllm_mode": ({**VLLM, "vllm_mode": "server"}, "args.vllm_mode='server'"),
    "vllm_enable_sleep_mode": ({**VLLM, "vllm_enable_sleep_mode": True}, {f"{R}.free_cache_engine": True}),
    "vllm_gpu_memory_utilization": ({**VLLM, "vllm_gpu_memory_utilization": 0.6},
                                    {f"{R}.gpu_memory_utilization": 0.6}),
    "vllm_tensor_parallel_size": ({**VLLM, "vllm_tensor_parallel_size": 2}, {f"{R}.tensor_model_parallel_size": 2}),
    "beta": ({"beta": 0.04, "use_bias_correction_kl": False},
             {f"{A}.use_kl_loss": True, f"{A}.kl_loss_coef": 0.04, f"{A}.kl_loss_type": "low_var_kl"}),
    "use_bias_correction_kl": ({"beta": 0.04}, "args.beta=0.04 with use_bias_correction_kl=True"),
    "num_iterations": ({"num_iterations": 2, "lr_scheduler_type": "constant", "logging_steps": 2},
                       {f"{A}.ppo_epochs": 2, "trainer.log_freq": 1}),
    "epsilon": ({"epsilon": 0.1}, {f"{A}.clip_ratio_low": 0.1, f"{A}.clip_ratio_high": 0.1}),
    "epsilon_high": ({"epsilon_high": 0.28}, {f"{A}.clip_ratio_low": 0.2, f"{A}.clip_ratio_high": 0.28}),
    "delta": ({"delta": 1.5}, {f"{A}.clip_ratio_c": 1.5, f"{A}.policy_loss.loss_mode": "vanilla"}),
    "sapo_temperature_neg": ({"loss_type": "sapo", "sapo_temperature_neg": 1.2}, {f"{A}.policy_loss.tau_neg": 1.2}),
    "sapo_temperature_pos": ({"loss_type": "sapo", "sapo_temperature_pos": 0.9}, {f"{A}.policy_loss.tau_pos": 0.9}),
    "importance_sampling_level": ({"importance_sampling_level": "sequence"}, {f"{A}.policy_loss.loss_mode": "gspo"}),
    "reward_weights": ({"reward_weights": [0.5]}, {"trainer.reward_manager.weights": [0.5]}),
    "scale_rewards": ({"scale_rewards": "none"},
                      {"algorithm.norm_adv_by_std_in_grpo": False, "algorithm.adv_estimator": "grpo"}),
    "loss_type": ({"loss_type": "grpo"}, {f"{A}.loss_agg_mode": "seq-mean-token-mean"}),
    "entropy_coef": ({"entropy_coef": 0.01}, {f"{A}.entropy_coeff": 0.01}),
    "max_tool_calling_iterations": ({"max_tool_calling_iterations": 3}, {f"{R}.multi_turn.max_user_turns": 3}),
    "vllm_importance_sampling_correction": ({**VLLM, "vllm_importance_sampling_correction": False},
                                            {f"{RC}.rollout_is": None, f"{RC}.rollout_rs": None}),
    "vllm_importance_sampling_mode": ({**VLLM, "vllm_importance_sampling_mode": "token_truncate"},
                                      {f"{RC}.rollout_is": "token", f"{RC}.rollout_rs": None,
                                       f"{RC}.rollout_is_threshold": 3.0}),
    "vllm_importance_sampling_clip_max": ({**VLLM, "vllm_importance_sampling_clip_max": 2.5},
                                          {f"{RC}.rollout_is": "sequence", f"{RC}.rollout_rs": "sequence",
                                           f"{RC}.rollout_rs_threshold": 2.5, f"{RC}.rollout_is_threshold": 2.5}),
    "vllm_importance_sampling_clip_min": ({**VLLM, "vllm_importance_sampling_clip_min": 0.5},
                                          {f"{RC}.rollout_rs_threshold_lower": 0.5}),
    "vllm_importance_sampling_cap": ({**VLLM, "vllm_importance_sampling_cap": 4.0},
                                     {f"{RC}.rollout_is_threshold": 4.0}),
    "log_completions": ({"log_completions": True}, {"trainer.log_completions": True}),
    "output_dir": ({}, {"trainer.output_dir": "<tmp>", "trainer.default_local_dir": "<tmp>"}),
    "per_device_train_batch_size": ({"per_device_train_batch_size": 4, "num_generations": 2},
                                    {f"{A}.ppo_micro_batch_size_per_gpu": 4, "data.train_batch_size": 2,
                                     f"{R}.log_prob_micro_batch_size_per_gpu": 4}),
    "num_train_epochs": ({"num_train_epochs": 2, "max_steps": -1},
                         {"trainer.total_epochs": 2, "trainer.total_training_steps": None}),
    "max_steps": ({"max_steps": 6}, {"trainer.total_training_steps": 6}),
    "learning_rate": ({"learning_rate": 3e-6}, {f"{A}.optim.lr": 3e-6}),
    "lr_scheduler_type": ({"lr_scheduler_type": "cosine"}, {f"{A}.optim.lr_decay_style": "cosine"}),
    "warmup_steps": ({"warmup_steps": 2, "max_steps": 6}, {f"{A}.optim.lr_warmup_steps": 2}),
    "weight_decay": ({"weight_decay": 0.01}, {f"{A}.optim.weight_decay": 0.01}),
    "adam_beta1": ({"adam_beta1": 0.8}, {f"{A}.optim.betas": [0.8, 0.999]}),
    "adam_beta2": ({"adam_beta2": 0.95}, {f"{A}.optim.betas": [0.9, 0.95]}),
    "gradient_accumulation_steps": ({"gradient_accumulation_steps": 2, "loss_type": "grpo"},
                                    {f"{A}.ppo_mini_batch_size": 4, "data.train_batch_size": 4}),
    "max_grad_norm": ({"max_grad_norm": 0.5}, {f"{A}.optim.clip_grad": 0.5}),
    "bf16": ({"bf16": False}, {f"{A}.megatron.dtype": "float32"}),
    "activation_checkpointing": ({"activation_checkpointing": True},
                                 {"actor_rollout_ref.model.enable_gradient_checkpointing": CUDA}),
    "gradient_checkpointing": ({"gradient_checkpointing": True},
                               {"actor_rollout_ref.model.enable_gradient_checkpointing": CUDA}),
    "logging_steps": ({"logging_steps": 5}, {"trainer.log_freq": 5}),
    "report_to": ({"report_to": ["tensorboard"]}, {"trainer.logger": ["console", "jsonl", "tensorboard"]}),
    "run_name": ({"run_name": "my-run"}, {"trainer.experiment_name": "my-run"}),
    "project": ({"project": "mine"}, {"trainer.project_name": "mine"}),
    "eval_strategy": ({"eval_strategy": "steps", "eval_steps": 4}, {"trainer.test_freq": 4}),
    "eval_steps": ({"eval_strategy": "steps", "eval_steps": 3}, {"trainer.test_freq": 3}),
    "eval_on_start": ({"eval_on_start": True}, {"trainer.val_before_train": True}),
    "save_strategy": ({"save_strategy": "no"}, {"trainer.save_freq": -1}),
    "save_steps": ({"save_strategy": "steps", "save_steps": 7}, {"trainer.save_freq": 7}),
    "save_total_limit": ({"save_total_limit": 2}, {"trainer.max_actor_ckpt_to_keep": 2}),
    "seed": ({"seed": 7}, {"trainer.seed": 7, "data.seed": 7}),
    "data_seed": ({"data_seed": 9}, {"data.seed": 9, "trainer.seed": 42}),
}

# a non-default value of each refused field (set after construction, as TRL's own checks may need more)
REFUSED_VALUES = {
    "model_init_kwargs": {"dtype": "bfloat16"}, "trust_remote_code": True, "router_aux_loss_coef": 0.01,
    "cast_lm_head_to_fp32": True, "chat_template_kwargs": {"enable_thinking": False}, "vllm_model_impl": "transformers",
    "vllm_structured_outputs_regex": "[0-9]+", "multi_objective_aggregation": "normalize_then_sum",
    "mask_truncated_completions": True, "sync_ref_model": True, "top_entropy_quantile": 0.2,
    "use_adaptive_entropy": True, "off_policy_mask_threshold": 0.5, "log_completions_hub_repo": "me/completions",
    "lr_scheduler_kwargs": {"num_cycles": 2}, "optim": "sgd", "optim_args": "momentum=0.9", "adam_epsilon": 1e-6,
    "optim_target_modules": ["attn"], "fp16": True, "bf16_full_eval": True, "fp16_full_eval": True, "tf32": True,
    "neftune_noise_alpha": 5.0, "auto_find_batch_size": True, "eval_delay": 2, "enable_jit_checkpoint": True,
    "push_to_hub": True, "load_best_model_at_end": True, "metric_for_best_model": "reward",
    "greater_is_better": True, "ignore_data_skip": True, "restore_callback_states_from_checkpoint": True,
    "full_determinism": True, "accelerator_config": {"split_batches": True}, "parallelism_config": object(),
    "fsdp": ["full_shard"], "fsdp_config": {"min_num_params": 1}, "deepspeed": "ds.json",
    "debug": ["underflow_overflow"],
}


def _args(tmp_path: Path, **fields) -> trl.GRPOConfig:
    """A GRPOConfig that fits the shipped tiny task (4 samples per prompt, 12 tokens, CPU, every step logged)."""
    base = {"output_dir": str(tmp_path / "out"), "use_cpu": True, "max_completion_length": 12, "num_generations": 4,
            "logging_steps": 1, "report_to": "none", "max_steps": 4, "num_train_epochs": 1}
    return trl.GRPOConfig(**{**base, **fields})


def _build(args, cfg=None, **kwargs):
    """PPOTrainer pre-flight with ``args``; returns (the trainer or None, its config, the problems). Only the
    vLLM-cannot-run-here line is tolerated (the translation is done by then) where vLLM is not installed."""
    cfg = cfg if cfg is not None else load_config([])
    try:
        return PPOTrainer(cfg, reward_funcs=[_reward], args=args, **kwargs), cfg, []
    except ConfigError as err:
        return None, cfg, err.problems


def _read(trainer, cfg, where: str):
    if where.startswith("trainer.") and not hasattr(cfg.trainer, where.split(".")[1]):
        return attrgetter(where[len("trainer."):])(trainer)
    return attrgetter(where)(cfg)


def test_every_grpo_trainer_argument_has_one_outcome_and_is_taken_by_name():
    params = [p for p in inspect.signature(trl.GRPOTrainer.__init__).parameters if p != "self"]
    assert set(params) == set(TRL_TRAINER_ARGUMENTS), "GRPOTrainer's parameters changed: give each one an outcome"
    ours = inspect.signature(PPOTrainer.__init__).parameters
    assert [p for p in params if p not in ours] == []  # refused ones too: refused with the reason, not a TypeError


def test_every_grpo_config_field_has_one_outcome():
    assert set(FIELDS) == set(TRL_FIELDS), (f"fields without an outcome: {sorted(set(FIELDS) - set(TRL_FIELDS))}; "
                                            f"outcomes of no field: {sorted(set(TRL_FIELDS) - set(FIELDS))}")
    assert {o.kind for o in TRL_FIELDS.values()} == {TO, SAME, REFUSED}


def test_the_table_of_translated_defaults_is_trls():
    for name, default in trl_args.TRL_DEFAULTS.items():
        f = FIELDS[name]
        declared = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert declared == default, name


def test_every_translated_and_refused_field_has_a_case_here():
    assert sorted(TRANSLATED) == _fields(TO)
    assert sorted(REFUSED_VALUES) == _fields(REFUSED)


@pytest.mark.parametrize("name", _fields(TO))
def test_a_translated_field_lands_in_its_verl_key(name, tmp_path):
    fields, expected = TRANSLATED[name]
    trainer, cfg, problems = _build(_args(tmp_path, **fields))
    if isinstance(expected, str):  # a value TRL has that is refused here
        assert any(line.startswith(expected) for line in problems), problems
        return
    # lines of the landed key's own rules (vLLM's sleep mode needs a GPU) or vLLM's absence are the key's, not args'
    assert [p for p in problems if "name=vllm cannot run here" not in p and not any(k in p for k in expected)] == []
    for where, value in expected.items():
        value = str(tmp_path / "out") if value == "<tmp>" else value
        got = _read(trainer, cfg, where)
        assert got == value or Path(str(got)).resolve() == Path(str(value)).resolve(), (where, got, value)


@pytest.mark.parametrize("name", _fields(REFUSED))
def test_a_refused_field_is_named_with_its_reason(name, tmp_path):
    args = _args(tmp_path)
    setattr(args, name, REFUSED_VALUES[name])
    trainer, cfg, problems = _build(args)
    assert trainer is None
    lines = [line for line in problems if f"args.{name}=" in line or f"{name}=True" in line]
    assert lines, problems
    reason = TRL_FIELDS[name].text
    assert any(reason in line for line in lines), (lines, reason)
    assert cfg.actor_rollout_ref.actor.optim.lr == load_config([]).actor_rollout_ref.actor.optim.lr  # untouched


def _non_default(name: str):
    f = FIELDS[name]
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 2
    return {"x": 1} if isinstance(default, dict) else ["x"] if isinstance(default, list) else "x"


@pytest.mark.parametrize("name", [n for n in _fields(SAME) if not (n == "use_cpu" and CUDA)])
def test_an_accepted_field_without_effect_changes_nothing(name, tmp_path):
    args = _args(tmp_path)
    baseline = trl_args.translate(args)
    setattr(args, name, _non_default(name))
    changed = trl_args.translate(args)
    assert changed.problems == baseline.problems == []
    assert changed.assignments == baseline.assignments and changed.api == baseline.api


def test_trls_defaults_train_with_trls_values(tmp_path):
    """GRPOConfig() as it is: TRL's lr, one prompt of 8 samples per step, dapo's token-mean without dual clip, no
    KL, three epochs, no evaluation, checkpoints every 500 steps into output_dir."""
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, max_completion_length=12)
    trainer, cfg, problems = _build(args)
    assert problems == []
    a = cfg.actor_rollout_ref.actor
    assert (a.optim.lr, a.optim.lr_decay_style, a.optim.betas, a.optim.clip_grad) == (1e-6, "linear", [0.9, 0.999], 1.0)
    sizes = (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, a.ppo_mini_batch_size, a.ppo_epochs)
    assert sizes == (1, 8, 1, 1)
    assert (a.loss_agg_mode, a.policy_loss.loss_mode, a.clip_ratio_c, a.use_kl_loss) == ("token-mean", "vanilla",
                                                                                          NO_DUAL_CLIP, False)
    assert NO_DUAL_CLIP > torch.exp(torch.tensor(20.0)).item()  # above the ratio clamp: the dual clip never binds
    tr = cfg.trainer
    assert (tr.total_epochs, tr.total_training_steps, tr.test_freq, tr.val_before_train, tr.save_freq, tr.seed) == (
        3, None, 0, False, 500, 42)
    assert Path(tr.default_local_dir) == tmp_path / "out" and a.megatron.dtype == "bfloat16"


@pytest.mark.parametrize("loss_type, level, aggregation, mode", [
    ("grpo", "token", "seq-mean-token-mean", "vanilla"), ("dr_grpo", "token", "seq-mean-token-sum-norm", "vanilla"),
    ("dapo", "token", "token-mean", "vanilla"), ("bnpo", "token", "token-mean", "vanilla"),
    ("luspo", "sequence", "seq-mean-token-sum", "gspo"), ("grpo", "sequence", "seq-mean-token-mean", "gspo"),
    ("sapo", "token", "seq-mean-token-mean", "sapo"), ("cispo", "token", "token-mean", "cispo")])
def test_each_loss_type_has_trls_normalization(loss_type, level, aggregation, mode, tmp_path):
    extra = {"epsilon_high": 5.0} if loss_type == "cispo" else {}
    trainer, cfg, problems = _build(_args(tmp_path, loss_type=loss_type, importance_sampling_level=level, **extra))
    a = cfg.actor_rollout_ref.actor
    assert problems == [] and (a.loss_agg_mode, a.policy_loss.loss_mode) == (aggregation, mode)
    if loss_type == "cispo":  # TRL: weight min(r, epsilon_high), no lower bound
        assert (a.clip_ratio_low, a.clip_ratio_high) == (1.0, 4.0)


@pytest.mark.parametrize("fields, named", [
    ({"loss_type": "bnpo", "gradient_accumulation_steps": 2}, "args.loss_type='bnpo'"),
    ({"steps_per_generation": 2, "lr_scheduler_type": "constant"}, "args.loss_type='dapo'"),
    ({"steps_per_generation": 2, "loss_type": "grpo"}, "args.lr_scheduler_type='linear'"),
    ({"gradient_accumulation_steps": 2, "steps_per_generation": 3, **CONSTANT}, "args.steps_per_generation=3"),
    ({"per_device_train_batch_size": 2, "steps_per_generation": 2, **CONSTANT}, "args.per_device_train_batch_size"),
    ({"scale_rewards": "batch"}, "args.scale_rewards='batch'"),
    ({"delta": 1.1}, "args.delta=1.1"),
    ({"importance_sampling_level": "sequence", "delta": 2.0}, "args.delta=2.0"),
    ({"loss_type": "vespo"}, "args.loss_type='vespo'"),
    ({"entropy_coef": 0.01, "loss_type": "grpo"}, "args.entropy_coef=0.01"),
    ({"max_steps": 3, "num_iterations": 2, "lr_scheduler_type": "constant"}, "args.max_steps=3"),
    ({"eval_strategy": "epoch"}, "args.eval_strategy='epoch'"),
    ({"report_to": ["mlflow"]}, "args.report_to='mlflow'"),
    ({"max_grad_norm": 0.0}, "args.max_grad_norm=0.0")])
def test_what_cannot_keep_trls_meaning_is_refused_naming_the_fields(fields, named, tmp_path):
    trainer, cfg, problems = _build(_args(tmp_path, **fields))
    assert trainer is None and any(line.startswith(named) for line in problems), problems


def test_a_config_key_that_disagrees_with_args_is_refused(tmp_path):
    cfg = load_config(["actor_rollout_ref.actor.optim.lr=3e-5", "data.train_batch_size=4"])
    trainer, cfg, problems = _build(_args(tmp_path, learning_rate=3e-5, num_generations=2), cfg=cfg)
    assert trainer is not None and cfg.actor_rollout_ref.actor.optim.lr == 3e-5  # the same value: accepted
    cfg = load_config(["actor_rollout_ref.actor.optim.lr=3e-5"])
    trainer, cfg, problems = _build(_args(tmp_path), cfg=cfg)
    assert [line for line in problems if "optim.lr" in line] == [
        "args.learning_rate (TRL's default) gives actor_rollout_ref.actor.optim.lr=1e-06 and the config sets "
        "actor_rollout_ref.actor.optim.lr=3e-05: two values for one setting; give one of them (drop the config key "
        "or set args.learning_rate)"]
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-5 and cfg.trainer.output_dir == "outputs/verl_lite"


def test_reward_weights_and_generation_kwargs_given_twice_must_agree(tmp_path):
    args = _args(tmp_path, reward_weights=[0.5], generation_kwargs={"min_p": 0.1})
    _, _, problems = _build(args, reward_weights=[2.0], generation_kwargs={"min_p": 0.3})
    assert any(line.startswith("args.reward_weights=[0.5] and reward_weights=[2.0]") for line in problems)
    assert any(line.startswith("args.generation_kwargs={'min_p': 0.1} and generation_kwargs=") for line in problems)
    trainer, _, problems = _build(args, reward_weights=[0.5])
    assert problems == [] and trainer.reward_manager.weights == [0.5]


def test_optimizers_and_quantization_config_are_refused_with_the_reason():
    params = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ConfigError) as err:
        PPOTrainer(load_config([]), optimizers=(torch.optim.AdamW(params), None),
                   quantization_config={"load_in_4bit": True})
    assert [line.split(":")[0] for line in err.value.problems] == ["optimizers=", "quantization_config="]
    assert "distributed Adam(W)" in str(err.value) and "bitsandbytes" in str(err.value)
    PPOTrainer(load_config([]), optimizers=(None, None))  # TRL's default: accepted


def test_a_model_object_is_saved_under_output_dir_and_a_peft_model_is_refused(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = load_config([])
    model = AutoModelForCausalLM.from_pretrained(cfg.actor_rollout_ref.model.path)
    trainer, cfg, problems = _build(_args(tmp_path), model=model)
    saved = Path(cfg.actor_rollout_ref.model.path)
    assert problems == [] and saved.parent == tmp_path / "out" and (saved / "config.json").is_file()
    default_out = Path(cfg.trainer.output_dir)
    before = sorted(default_out.iterdir()) if default_out.is_dir() else []
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    _, _, problems = _build(_args(tmp_path / "peft", learning_rate=-1.0), model=peft_model)  # args refused too
    assert [line for line in problems if line.startswith("model= is a PeftModel")] and not (tmp_path / "peft").exists()
    assert (sorted(default_out.iterdir()) if default_out.is_dir() else []) == before  # nothing saved anywhere


def test_the_docs_carry_the_generated_table():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "python_api.md").read_text()
    assert trl_args.fields_markdown() in docs, "regenerate: python -c 'from verl_lite.trainer.trl_args import " \
                                               "fields_markdown; print(fields_markdown())'"


def test_args_are_read_by_name_so_a_copy_without_trl_works(tmp_path):
    """A TrainingArguments-like object carrying GRPOConfig's fields (no trl class): the same translation."""
    import transformers

    @dataclasses.dataclass
    class Carrying(transformers.TrainingArguments):  # a few of GRPOConfig's fields; the others: TRL's defaults
        num_generations: int = 8
        max_completion_length: int = 512
        loss_type: str = "dapo"

    shared = {"output_dir": str(tmp_path / "out"), "use_cpu": True, "learning_rate": 2e-6, "logging_steps": 1,
              "bf16": True, "gradient_checkpointing": True, "max_steps": 4, "report_to": "none"}
    given = {"num_generations": 4, "max_completion_length": 12, "loss_type": "grpo"}
    ours, trls = trl_args.translate(Carrying(**shared, **given)), trl_args.translate(trl.GRPOConfig(**shared, **given))
    assert ours.problems == trls.problems == [] and ours.assignments == trls.assignments
    with pytest.raises(ConfigError, match="args= is a SimpleNamespace"):
        PPOTrainer(load_config([]), args=SimpleNamespace(learning_rate=1e-5))
