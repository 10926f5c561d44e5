"""TRL 1.16's ``GRPOTrainer`` arguments and ``GRPOConfig`` fields (its own and transformers' ``TrainingArguments``)
in verl_lite's config, with TRL's meaning. ``TRL_FIELDS`` gives every field one outcome (``Outcome.kind``):
translated into verl key(s) (``translate``, TRL's defaults included), accepted with no effect on what trains, or
refused unless at TRL's default. A combination no translation expresses exactly is refused naming the fields.
``use_trl_arguments`` applies it all to the config, every problem in one ConfigError, and refuses a config key
the user set that disagrees with ``args`` (``loader.Routed.disagreements``' rule). trl itself is not imported.
"""

from __future__ import annotations

import dataclasses
import math
import os
from functools import partial
from operator import attrgetter
from typing import NamedTuple

from verl_lite.config.loader import (INHERITED, ConfigError, default_checkpoint_dir, default_experiment_name,
                                     resolve_inherited)
from verl_lite.config.schema import PPOConfig
from verl_lite.engine.config import FP16_UNSUPPORTED

TO, SAME, REFUSED = "to", "same", "refused"
A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
RC = "algorithm.rollout_correction"
NO_DUAL_CLIP = 1e9  # clip_ratio_c above exp(RATIO_LOG_CLAMP) = e^20: the dual clip never binds (TRL has none)
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # report_to -> trainer.logger
ADAMW = ("adamw_torch", "adamw_torch_fused")  # TRL's optim names for the Adam(W) the engine builds


class Outcome(NamedTuple):
    kind: str  # TO: translated | SAME: accepted, no effect here | REFUSED: refused unless at TRL's default
    text: str  # TO: the verl key(s); SAME: why nothing that trains changes; REFUSED: why, and what to use


_to, _same, _no = (partial(Outcome, kind) for kind in (TO, SAME, REFUSED))


BATCH = (f"data.train_batch_size, {R}.n, {A}.ppo_mini_batch_size, {A}.ppo_micro_batch_size_per_gpu "
         f"(TRL's batch arithmetic, docs/python_api.md)")
LOSS = f"{A}.loss_agg_mode, {A}.policy_loss.loss_mode, {A}.clip_ratio_c"
SCHEDULE_STEPS = "optimizer steps, converted to RL steps (a whole number of them)"
EVERY_STEPS = "optimizer steps, converted to RL steps (rounded up)"
VLLM_SERVER = _same("read only in vllm_mode='server', which is refused")
PREDICTION_LOOP = _same("the Trainer's prediction loop; validation here generates and scores")
DATALOADER = _same("how rows are loaded, not which")
ONLY_HUB = _same("read only with push_to_hub=True, which is refused")
ONLY_ADAPTIVE = _same("read only with use_adaptive_entropy=True, which is refused")
SPEED = _same("speed or memory only: what trains is the same")
LOGGING = _same("logging only")


def _each(names: str, outcome: Outcome) -> dict[str, Outcome]:
    """The same ``outcome`` for each of the space-separated field ``names``."""
    return dict.fromkeys(names.split(), outcome)


