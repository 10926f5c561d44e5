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
from the same section when there is one).

    decide(key, value) -> Decision | None        # None: no rule (a schema key or a typo)
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable

MEGATRON_ONLY = "verl_lite runs megatron only: drop it, or use actor_rollout_ref.actor.megatron.* for the layout"
DENSE_ONLY = ("the rollout keeps a full model per worker (experts included): expert parallelism applies to the "
              "megatron engine only (actor_rollout_ref.actor.megatron.expert_model_parallel_size); drop it "
              "(1 is accepted)")
NO_OFFLOAD = ("offloading params/grads/optimizer state between phases is not built: every engine keeps its "
              "state resident; drop it (false is accepted)")
NO_LORA = "LoRA is not built: verl_lite trains every parameter; drop it"
NO_PROFILER = ("verl's nsys/npu/torch profiler hooks are not built; drop it and use bench/profile_train_step.py "
               "for per-op timing tables")
LOCAL_SPEC = ("the engine builds megatron's local (non-Transformer-Engine) layer spec with its own THD attention, "
              "which has no fused kernels to switch on; drop it (false is accepted)")


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


_positive_int.label, _null_or_verl_default.label = "an integer >= 1", "null / custom_reward_manager"
_falsy.label, _one_or_null.label, _zero.label, _empty.label = "false", "1 / null", "0 / null", "null / empty"
_TRUE, _FALSE, _BOOL = _is(True), _falsy, _is(True, False)
A, R, REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
MEG_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
              "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size")


def _megatron_rules(section: str) -> list[Rule]:
    """Rules for one role's ``megatron`` section (actor, ref or critic) beyond the schema's fields."""
    s = f"{section}.megatron"
    return [
        Rule(f"{s}.param_offload", "same", NO_OFFLOAD, accepts=_FALSE),
        Rule(f"{s}.grad_offload", "same", NO_OFFLOAD, accepts=_FALSE),
        Rule(f"{s}.optimizer_offload", "same", NO_OFFLOAD, accepts=_FALSE),
        Rule(f"{s}.use_dist_checkpointing", "same",
             "verl_lite loads the HF safetensors of model.path directly (no pre-converted megatron checkpoint); "
             "its own training checkpoints use megatron dist_checkpointing already (trainer.save_freq); drop it",
             accepts=_FALSE),
        Rule(f"{s}.dist_checkpointing_path", "same",
             "verl_lite loads the HF safetensors of model.path directly; drop it (null is accepted)", accepts=_empty),
        Rule(f"{s}.use_mbridge", "same",
             "verl_lite always converts HF weights with its own bridge (verl_lite.engine, HF <-> megatron, "
             "bit-exact export); use_mbridge=true states that; false (verl's legacy converter) is not built",
             accepts=_TRUE, effect="HF weights are loaded and exported by verl_lite's own bridge"),
        Rule(f"{s}.vanilla_mbridge", "same",
             "verl_lite's own HF bridge is the only one; drop it", accepts=_BOOL),
        Rule(f"{s}.seed", "reject", "the engines are seeded from trainer.seed; set that instead"),
    ]


def _device_ok(v) -> bool:
    """The device this machine runs on: cuda where a GPU is visible, else cpu."""
    if not isinstance(v, str):
        return False
    import torch

    return v.lower() == ("cuda" if torch.cuda.is_available() else "cpu")


_device_ok.label = "cuda (GPU visible) / cpu (none)"


RULES: list[Rule] = [
    # ---------------------------------------------------------------- backend / strategy
    Rule("*.fsdp_config.*", "reject", MEGATRON_ONLY),
    Rule("*.fsdp_config", "reject", MEGATRON_ONLY),
    Rule("model_engine", "same", MEGATRON_ONLY, accepts=_is("megatron")),
    Rule("*.strategy", "same", MEGATRON_ONLY, accepts=_is("megatron")),
    Rule("*.ulysses_sequence_parallel_size", "same",
         "Ulysses sequence parallelism belongs to verl's FSDP path; use actor_rollout_ref.actor.megatron."
         "context_parallel_size (megatron CP, THD + zig-zag) instead (1 is accepted)", accepts=_one_or_null),
    Rule("actor_rollout_ref.hybrid_engine", "same",
         "verl_lite always colocates actor, rollout and reference in one process per rank (hybrid engine); "
         "a separate rollout pool is not built", accepts=_TRUE),
    Rule("trainer.device", "same",
         "verl_lite picks the device itself (CUDA when visible, else CPU); drop it", accepts=_device_ok),
    Rule("trainer.use_legacy_worker_impl", "same",
         "verl_lite has one worker implementation (Ray single controller, megatron engine); drop it",
         accepts=_is("auto", "disable", "disabled")),
    # ---------------------------------------------------------------- model
    Rule("*.model.use_remove_padding", "same",
         "verl_lite always removes padding (THD packing: sequences are concatenated with cu_seqlens, no pad "
         "tokens enter the model); a padded path is not built, so false cannot be honoured: drop it",
         accepts=_TRUE, effect="THD packing, always on"),
    Rule("*.model.use_fused_kernels", "same",
         "verl's fused log-prob/entropy kernels work on FSDP hidden states; the megatron engine computes "
         "log-probs and entropy with megatron's vocab-parallel cross-entropy over TP-sharded logits (no "
         "full-vocab logits per rank): drop it or set false",
         accepts=_BOOL,
         effect="log-probs/entropy from the vocab-parallel logits (no full-vocab gather) either way"),
    Rule("*.model.fused_kernel_options.*", "reject",
         "the megatron engine has no separate fused-kernel backend (log-probs come from vocab-parallel "
         "cross-entropy); drop it"),
    Rule("*.model.trust_remote_code", "same",
         "verl_lite builds Qwen2/Qwen3/Llama from config.json and runs no code from the model directory; "
         "drop it (false is accepted)", accepts=_FALSE),
    Rule("data.trust_remote_code", "same",
         "verl_lite loads the tokenizer without remote code (Qwen2/Qwen3/Llama tokenizers need none); drop it",
         accepts=_FALSE),
    Rule("*.model.use_shm", "same", "the model is read from model.path directly; drop it", accepts=_FALSE),
    Rule("*.model.lora.rank", "same", NO_LORA + " (rank 0 = off is accepted)", accepts=_zero),
    Rule("*.model.lora_rank", "same", NO_LORA + " (0 = off is accepted)", accepts=_zero),
    Rule("*.model.lora.*", "reject", NO_LORA),
    Rule("*.model.lora_*", "reject", NO_LORA),
    Rule("*.model.target_modules", "reject", NO_LORA),
    Rule("*.model.exclude_modules", "reject", NO_LORA),
    Rule("*.model.override_config.*", "reject",
         "verl_lite takes the architecture from model.path/config.json as is; edit that file (or export a "
         "modified copy) instead of overriding it on the command line"),
    Rule("*.freeze_vision_tower", "reject", "verl_lite trains text-only causal LMs; drop it"),
    Rule("data.image_key", "reject", "verl_lite trains text-only causal LMs (no image inputs); drop it"),
    # ---------------------------------------------------------------- megatron sections
    *_megatron_rules(A),
    *_megatron_rules("critic"),
    *[Rule(f"{REF}.megatron.{k}", "equal",
           f"the reference policy runs on the actor's process group in verl_lite, so its layout is the actor's: "
           f"set it equal to {A}.megatron.{k} or drop it", target=f"{A}.megatron.{k}") for k in MEG_LAYOUT],
    Rule(f"{REF}.megatron.sequence_parallel", "equal",
         f"the reference shares the actor's process group: set it equal to {A}.megatron.sequence_parallel or drop it",
         target=f"{A}.megatron.sequence_parallel"),
    *_megatron_rules(REF),
    Rule(f"{REF}.megatron.dtype", "equal",
         f"the reference policy runs in the actor's workers with the actor's precision: set it equal to "
         f"{A}.megatron.dtype or drop it", target=f"{A}.megatron.dtype"),
    Rule("actor_rollout_ref.nccl_timeout", "alias", target=f"{A}.megatron.timeout_s",
         effect="the actor role's process-group timeout (seconds)"),
    # ---------------------------------------------------------------- actor / ref extras
    Rule(f"{A}.grad_clip", "alias", target=f"{A}.optim.clip_grad", effect="verl's older name of optim.clip_grad"),
    Rule("*.optim.lr_warmup_steps_ratio", "same",
         "give the warm-up as optimizer steps with optim.lr_warmup_steps (0.0 is accepted)", accepts=_zero),
    Rule("*.optim.override_optimizer_config.*", "reject",
         "megatron's CPU-offloaded and precision-aware optimizers are not built (the optimizer is megatron's "
         "fp32 Adam, optionally distributed: megatron.use_distributed_optimizer); drop it"),
    Rule("*.use_torch_compile", "same", "the megatron engine does not use torch.compile; drop it (false is accepted)",
         accepts=_FALSE),
    Rule("*.entropy_checkpointing", "same",
         "an FSDP-actor memory option; the megatron engine computes entropy from vocab-parallel logits; drop it",
         accepts=_FALSE),
    Rule("*.entropy_from_logits_with_chunking", "same",
         "an FSDP-actor memory option; the megatron engine computes entropy from vocab-parallel logits; drop it",
         accepts=_FALSE),
    Rule("*.profiler.enable", "same", NO_PROFILER, accepts=_FALSE),
    Rule("*.profiler.*", "reject", NO_PROFILER),
    Rule("global_profiler.tool", "same", NO_PROFILER, accepts=_empty),
    Rule("global_profiler.steps", "same", NO_PROFILER, accepts=_empty),
    Rule("global_profiler.*", "reject", NO_PROFILER),
    # ---------------------------------------------------------------- rollout
    Rule(f"{R}.mode", "same",
         "verl_lite generates with one batched in-process call per worker (verl's sync mode); the server-based "
         "async agent loop is not built. The samples are the same as verl's either way", accepts=_is("sync", "async"),
         effect="one batched in-process generate call per worker (sync semantics)"),
    Rule(f"{R}.calculate_log_probs", "reject",
         "the rollout's own log-probs are not collected in this version (old log-probs come from the actor's "
         "recompute); drop it"),
    Rule(f"{R}.load_format", "same", "the rollout is built from model.path's safetensors and then synced from the "
         "actor in process; drop it", accepts=_is("safetensors", "auto", "dummy")),
    Rule(f"{R}.layered_summon", "same", "an FSDP weight-sync option; verl_lite syncs weights in process: drop it",
         accepts=_FALSE),
    Rule(f"{R}.multi_stage_wake_up", "same", "vLLM sleep/wake staging is not built (free_cache_engine sleeps in one "
         "stage); drop it", accepts=_FALSE),
    Rule(f"{R}.data_parallel_size", "same", "every actor worker holds one full rollout model (rollout DP = the "
         "number of workers); drop it (1 is accepted)", accepts=_one_or_null),
    Rule(f"{R}.expert_parallel_size", "same", DENSE_ONLY, accepts=_one_or_null),
    Rule(f"{R}.checkpoint_engine.*", "reject", "weights are synced in process (no bucketed transfer); drop it"),
    Rule(f"{R}.multi_turn.*", "reject", "multi-turn / tool rollouts are not built; drop it"),
    Rule(f"{R}.engine_kwargs.*", "reject",
         "backend engine kwargs are not passed through in this version; the vLLM settings verl_lite forwards are "
         f"{R}.dtype, gpu_memory_utilization, free_cache_engine and enforce_eager"),
    Rule(f"{R}.cudagraph_capture_sizes", "reject",
         f"CUDA-graph capture sizes are not forwarded to vLLM; use {R}.enforce_eager=false for vLLM's defaults"),
    Rule(f"{R}.quantization", "same", "quantized rollouts are not built; drop it", accepts=_empty),
    # ---------------------------------------------------------------- data
    Rule("data.return_raw_chat", "same",
         "verl_lite tokenizes every prompt with the chat template on the driver and keeps the raw messages "
         "in the batch for the reward, for every rollout backend",
         accepts=_BOOL, effect="prompts go through the chat template once, on the driver"),
    Rule("data.filter_overlong_prompts_workers", "same",
         "prompt filtering runs in the driver process; drop it", accepts=_positive_int,
         effect="filtering runs in one process (same result)"),
    Rule("data.gen_batch_size", "equal",
         "verl_lite generates data.train_batch_size prompts per round (with algorithm.filter_groups more "
         "rounds follow until train_batch_size groups carry signal); set it equal to data.train_batch_size "
         "or drop it", target="data.train_batch_size"),
    Rule("data.custom_cls.*", "reject",
         "custom dataset classes are not loaded; give parquet files with a 'prompt' chat column (see "
         "docs/config.md) or pass rows through the Python API"),
    Rule("data.apply_chat_template_kwargs.*", "reject",
         "chat-template kwargs are not forwarded; the tokenizer's template is applied as is: drop it"),
    # ---------------------------------------------------------------- reward
    Rule("custom_reward_function.*", "alias", target="reward.custom_reward_function.*",
         effect="verl's top-level section = reward.custom_reward_function"),
    Rule("reward_model.reward_manager", "alias", target="reward.reward_manager", value_map={"dapo": "naive"},
         effect="dapo = naive per-sample scoring; its overlong shaping is reward.overlong_buffer"),
    Rule("reward_manager.name", "alias", target="reward.reward_manager", value_map={"dapo": "naive"},
         effect="verl's reward_manager section: name = reward.reward_manager"),
    Rule("reward.reward_manager.name", "alias", target="reward.reward_manager", value_map={"dapo": "naive"},
         effect="the section shape of reward.reward_manager"),
    Rule("reward_manager.source", "same", "only registered reward managers (naive, batch, dapo) exist here; custom "
         "manager classes are not loaded: use reward.custom_reward_function or the Python API's reward loop",
         accepts=_is("register")),
    Rule("reward.reward_manager.source", "same", "only registered reward managers (naive, batch, dapo) exist here",
         accepts=_is("register")),
    Rule("reward_manager.module.*", "same", "custom reward manager classes are not loaded: use "
         "reward.custom_reward_function (or the Python API's reward loop); drop it", accepts=_null_or_verl_default),
    Rule("reward.reward_manager.module.*", "same", "custom reward manager classes are not loaded; drop it",
         accepts=_null_or_verl_default),
    Rule("reward_model.reward_kwargs.overlong_buffer_cfg.*", "alias", target="reward.overlong_buffer.*",
         effect="DAPO's overlong shaping = reward.overlong_buffer"),
    Rule("reward_model.reward_kwargs.max_resp_len", "equal",
         "the overlong buffer counts from data.max_response_length in verl_lite: set it equal or drop it",
         target="data.max_response_length"),
    Rule("reward_model.enable", "same",
         "a model-based reward (reward model role) is not built; score with reward.custom_reward_function or the "
         "Python API's reward functions (false is accepted)", accepts=_FALSE),
    Rule("reward_model.use_reward_loop", "same",
         "verl_lite scores rule-based rewards in its own reward process (reward.timeout_s); drop it",
         accepts=_BOOL, effect="rewards run in verl_lite's reward process either way"),
    Rule("reward_model.sandbox_fusion.*", "reject",
         "the sandbox-fusion code scorer is not built; score code with a reward.custom_reward_function"),
    Rule("reward_model.*", "reject",
         "a model-based reward (reward model role) is not built; drop reward_model.* and score with "
         "reward.custom_reward_function or the Python API's reward functions"),
    # ---------------------------------------------------------------- algorithm
    Rule("algorithm.use_pf_ppo", "same", "preference-feedback PPO reweighting is not built (false is accepted)",
         accepts=_FALSE),
    Rule("algorithm.pf_ppo.*", "reject", "preference-feedback PPO reweighting is not built; drop it"),
    Rule("algorithm.rollout_correction.*", "reject",
         "verl's rollout-correction section is not built; truncated importance weights are "
         f"{A}.tis_imp_ratio_cap"),
    # ---------------------------------------------------------------- trainer
    Rule("trainer.balance_batch", "same",
         "the micro-batch planner always balances tokens over the DP ranks (greedy longest-first); it cannot "
         "be switched off, so false cannot be honoured: drop it", accepts=_TRUE,
         effect="token-balanced DP partition, always on"),
    Rule("trainer.max_critic_ckpt_to_keep", "equal",
         "actor and critic are checkpointed together in one global_step_K directory: set it equal to "
         "trainer.max_actor_ckpt_to_keep or drop it", target="trainer.max_actor_ckpt_to_keep"),
    Rule("trainer.del_local_ckpt_after_load", "same", "checkpoints are kept after loading; drop it", accepts=_FALSE),
    Rule("trainer.default_hdfs_dir", "same", "HDFS upload is not built; trainer.default_local_dir is the "
         "checkpoint root", accepts=_empty),
    Rule("trainer.rollout_data_dir", "same", "rollout dumps are not built; drop it", accepts=_empty),
    Rule("trainer.esi_redundant_time", "reject", "elastic-instance checkpoint timing is not built; drop it"),
    Rule("ray_kwargs.*", "reject", "verl_lite starts or joins Ray itself (RAY_ADDRESS); drop it"),
    Rule("transfer_queue.*", "reject", "the transfer queue is not built; data moves through the controller"),
]




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