# every field of TRL 1.16's GRPOConfig (its own, then transformers' TrainingArguments): one outcome each
TRL_FIELDS: dict[str, Outcome] = {
    # --- GRPOConfig's own
    "model_init_kwargs": _no("the engine loads the model from model.path/config.json; set bf16= for bf16 training"),
    "trust_remote_code": _no("custom model code is not loaded: the engine builds Qwen2/Qwen3/Llama/Qwen-MoE from "
                             "config.json"),
    "router_aux_loss_coef": _no(f"set {A}.megatron.override_transformer_config.moe_aux_loss_coeff (megatron's "
                                f"router loss) instead"),
    "disable_dropout": _same("the engine always runs without dropout (TRL's disable_dropout=True)"),
    "cast_lm_head_to_fp32": _no("an fp32 LM head in a bf16 model is not built; train in float32 (bf16=False)"),
    "num_generations": _to(f"{R}.n"),
    "num_generations_eval": _to(f"{R}.val_kwargs.n"),
    "max_completion_length": _to(f"data.max_response_length (and {A}.loss_scale_factor for dr_grpo)"),
    "ds3_gather_for_generation": _same("DeepSpeed ZeRO-3 only; the engine is megatron"),
    "shuffle_dataset": _to("data.shuffle"),
    "pad_to_multiple_of": _same("padding only: sequences are packed (THD) here"),
    **_each("generation_batch_size steps_per_generation", _to(BATCH)),
    "temperature": _to(f"{R}.temperature (and {R}.val_kwargs.temperature: TRL evaluates with the same sampling)"),
    "top_p": _to(f"{R}.top_p, {R}.val_kwargs.top_p"),
    "top_k": _to(f"{R}.top_k, {R}.val_kwargs.top_k"),
    "min_p": _to("generation_kwargs['min_p']"),
    "generation_kwargs": _to("generation_kwargs (the backend's; checked like PPOTrainer's generation_kwargs=)"),
    "chat_template_kwargs": _no("extra chat-template arguments are not passed; render the prompts yourself "
                                "(plain-text prompts are tokenized as they are)"),
    "repetition_penalty": _to("generation_kwargs['repetition_penalty']"),
    "cache_implementation": SPEED,
    "use_vllm": _to(f"{R}.name (vllm / hf) and actor_rollout_ref.hybrid_engine"),
    "vllm_mode": _to("actor_rollout_ref.hybrid_engine=true (colocate); 'server' (a separate `vllm serve`) is "
                     "refused: the rollout workers host vLLM themselves"),
    "vllm_model_impl": _no("vLLM's own model implementation is the one built ('vllm')"),
    "vllm_enable_sleep_mode": _to(f"{R}.free_cache_engine"),
    "vllm_structured_outputs_regex": _no("structured (regex-constrained) outputs are not built in the rollout"),
    **_each("vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout vllm_group_port",
            VLLM_SERVER),
    "vllm_gpu_memory_utilization": _to(f"{R}.gpu_memory_utilization"),
    "vllm_max_model_length": _same("vLLM's context here is data.max_prompt_length + data.max_response_length"),
    "vllm_tensor_parallel_size": _to(f"{R}.tensor_model_parallel_size"),
    "beta": _to(f"{A}.use_kl_loss, {A}.kl_loss_coef, {A}.kl_loss_type=low_var_kl (TRL's k3), "
                f"algorithm.use_kl_in_reward=false"),
    "num_iterations": _to(f"{A}.ppo_epochs"),
    "epsilon": _to(f"{A}.clip_ratio, {A}.clip_ratio_low"),
    "delta": _to(f"{A}.clip_ratio_c (two-sided clip = the dual clip, when delta >= 1 + epsilon_high)"),
    "epsilon_high": _to(f"{A}.clip_ratio_high (cispo: epsilon_high - 1)"),
    "sapo_temperature_neg": _to(f"{A}.policy_loss.tau_neg"),
    "sapo_temperature_pos": _to(f"{A}.policy_loss.tau_pos"),
    **_each("vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg",
            _same("read only by loss_type='vespo', which is refused")),
    "importance_sampling_level": _to(f"{A}.policy_loss.loss_mode (sequence = gspo)"),
    "reward_weights": _to("reward_weights"),
    "multi_objective_aggregation": _no("'normalize_then_sum' (GDPO) is not built: the functions' weighted sum is "
                                       "normalized per group"),
    "scale_rewards": _to("algorithm.adv_estimator=grpo, algorithm.norm_adv_by_std_in_grpo ('batch' is refused)"),
    "loss_type": _to(LOSS),
    "mask_truncated_completions": _no("dropping truncated completions from the loss is not built; raise "
                                      "max_completion_length, or shape overlong answers (reward.overlong_buffer)"),
    "sync_ref_model": _no("TR-DPO's reference-model sync is not built: the reference stays the initial policy"),
    **_each("ref_model_mixup_alpha ref_model_sync_steps",
            _same("read only with sync_ref_model=True, which is refused")),
    "top_entropy_quantile": _no("the high-entropy token mask is not built; use 1.0 (every token)"),
    "entropy_coef": _to(f"{A}.entropy_coeff (when the loss aggregates as TRL's bonus does)"),
    "use_adaptive_entropy": _no("adaptive entropy control is not built; use a fixed entropy_coef"),
    **_each("entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target", ONLY_ADAPTIVE),
    "max_tool_calling_iterations": _to(f"{R}.multi_turn.max_user_turns"),
    "vllm_importance_sampling_correction": _to(f"{RC}.rollout_is / rollout_rs (with use_vllm)"),
    "vllm_importance_sampling_mode": _to(f"{RC}.rollout_is, {RC}.rollout_rs"),
    "vllm_importance_sampling_clip_max": _to(f"{RC}.rollout_is_threshold, {RC}.rollout_rs_threshold"),
    "vllm_importance_sampling_clip_min": _to(f"{RC}.rollout_rs_threshold_lower (mask modes)"),
    "off_policy_mask_threshold": _no("off-policy sequence masking (DeepSeek-V3.2) is not built; see "
                                     f"{RC}.rollout_rs for rejection by the rollout ratio"),
    "use_bias_correction_kl": _to(f"{A}.kl_loss_type (with beta != 0 only False: the KL loss here carries no "
                                  f"importance ratio)"),
    "log_completions": _to("log_completions"),
    "log_multimodal": _same("text-only models here"),
    "num_completions_to_print": _same("console printing only"),
    "log_unique_prompts": _same("which prompts a completion log shows, only"),
    "log_completions_hub_repo": _no("uploading completions to the Hub is not built (no hub access)"),
    **_each("use_transformers_continuous_batching transformers_continuous_batching_config use_transformers_paged",
            SPEED),
    "vllm_importance_sampling_cap": _to(f"{RC}.rollout_is_threshold (TRL's deprecated name of "
                                        f"vllm_importance_sampling_clip_max)"),
    # --- transformers' TrainingArguments (GRPOConfig's defaults)
    "output_dir": _to("trainer.output_dir, trainer.default_local_dir (checkpoints)"),
    "per_device_train_batch_size": _to(BATCH),
    "num_train_epochs": _to("trainer.total_epochs (whole epochs)"),
    "max_steps": _to(f"trainer.total_training_steps ({SCHEDULE_STEPS})"),
    "learning_rate": _to(f"{A}.optim.lr"),
    "lr_scheduler_type": _to(f"{A}.optim.lr_decay_style (linear, cosine, constant, constant_with_warmup)"),
    "lr_scheduler_kwargs": _no("scheduler arguments are not built: linear, cosine and constant take none"),
    "warmup_steps": _to(f"{A}.optim.lr_warmup_steps ({SCHEDULE_STEPS}; a ratio < 1 needs max_steps)"),
    "optim": _no(f"the engine builds Adam(W) with decoupled weight decay ({' / '.join(ADAMW)}); no other optimizer"),
    "optim_args": _no("optimizer arguments beyond lr, betas and weight decay are not built"),
    "weight_decay": _to(f"{A}.optim.weight_decay"),
    "adam_beta1": _to(f"{A}.optim.betas[0]"),
    "adam_beta2": _to(f"{A}.optim.betas[1]"),
    "adam_epsilon": _no("the engine's Adam epsilon is 1e-8 (TRL's default); it is not a setting"),
    "optim_target_modules": _no("GaLore/APOLLO-style optimizers are not built"),
    "gradient_accumulation_steps": _to(BATCH),
    "average_tokens_across_devices": _same("GRPO's loss normalizes by loss_type (TRL's too), not by the Trainer"),
    "max_grad_norm": _to(f"{A}.optim.clip_grad (> 0; use a large value to effectively disable clipping)"),
    "label_smoothing_factor": _same("GRPO's loss reads no labels (TRL's neither)"),
    "bf16": _to(f"{A}.megatron.dtype (bfloat16: bf16 compute, fp32 main params)"),
    "fp16": _no(FP16_UNSUPPORTED),
    **_each("bf16_full_eval fp16_full_eval",
            _no("evaluation generates with the rollout's dtype (actor_rollout_ref.rollout.dtype)")),
    "tf32": _no("TF32 matmuls are not switched on (float32 stays exact); leave it unset or False"),
    "activation_checkpointing": _to("actor_rollout_ref.model.enable_gradient_checkpointing (transformers' new "
                                    "name of gradient_checkpointing)"),
    "activation_checkpointing_kwargs": SPEED,
    "gradient_checkpointing": _to("actor_rollout_ref.model.enable_gradient_checkpointing (GPU only; off on CPU, "
                                  "where megatron's recompute cannot run: the math is the same)"),
    **_each("gradient_checkpointing_kwargs torch_compile torch_compile_backend torch_compile_mode use_liger_kernel "
            "liger_kernel_config use_cache", SPEED),
    "neftune_noise_alpha": _no("NEFTune embedding noise is not built"),
    "torch_empty_cache_steps": SPEED,
    "auto_find_batch_size": _no("TRL refuses it too: the batch must hold whole prompt groups"),
    "logging_strategy": _same("metrics.jsonl records every RL step; the console line follows logging_steps"),
    "logging_steps": _to(f"trainer.log_freq ({EVERY_STEPS})"),
    "logging_first_step": _same("metrics.jsonl records every RL step"),
    "log_on_each_node": LOGGING,
    "logging_nan_inf_filter": _same("logging only (a non-finite loss stops the run here)"),
    **_each("include_num_input_tokens_seen log_level log_level_replica disable_tqdm", LOGGING),
    "report_to": _to("trainer.logger (none / tensorboard / wandb; the console and metrics.jsonl always)"),
    "run_name": _to("trainer.experiment_name"),
    "project": _to("trainer.project_name"),
    **_each("trackio_space_id trackio_bucket_id trackio_static_space_id",
            _same("read only by report_to='trackio', which is refused")),
    "eval_strategy": _to("trainer.test_freq ('no' = 0, 'steps' = eval_steps; 'epoch' is refused)"),
    "eval_steps": _to(f"trainer.test_freq ({EVERY_STEPS}; None = logging_steps, as TRL)"),
    "eval_delay": _no("validation starts at trainer.test_freq; a delay is not built"),
    "per_device_eval_batch_size": _same("batching of validation generation only"),
    **_each("prediction_loss_only eval_do_concat_batches eval_use_gather_object eval_accumulation_steps "
            "include_for_metrics batch_eval_metrics", PREDICTION_LOOP),
    "eval_on_start": _to("trainer.val_before_train"),
    "save_only_model": _same("checkpoints here always hold the optimizer too (more is kept, nothing changes)"),
    "save_strategy": _to("trainer.save_freq ('no' = -1, 'steps' = save_steps; 'epoch' / 'best' are refused)"),
    "save_steps": _to(f"trainer.save_freq ({EVERY_STEPS})"),
    "save_on_each_node": _same("where checkpoints are written on a multi-node job, only"),
    "save_total_limit": _to("trainer.max_actor_ckpt_to_keep"),
    "enable_jit_checkpoint": _no("a checkpoint on SIGTERM is not built; checkpoint with save_steps"),
    "push_to_hub": _no("uploading to the Hugging Face Hub is not built here (no hub access); train, then "
                       "trainer.save_pretrained(dir) and upload dir with `huggingface-cli upload`"),
    **_each("hub_token hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision", ONLY_HUB),
    "load_best_model_at_end": _no("the final policy is the last step's; best-checkpoint selection is not built"),
    **_each("metric_for_best_model greater_is_better", _no("best-checkpoint selection is not built")),
    "ignore_data_skip": _no("a resumed run always continues the data where the checkpoint left it"),
    "restore_callback_states_from_checkpoint": _no("callback state is not checkpointed"),
    "full_determinism": _no("torch's deterministic-algorithms mode is not switched on; runs are seeded "
                            "(trainer.seed)"),
    "seed": _to("trainer.seed, data.seed (unless data_seed)"),
    "data_seed": _to("data.seed"),
    "use_cpu": _same("the same on a machine without a GPU; refused where one is visible (the workers use it)"),
    "accelerator_config": _no("accelerate is not used: the megatron layout keys place the model"),
    "parallelism_config": _no(f"set the layout with {A}.megatron.* (tensor/pipeline/context parallel sizes)"),
    "dataloader_drop_last": _same("every RL step takes whole generation batches (TRL's sampler too)"),
    **_each("dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers dataloader_prefetch_factor "
            "dataloader_multiprocessing_context dataloader_in_order", DATALOADER),
    "remove_unused_columns": _same("every column reaches the reward functions by name (TRL's False)"),
    "label_names": _same("GRPO's loss reads no labels"),
    "train_sampling_strategy": _same("GRPO samples with its own sampler (shuffle_dataset), in TRL too"),
    "length_column_name": _same("read only by length-grouped sampling, which GRPO does not use"),
    **_each("ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph",
            _same("megatron's DDP; communication only")),
    "ddp_backend": _same("megatron's process groups (nccl on GPU, gloo on CPU); communication only"),
    "ddp_timeout": _same(f"collectives are bounded by {A}.megatron.timeout_s"),
    **_each("fsdp fsdp_config deepspeed", _no(f"the engine is megatron: set the layout with {A}.megatron.*")),
    "debug": _no("transformers' debug modes are not built"),
    "skip_memory_metrics": LOGGING,
    **_each("do_train do_eval do_predict", _same("not read by the Trainer")),
    "resume_from_checkpoint": _same("not read by the Trainer (trainer.resume_mode resumes here)"),
    "local_rank": _same("set by the launcher"),
}

# TRL 1.16's GRPOConfig defaults of the translated fields (used where ``args`` lacks the field)
TRL_DEFAULTS = {
    "num_generations": 8, "num_generations_eval": None, "max_completion_length": 512, "shuffle_dataset": True,
    "generation_batch_size": None, "steps_per_generation": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
    "min_p": None, "generation_kwargs": None, "repetition_penalty": 1.0, "use_vllm": False, "vllm_mode": "colocate",
    "vllm_enable_sleep_mode": False, "vllm_gpu_memory_utilization": 0.3, "vllm_tensor_parallel_size": 1,
    "beta": 0.0, "num_iterations": 1, "epsilon": 0.2, "delta": None, "epsilon_high": None,
    "sapo_temperature_neg": 1.05, "sapo_temperature_pos": 1.0, "importance_sampling_level": "token",
    "reward_weights": None, "scale_rewards": "group", "loss_type": "dapo", "entropy_coef": 0.0,
    "max_tool_calling_iterations": None, "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None, "use_bias_correction_kl": True, "log_completions": False,
    "vllm_importance_sampling_cap": None, "output_dir": None, "per_device_train_batch_size": 8,
    "num_train_epochs": 3.0, "max_steps": -1, "learning_rate": 1e-6, "lr_scheduler_type": "linear",
    "warmup_steps": 0, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
    "gradient_accumulation_steps": 1, "max_grad_norm": 1.0, "bf16": None, "gradient_checkpointing": True,
    "logging_steps": 10, "report_to": "none", "run_name": None, "project": "huggingface", "eval_strategy": "no",
    "eval_steps": None, "eval_on_start": False, "save_strategy": "steps", "save_steps": 500,
    "save_total_limit": None, "seed": 42, "data_seed": None, "use_cpu": False,
}

# GRPOTrainer.__init__'s parameters: how PPOTrainer takes each
TRL_TRAINER_ARGUMENTS: dict[str, Outcome] = {
    "model": _to("actor_rollout_ref.model.path (a path, a hub id or a PreTrainedModel; a PeftModel is refused: "
                 "pass its base model and peft_config=)"),
    "reward_funcs": _to("the reward functions; a model entry is the reward-model role (reward_model.*)"),
    "args": _to("this table (a GRPOConfig, or TrainingArguments carrying its fields)"),
    "train_dataset": _to("data.train_files (the rows)"), "eval_dataset": _to("data.val_files (the rows)"),
    "processing_class": _to("actor_rollout_ref.model.tokenizer_path"),
    "reward_processing_classes": _to("reward_model.model.tokenizer_path"),
    "callbacks": _to("the callbacks (a transformers.TrainerCallback is called as transformers calls it)"),
    "optimizers": _no("the engine builds its own distributed Adam(W) and LR schedule from the config "
                      f"({A}.optim.*); pass (None, None) and set learning_rate / lr_scheduler_type in args"),
    "quantization_config": _no("quantized (bitsandbytes) training is not built: the engine trains float32 or "
                               "bfloat16 weights; drop it (bf16=True halves the memory)"),
    "peft_config": _to("actor_rollout_ref.model.lora"),
    "tools": _to("multi-turn rollouts with these tools (docs/agents.md)"),
    "rollout_func": _no("a custom generation function is not built: a custom multi-turn rollout is an agent loop "
                        "(verl_lite.agent.AgentLoop, docs/agents.md)"),
    "environment_factory": _no("an environment is an interaction (interactions={name: verl_lite.agent."
                               "Interaction}) or tools (tools=[...]), docs/agents.md"),
}


class Translation(NamedTuple):
    """What ``args`` says: config assignments (key -> (value, the TRL field that set it)), the Python API's
    values (reward_weights, generation_kwargs, log_completions, push_to_hub), and the problems found."""

    assignments: dict
    api: dict
    problems: list


class _Reader:
    """``args``' fields by name; a missing one is TRL's default."""

    def __init__(self, args):
        self.args = args
        declared = dataclasses.fields(args) if dataclasses.is_dataclass(args) else ()
        self.declared = {f.name: f.default if f.default is not dataclasses.MISSING else
                         f.default_factory() if f.default_factory is not dataclasses.MISSING else None
                         for f in declared}

    def __call__(self, name: str):
        return getattr(self.args, name, TRL_DEFAULTS.get(name))

    def text(self, name: str) -> str:
        """The field as text (an enum's value: transformers' strategies and scheduler types)."""
        return str(getattr(self(name), "value", self(name)))

    def is_default(self, name: str) -> bool:
        """At TRL's default: the value ``args``' class declares, or absent."""
        if not hasattr(self.args, name):
            return True
        value = getattr(self.args, name)
        default = self.declared.get(name, TRL_DEFAULTS.get(name))
        if default is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
            return value == type(value)()  # a settings object __post_init__ builds from None (accelerator_config)
        return value == default or value in (None, [], {}, "") and default in (None, [], {}, "")


def _described(name: str, value) -> str:
    return f"args.{name}={value!r}"


def _whole_steps(name: str, value, per_rl_step: int, p: list, exact: bool = True) -> int | None:
    """A count of optimizer steps (TRL's unit) as RL steps: each RL step takes ``per_rl_step`` optimizer steps;
    not ``exact`` (how often to log, validate, save): rounded up to whole RL steps."""
    if isinstance(value, float) and not value.is_integer():
        p.append(f"{_described(name, value)}: a fraction of the run is not built here; give a whole number of steps")
        return None
    value = int(value)
    if not exact:
        return -(-value // per_rl_step)
    if value % per_rl_step:
        p.append(f"{_described(name, value)} optimizer steps is not a whole number of RL steps ({per_rl_step} "
                 f"optimizer steps each: steps_per_generation / gradient_accumulation_steps x num_iterations); "
                 f"give a multiple of {per_rl_step}")
        return None
    return value // per_rl_step


def _batch(a: _Reader, out: dict, p: list) -> dict:
    """TRL's batch arithmetic: a generation of ``generation_batch_size`` completions (``num_generations`` per
    prompt) is one RL step; an optimizer step takes per_device_train_batch_size x processes x
    gradient_accumulation_steps of them (shuffled, as TRL does); ``num_iterations`` passes. Returns the sizes."""
    per_device, gas, n = a("per_device_train_batch_size"), a("gradient_accumulation_steps"), a("num_generations")
    world = int(getattr(a.args, "world_size", 1) or 1)
    spg, gen = a("steps_per_generation"), a("generation_batch_size")
    spg = spg or (gen // (per_device * world) if gen else gas)
    gen = gen or per_device * world * spg
    opt, before = per_device * world * gas, len(p)
    sizes = {"world": world, "gas": gas, "spg": spg, "opt": opt, "per_rl_step": max(spg // gas, 1)
             * a("num_iterations")}
    if spg % gas:
        p.append(f"args.steps_per_generation={spg} with gradient_accumulation_steps={gas}: an optimizer step would "
                 f"take completions of two generations; here an RL step's optimizer steps use its own generation: "
                 f"make steps_per_generation a multiple of gradient_accumulation_steps")
    for what, count in (("generation_batch_size", gen), ("per_device_train_batch_size x processes x "
                                                         "gradient_accumulation_steps", opt)):
        if count % n:
            p.append(f"args.{what} = {count} completions must hold whole prompt groups of num_generations={n} "
                     f"(ppo_mini_batch_size counts prompts here)")
    if len(p) == before:
        out.update({"data.train_batch_size": (gen // n, "generation_batch_size"), f"{R}.n": (n, "num_generations"),
                    f"{A}.ppo_mini_batch_size": (opt // n, "gradient_accumulation_steps"),
                    f"{A}.ppo_micro_batch_size_per_gpu": (per_device, "per_device_train_batch_size"),
                    f"{A}.ppo_epochs": (a("num_iterations"), "num_iterations")})
        if spg > gas:  # several optimizer steps per generation: TRL's are random subsets of the completions
            out[f"{A}.shuffle"] = (True, "steps_per_generation")
    return sizes


LOSS_AGGREGATION = {  # TRL's loss_type -> the aggregation mode with the same normalization (TRL's docs)
    "grpo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean", "cispo": "token-mean", "bnpo": "token-mean", "luspo": "seq-mean-token-sum",
}


def _loss(a: _Reader, sizes: dict, out: dict, p: list) -> None:
    """loss_type, importance_sampling_level, epsilon(s), delta, beta and entropy_coef: TRL's per-token loss and its
    normalization, or a problem where no aggregation mode here has the same one."""
    loss, level, eps = a("loss_type"), a("importance_sampling_level"), a("epsilon")
    eps_high = a("epsilon_high") if a("epsilon_high") is not None else eps
    delta, one_process_micro = a("delta"), sizes["gas"] == 1 and sizes["world"] == 1
    if loss not in LOSS_AGGREGATION:
        p.append(f"{_described('loss_type', loss)}: not built; choose one of {sorted(LOSS_AGGREGATION)}")
        return
    if level not in ("token", "sequence"):
        p.append(f"{_described('importance_sampling_level', level)} is unknown; choose 'token' or 'sequence'")
        return
    if loss == "bnpo" and not one_process_micro:
        p.append("args.loss_type='bnpo' normalizes by each device's micro-batch tokens; the same normalization here "
                 "needs one micro-batch per optimizer step on one process (gradient_accumulation_steps=1): use "
                 "loss_type='dapo' (the whole optimizer step's tokens)")
    if loss in ("dapo", "cispo") and sizes["spg"] != sizes["gas"]:
        p.append(f"args.loss_type={loss!r} divides each optimizer step by the generation's mean tokens per step; "
                 f"token-mean here divides by the step's own tokens: the same only with one optimizer step per "
                 f"generation (steps_per_generation = gradient_accumulation_steps)")
    if level == "sequence" and loss in ("sapo", "cispo"):
        p.append(f"args.importance_sampling_level='sequence' with loss_type={loss!r}: a sequence-level {loss} "
                 f"is not built (sequence level is GSPO's clipped loss)")
    mode = {"sapo": "sapo", "cispo": "cispo"}.get(loss, "gspo" if level == "sequence" else "vanilla")
    out[f"{A}.loss_agg_mode"] = (LOSS_AGGREGATION[loss], "loss_type")
    out[f"{A}.policy_loss.loss_mode"] = (mode, "importance_sampling_level" if mode == "gspo" else "loss_type")
    out[f"{A}.clip_ratio"], out[f"{A}.clip_ratio_low"] = (eps, "epsilon"), (eps, "epsilon")
    out[f"{A}.clip_ratio_high"] = (eps_high, "epsilon_high")
    if loss == "dr_grpo":
        out[f"{A}.loss_scale_factor"] = (float(a("max_completion_length")), "max_completion_length")
    if mode == "cispo":  # TRL: weight min(r, epsilon_high), no lower bound (r > 0 always)
        out[f"{A}.clip_ratio_low"], out[f"{A}.clip_ratio_high"] = (1.0, "loss_type"), (eps_high - 1, "epsilon_high")
        if not eps_high > 1:
            p.append(f"args.epsilon_high={eps_high} with loss_type='cispo' caps the importance weight at "
                     f"{eps_high} <= 1; give epsilon_high > 1 (ScaleRL: 5.0)")
    if mode == "sapo":
        out[f"{A}.policy_loss.tau_pos"] = (a("sapo_temperature_pos"), "sapo_temperature_pos")
        out[f"{A}.policy_loss.tau_neg"] = (a("sapo_temperature_neg"), "sapo_temperature_neg")
    if mode == "vanilla":  # TRL's clip has no dual clip; its two-sided clip (delta) is the dual clip at c = delta
        out[f"{A}.clip_ratio_c"] = (NO_DUAL_CLIP if delta is None else float(delta), "delta")
    if delta is not None and not (mode == "vanilla" and delta >= 1 + eps_high):
        p.append(f"{_described('delta', delta)}: the two-sided clip is the dual clip here, which needs token-level "
                 f"grpo/bnpo/dr_grpo/dapo/luspo and delta >= 1 + epsilon_high = {1 + eps_high}")
    _entropy(a, LOSS_AGGREGATION[loss], one_process_micro, out, p)


def _kl(a: _Reader, out: dict, p: list) -> None:
    """beta: TRL's KL loss (k3 against the reference, in the loss; none in the reward)."""
    beta = a("beta")
    out["algorithm.use_kl_in_reward"] = (False, "beta")
    out[f"{A}.use_kl_loss"] = (beta != 0, "beta")
    if beta != 0:
        out[f"{A}.kl_loss_coef"] = (float(beta), "beta")
        out[f"{A}.kl_loss_type"] = ("low_var_kl", "use_bias_correction_kl")
        if a("use_bias_correction_kl"):
            p.append(f"args.beta={beta} with use_bias_correction_kl=True (TRL's default): TRL multiplies the KL term "
                     f"by the importance ratio, the KL loss here is verl's k3 without it; set "
                     f"use_bias_correction_kl=False for the same objective")


def _entropy(a: _Reader, aggregation: str, one_process_micro: bool, out: dict, p: list) -> None:
    """entropy_coef: TRL's bonus is a token mean per micro-batch, whatever the loss_type."""
    entropy = a("entropy_coef")
    if entropy:
        out[f"{A}.entropy_coeff"] = (float(entropy), "entropy_coef")
        if aggregation != "token-mean" or not one_process_micro:
            p.append(f"args.entropy_coef={entropy}: TRL's bonus is each micro-batch's token mean of the entropy; "
                     f"here it aggregates as the loss does: the same only with a token-mean loss_type (dapo, bnpo, "
                     f"cispo) and one micro-batch per optimizer step on one process (gradient_accumulation_steps=1)")


def _advantage(a: _Reader, out: dict, p: list) -> None:
    scale = {True: "group", False: "none"}.get(a("scale_rewards"), a("scale_rewards"))
    if scale not in ("group", "none"):
        p.append(f"{_described('scale_rewards', a('scale_rewards'))}: scaling by the batch's std is not built; "
                 f"use 'group' or 'none'")
        return
    out["algorithm.adv_estimator"] = ("grpo", "scale_rewards")
    out["algorithm.norm_adv_by_std_in_grpo"] = (scale == "group", "scale_rewards")


def _sampling(a: _Reader, out: dict, api: dict, p: list) -> None:
    """Sampling (train and, as TRL evaluates, validation), the rollout backend and its correction."""
    for name in ("temperature", "top_p", "top_k"):
        out[f"{R}.{name}"] = out[f"{R}.val_kwargs.{name}"] = (a(name), name)
    out[f"{R}.val_kwargs.do_sample"] = (True, "temperature")
    out[f"{R}.val_kwargs.n"] = (a("num_generations_eval") or a("num_generations"), "num_generations_eval")
    out["data.max_response_length"] = (a("max_completion_length"), "max_completion_length")
    kwargs = {"min_p": a("min_p")} if a("min_p") is not None else {}
    kwargs.update({"repetition_penalty": a("repetition_penalty")} if a("repetition_penalty") != 1.0 else {})
    api["generation_kwargs"] = {**kwargs, **(a("generation_kwargs") or {})}  # TRL: generation_kwargs win
    out["actor_rollout_ref.hybrid_engine"] = (True, "vllm_mode")
    if not a("use_vllm"):
        out[f"{R}.name"] = ("hf", "use_vllm")
        return
    out[f"{R}.name"] = ("vllm", "use_vllm")
    if a("vllm_mode") != "colocate":
        p.append(f"{_described('vllm_mode', a('vllm_mode'))}: a separate vLLM server is not built; the rollout "
                 f"workers host vLLM themselves (vllm_mode='colocate')")
    for name, key in (("vllm_gpu_memory_utilization", "gpu_memory_utilization"),
                      ("vllm_tensor_parallel_size", "tensor_model_parallel_size"),
                      ("vllm_enable_sleep_mode", "free_cache_engine")):
        out[f"{R}.{key}"] = (a(name), name)
    if a("vllm_importance_sampling_correction"):
        _vllm_correction(a, out, p)


def _vllm_correction(a: _Reader, out: dict, p: list) -> None:
    """TRL's vLLM importance sampling: *_truncate = IS weights capped at clip_max (``rollout_is``); *_mask = the
    raw ratio, 0 outside [clip_min, clip_max] (``rollout_is`` at clip_max + rejection ``rollout_rs``)."""
    mode, high = a("vllm_importance_sampling_mode"), a("vllm_importance_sampling_clip_max")
    low = a("vllm_importance_sampling_clip_min")
    level, _, kind = str(mode).partition("_")
    if level not in ("token", "sequence") or kind not in ("truncate", "mask"):
        p.append(f"{_described('vllm_importance_sampling_mode', mode)} is unknown")
        return
    if high is None or (kind == "mask" and not high > 1):
        p.append(f"args.vllm_importance_sampling_clip_max={high}: the correction here needs an upper bound > 1")
        return
    if kind == "truncate" and low is not None:
        p.append(f"args.vllm_importance_sampling_clip_min={low}: a lower truncation of the IS weights is not built "
                 f"(only the cap); leave it None")
        return
    out[f"{RC}.rollout_is"] = (level, "vllm_importance_sampling_mode")
    out[f"{RC}.rollout_is_threshold"] = (float(high), "vllm_importance_sampling_clip_max")
    if kind == "mask":
        out[f"{RC}.rollout_rs"] = (level, "vllm_importance_sampling_mode")
        out[f"{RC}.rollout_rs_threshold"] = (float(high), "vllm_importance_sampling_clip_max")
        out[f"{RC}.rollout_rs_threshold_lower"] = (float(low or 0.0), "vllm_importance_sampling_clip_min")


def _optimizer(a: _Reader, sizes: dict, out: dict, p: list) -> None:
    """Adam(W) and the LR schedule; the schedule moves once per RL step here (verl's rule), TRL's once per
    optimizer step: the same when each RL step is one optimizer step, or the lr is constant."""
    O = f"{A}.optim"
    out[f"{O}.lr"] = (a("learning_rate"), "learning_rate")
    out[f"{O}.weight_decay"] = (a("weight_decay"), "weight_decay")
    out[f"{O}.betas"] = ([a("adam_beta1"), a("adam_beta2")], "adam_beta1")
    norm = a("max_grad_norm")
    if not (norm and norm > 0):
        p.append(f"{_described('max_grad_norm', norm)}: clipping cannot be switched off here; give a large value "
                 f"(e.g. 1e9) to effectively disable it")
    else:
        out[f"{O}.clip_grad"] = (float(norm), "max_grad_norm")
    kind, warmup = a.text("lr_scheduler_type"), a("warmup_steps") or 0
    styles = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
    if kind not in styles:
        p.append(f"args.lr_scheduler_type={kind!r} is not built; choose one of {sorted(styles)}")
        return
    out[f"{O}.lr_decay_style"] = (styles[kind], "lr_scheduler_type")
    warmup = 0 if kind == "constant" else warmup  # transformers' 'constant' has no warm-up
    if 0 < warmup < 1:
        if a("max_steps") > 0:
            warmup = math.ceil(warmup * a("max_steps"))
        else:
            p.append(f"args.warmup_steps={warmup} (a fraction of the run) needs max_steps > 0; give whole steps")
            return
    per_rl = sizes["per_rl_step"]
    if per_rl > 1 and (warmup or styles[kind] != "constant"):
        p.append(f"args.lr_scheduler_type={kind!r} / warmup_steps={warmup} move the lr at each of an RL step's "
                 f"{per_rl} optimizer steps in TRL; the schedule here moves once per RL step (verl's rule): use "
                 f"lr_scheduler_type='constant', or one optimizer step per generation (num_iterations=1, "
                 f"steps_per_generation = gradient_accumulation_steps)")
        return
    out[f"{O}.lr_warmup_steps"] = (int(warmup), "warmup_steps")


def _run(a: _Reader, sizes: dict, out: dict, api: dict, p: list) -> None:
    """Length, checkpoints, validation, logging, seeds, devices and the output directory."""
    T, per_rl = "trainer", sizes["per_rl_step"]
    if a("max_steps") and a("max_steps") > 0:
        if (steps := _whole_steps("max_steps", a("max_steps"), per_rl, p)) is not None:
            out[f"{T}.total_training_steps"] = (steps, "max_steps")
    elif float(a("num_train_epochs")).is_integer() and a("num_train_epochs") >= 1:
        out[f"{T}.total_epochs"] = (int(a("num_train_epochs")), "num_train_epochs")
        out[f"{T}.total_training_steps"] = (None, "num_train_epochs")
    else:
        p.append(f"{_described('num_train_epochs', a('num_train_epochs'))}: give whole epochs, or max_steps")
    if (log := _whole_steps("logging_steps", a("logging_steps"), per_rl, p, exact=False)) is not None:
        out[f"{T}.log_freq"] = (max(log, 1), "logging_steps")
    _periodic(a, "eval_strategy", "eval_steps", {"no": 0}, f"{T}.test_freq", per_rl, out, p)
    _periodic(a, "save_strategy", "save_steps", {"no": -1}, f"{T}.save_freq", per_rl, out, p)
    out[f"{T}.val_before_train"] = (bool(a("eval_on_start")), "eval_on_start")
    if a("save_total_limit") is not None:
        out[f"{T}.max_actor_ckpt_to_keep"] = (a("save_total_limit"), "save_total_limit")
    out[f"{T}.seed"] = (a("seed"), "seed")
    out["data.seed"] = (a("data_seed") if a("data_seed") is not None else a("seed"), "data_seed")
    out["data.shuffle"] = (bool(a("shuffle_dataset")), "shuffle_dataset")
    if a("max_tool_calling_iterations") is not None:
        out[f"{R}.multi_turn.max_user_turns"] = (a("max_tool_calling_iterations"), "max_tool_calling_iterations")
    _devices(a, out, p)
    output_dir = a("output_dir") or "trainer_output"  # transformers' default
    out[f"{T}.output_dir"] = (str(output_dir), "output_dir")
    out[f"{T}.default_local_dir"] = (os.path.abspath(output_dir), "output_dir")
    if a("run_name"):
        out[f"{T}.experiment_name"] = (str(a("run_name")), "run_name")
    out[f"{T}.project_name"] = (str(a("project")), "project")
    out[f"{T}.logger"] = (_loggers(a("report_to"), p), "report_to")
    api["reward_weights"], api["log_completions"] = a("reward_weights"), bool(a("log_completions"))


def _periodic(a: _Reader, strategy: str, steps: str, off: dict, key: str, per_rl: int, out: dict, p: list) -> None:
    """eval_strategy / save_strategy with their steps (eval_steps None = logging_steps, as transformers)."""
    value = a.text(strategy)
    if value in off:
        out[key] = (off[value], strategy)
    elif value == "steps":
        count = a(steps) if a(steps) is not None else a("logging_steps")
        if (rl := _whole_steps(steps, count, per_rl, p, exact=False)) is not None:
            out[key] = (rl, steps)
    else:
        p.append(f"args.{strategy}={value!r} is not built here; use 'steps' (every {steps}) or 'no'")


def _devices(a: _Reader, out: dict, p: list) -> None:
    import torch

    cuda = torch.cuda.is_available()
    if a("use_cpu") and cuda:
        p.append("args.use_cpu=True on a machine with a visible GPU: the workers use it; hide it "
                 "(CUDA_VISIBLE_DEVICES=) to train on CPU")
    bf16 = a("bf16") if a("bf16") is not None else not a("fp16")  # TRL: bf16 unless fp16
    out[f"{A}.megatron.dtype"] = ("bfloat16" if bf16 else "float32", "bf16")
    checkpointing = a("activation_checkpointing")  # transformers' new name; gradient_checkpointing mirrors it
    checkpointing = a("gradient_checkpointing") if checkpointing is None else checkpointing
    out["actor_rollout_ref.model.enable_gradient_checkpointing"] = (bool(checkpointing) and cuda,
                                                                    "gradient_checkpointing")


def _loggers(report_to, p: list) -> list[str]:
    names = [report_to] if isinstance(report_to, str) or report_to is None else list(report_to)
    loggers = ["console", "jsonl"]
    for name in names:
        if name in (None, "none"):
            continue
        if name in TRACKERS:
            loggers.append(TRACKERS[name])
        else:
            p.append(f"args.report_to={name!r} is not built; choose from 'none', {', '.join(map(repr, TRACKERS))} "
                     f"(the console and metrics.jsonl are always written)")
    return loggers


def translate(args) -> Translation:
    """What ``args`` (a GRPOConfig, or a TrainingArguments dataclass carrying its fields) sets, with TRL's
    meaning; every field it has is checked against ``TRL_FIELDS`` (one it lacks is at TRL's default)."""
    a, out, api, p = _Reader(args), {}, {}, []
    for name in (f.name for f in dataclasses.fields(args)):
        outcome = TRL_FIELDS.get(name)
        if outcome is None and not a.is_default(name):
            p.append(f"args.{name}: not a field of TRL 1.16's GRPOConfig, which verl_lite maps "
                     f"(docs/python_api.md); drop it")
        elif outcome is not None and outcome.kind == REFUSED and not a.is_default(name) and name != "optim":
            p.append(f"{_described(name, getattr(args, name))}: {outcome.text}")
    optim = a.text("optim") if a("optim") else "adamw_torch_fused"
    if optim not in ADAMW:
        p.append(f"args.optim={optim!r}: {TRL_FIELDS['optim'].text}")
    sizes = _batch(a, out, p)
    _loss(a, sizes, out, p)
    _kl(a, out, p)
    _advantage(a, out, p)
    _sampling(a, out, api, p)
    _optimizer(a, sizes, out, p)
    _run(a, sizes, out, api, p)
    return Translation(out, api, p)


PEFT_MODEL_REFUSED = ("model= is a PeftModel: pass its base model (model.get_base_model(), or a path) and its "
                      "peft_config= (a LoraConfig); or merge_and_unload() it first")


def is_peft_model(model) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def refused_argument(name: str) -> str:
    """The problem line of GRPOTrainer's refused argument ``name`` (``TRL_TRAINER_ARGUMENTS``) when given."""
    return f"{name}=: {TRL_TRAINER_ARGUMENTS[name].text}"


def trainer_argument_problems(optimizers, quantization_config) -> list[str]:
    """GRPOTrainer's refused arguments given here (a PeftModel as model=: ``api.use_model``, before it saves)."""
    given = {"optimizers": optimizers is not None and tuple(optimizers) != (None, None),
             "quantization_config": quantization_config is not None}
    return [refused_argument(name) for name, is_given in given.items() if is_given]


def _is_user_set(cfg, key: str, reference) -> bool:
    """Whether ``cfg``'s ``key`` holds a value the user chose: not the schema default, not a value derived from
    other keys (an inherited null, the run name, the checkpoint dir)."""
    value = attrgetter(key)(cfg)
    if key == "trainer.default_local_dir":
        return value != default_checkpoint_dir(cfg.trainer)
    if key == "trainer.experiment_name":
        return value != default_experiment_name(cfg)
    for section, name, source in INHERITED:
        if f"{section}.{name}" == key and value == attrgetter(source)(cfg):
            return False
    return value != attrgetter(key)(reference)


def _with_followers(cfg, assignments: dict) -> dict:
    """``assignments`` plus each inherited key (``loader.INHERITED``) that follows an assigned one in ``cfg``."""
    out = dict(assignments)
    for section, name, source in INHERITED:
        key = f"{section}.{name}"
        if source in out and key not in out and attrgetter(key)(cfg) == attrgetter(source)(cfg):
            out[key] = out[source]
    return out


def _same_value(a, b) -> bool:
    return a == b or isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b)


def _set(cfg, key: str, value) -> None:
    head, _, leaf = key.rpartition(".")
    setattr(attrgetter(head)(cfg), leaf, value)


def _disagreements(cfg, assignments: dict, a: _Reader) -> list[str]:
    """A key the user set in ``cfg`` that ``args`` sets to another value: one line each (give the setting once)."""
    reference, p = resolve_inherited(PPOConfig()), []
    for key, (value, field) in assignments.items():
        if not _same_value(attrgetter(key)(cfg), value) and _is_user_set(cfg, key, reference):
            default = " (TRL's default)" if a.is_default(field) else ""
            p.append(f"args.{field}{default} gives {key}={value!r} and the config sets {key}="
                     f"{attrgetter(key)(cfg)!r}: two values for one setting; give one of them (drop the config key "
                     f"or set args.{field})")
    return p


def use_trl_arguments(cfg, args, optimizers=(None, None), quantization_config=None,
                      reward_weights=None, generation_kwargs=None, log_completions: bool = False,
                      push_to_hub: bool = False) -> tuple:
    """``args`` (TRL's GRPOConfig) and GRPOTrainer's other arguments into ``cfg``; returns the Python API's
    (reward_weights, generation_kwargs, log_completions, push_to_hub), ``args``' merged with the ones given.
    Raises one ConfigError with every problem: refused fields, inexpressible combinations, and a config key
    the user set that disagrees with ``args`` (give the setting once); ``cfg`` is left as it was then."""
    p = trainer_argument_problems(optimizers, quantization_config)
    if args is not None and not dataclasses.is_dataclass(args):
        p.append(f"args= is a {type(args).__name__}: give TRL's GRPOConfig, or a transformers.TrainingArguments "
                 f"(sub)class carrying its fields")
        args = None
    api = {"reward_weights": reward_weights, "generation_kwargs": dict(generation_kwargs or {}),
           "log_completions": bool(log_completions), "push_to_hub": bool(push_to_hub)}
    if args is None:
        if p:
            raise ConfigError(p)
        return tuple(api.values())
    found = translate(args)
    assignments = _with_followers(cfg, found.assignments)
    p += found.problems + _disagreements(cfg, assignments, _Reader(args))
    for name, given in (("reward_weights", reward_weights), ("generation_kwargs", generation_kwargs or None)):
        ours = found.api[name]
        if given is not None and ours not in (None, {}) and not _same_value(ours, given):
            p.append(f"args.{name}={ours!r} and {name}={given!r} given to PPOTrainer disagree; give one of them")
        elif given is None:
            api[name] = ours
    api["generation_kwargs"] = dict(api["generation_kwargs"] or {})
    api["log_completions"] = api["log_completions"] or found.api["log_completions"]
    if p:
        raise ConfigError(p)
    for key, (value, _) in assignments.items():
        _set(cfg, key, value)
    return tuple(api.values())


def fields_markdown() -> str:
    """The table of docs/python_api.md: every GRPOConfig field's outcome (generated from ``TRL_FIELDS``)."""
    rows = {TO: [], SAME: [], REFUSED: []}
    for name, outcome in TRL_FIELDS.items():
        rows[outcome.kind].append(f"| `{name}` | {outcome.text} |")
    heads = {TO: "Translated (field | verl key)", SAME: "Accepted, no effect here (field | why nothing that "
             "trains changes)", REFUSED: "Refused when not TRL's default (field | why, what to use)"}
    return "\n\n".join(f"**{heads[kind]}**\n\n| field | |\n|---|---|\n" + "\n".join(lines)
                       for kind, lines in rows.items())
