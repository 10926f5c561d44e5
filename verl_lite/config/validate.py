"""Pre-flight validation: every cross-key rule checked on the driver, before any worker starts.

`validate_config(cfg, world_size=None)` collects ALL problems and raises one `ConfigError`
listing them; each names the key(s) and the fix. It returns a small `Layout` summary
(world size, DP, trajectories per step / per mini-batch / per DP rank) the controller can use.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from verl_lite.config.loader import ConfigError
from verl_lite.config.schema import PPOConfig

ROLLOUT_NAMES = ("hf", "vllm")
REWARD_MANAGERS = ("naive", "batch")
TRUNCATIONS = ("error", "left", "right")
KL_CTRL_TYPES = ("fixed", "adaptive")
LOGGERS = ("console", "jsonl", "tensorboard")
CRITIC_ESTIMATORS = ("gae",)  # need a value model, which verl_lite's loop does not run yet


@dataclass(frozen=True)
class Layout:
    """Derived sizes: world = workers, dp = world / (tp * pp * cp)."""

    world_size: int
    dp: int
    trajectories_per_step: int
    trajectories_per_mini_batch: int
    trajectories_per_dp_rank: int  # of one mini-batch
    optimizer_steps_per_rl_step: int


def _registries():
    """(agg modes, policy losses, advantage estimators, KL types) from verl_lite.algorithms."""
    from verl_lite.algorithms import ADVANTAGE_ESTIMATORS, AGG_MODES, POLICY_LOSSES
    from verl_lite.algorithms.kl import KL_TYPES

    return tuple(AGG_MODES), tuple(sorted(POLICY_LOSSES)), tuple(sorted(ADVANTAGE_ESTIMATORS)), tuple(KL_TYPES)


def _model_config(path: str) -> dict | None:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _check_reward_function(path: str, name: str, key: str, problems: list[str]) -> None:
    """The file exists, imports, and defines a callable `name` (imports it once, on the driver)."""
    file = Path(path)
    if not file.is_file():
        problems.append(f"{key}.path={path!r} does not exist; give the path of a python file defining '{name}'")
        return
    try:
        spec = importlib.util.spec_from_file_location(f"_verl_lite_reward_check_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file fails to import
        problems.append(f"{key}.path={path!r} fails to import ({type(e).__name__}: {e}); fix the file")
        return
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        problems.append(
            f"{key}.name={name!r}: {path} defines no function of that name; set {key}.name to one of {found}"
        )


def validate_config(cfg: PPOConfig, world_size: int | None = None) -> Layout:
    """Check cfg against every rule below; raise ConfigError listing all problems, else return the Layout.

    world_size defaults to trainer.n_gpus_per_node * trainer.nnodes (the number of workers).
    """
    p: list[str] = []
    d, arr, alg, tr = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    actor, ref, rollout, mg = arr.actor, arr.ref, arr.rollout, arr.actor.megatron
    A, R, M = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.actor.megatron"
    agg_modes, policy_losses, estimators, kl_types = _registries()

    def positive(key: str, value, minimum=1):
        if not isinstance(value, (int, float)) or value < minimum:
            p.append(f"{key}={value} must be >= {minimum}")
            return False
        return True

    # ---- sizes
    ok_sizes = all(
        [
            positive("data.train_batch_size", d.train_batch_size),
            positive(f"{A}.ppo_mini_batch_size", actor.ppo_mini_batch_size),
            positive(f"{R}.n", rollout.n),
        ]
    )
    positive("data.max_prompt_length", d.max_prompt_length)
    positive("data.max_response_length", d.max_response_length)
    positive(f"{A}.ppo_epochs", actor.ppo_epochs)
    if d.val_batch_size is not None:
        positive("data.val_batch_size", d.val_batch_size)
    positive("trainer.nnodes", tr.nnodes)
    positive("trainer.n_gpus_per_node", tr.n_gpus_per_node)
    positive("trainer.total_epochs", tr.total_epochs)
    if tr.total_training_steps is not None:
        positive("trainer.total_training_steps", tr.total_training_steps)
    if ok_sizes and d.train_batch_size % actor.ppo_mini_batch_size:
        p.append(
            f"{A}.ppo_mini_batch_size={actor.ppo_mini_batch_size} must divide data.train_batch_size="
            f"{d.train_batch_size} (both count prompts); e.g. set ppo_mini_batch_size to a divisor of "
            f"{d.train_batch_size}"
        )

    # ---- parallel layout
    world = world_size if world_size is not None else tr.n_gpus_per_node * tr.nnodes
    tp, pp, cp = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size, mg.context_parallel_size
    ok_par = all([positive(f"{M}.tensor_model_parallel_size", tp), positive(f"{M}.pipeline_model_parallel_size", pp),
                  positive(f"{M}.context_parallel_size", cp)])
    dp = 0
    if ok_par and world >= 1:
        if world % (tp * pp * cp):
            p.append(
                f"the {world} workers (trainer.n_gpus_per_node x trainer.nnodes) must divide by tp*pp*cp = "
                f"{tp}*{pp}*{cp} = {tp * pp * cp}; change {M}.tensor/pipeline/context_parallel_size or the worker count"
            )
        else:
            dp = world // (tp * pp * cp)
    traj_mini = actor.ppo_mini_batch_size * rollout.n if ok_sizes else 0
    if dp and traj_mini and traj_mini % dp:
        p.append(
            f"trajectories per mini-batch = {A}.ppo_mini_batch_size x {R}.n = {actor.ppo_mini_batch_size} x "
            f"{rollout.n} = {traj_mini} must divide by DP = {dp}; change ppo_mini_batch_size, rollout.n or the layout"
        )
    vpp = mg.virtual_pipeline_model_parallel_size
    model_cfg = _model_config(arr.model.path) if arr.model.path else None
    if vpp is not None:
        if vpp < 2:
            p.append(f"{M}.virtual_pipeline_model_parallel_size={vpp} must be >= 2 (model chunks per pipeline rank) or null")
        elif pp < 2:
            p.append(
                f"{M}.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
                f"(got {pp}); set it to null or raise pp"
            )
    if model_cfg is not None and ok_par:
        layers = model_cfg.get("num_hidden_layers")
        heads = model_cfg.get("num_attention_heads")
        kv_heads = model_cfg.get("num_key_value_heads") or heads
        stages = pp * (vpp if vpp and vpp >= 2 else 1)
        if layers is not None and layers % stages:
            p.append(
                f"the model's {layers} layers must divide by pp x vpp = {pp} x {vpp or 1} = {stages}; "
                f"change {M}.pipeline_model_parallel_size / virtual_pipeline_model_parallel_size"
            )
        if heads is not None and (heads % tp or kv_heads % tp):
            p.append(
                f"{M}.tensor_model_parallel_size={tp} must divide the model's attention heads ({heads}) and "
                f"key/value heads ({kv_heads})"
            )
    if mg.sequence_parallel and ok_par and tp < 2:
        p.append(f"{M}.sequence_parallel=true needs tensor_model_parallel_size > 1 (got {tp}); set it to false")
    if mg.timeout_s is None or mg.timeout_s <= 0:
        p.append(f"{M}.timeout_s={mg.timeout_s} must be > 0 seconds (a stuck collective fails after it)")

    # ---- micro-batching (never changes the math, but must be well defined)
    longest = d.max_prompt_length + d.max_response_length
    for key, dynamic, micro, budget in (
        (A, actor.use_dynamic_bsz, actor.ppo_micro_batch_size_per_gpu, actor.ppo_max_token_len_per_gpu),
        ("actor_rollout_ref.ref", ref.log_prob_use_dynamic_bsz, ref.log_prob_micro_batch_size_per_gpu,
         ref.log_prob_max_token_len_per_gpu),
        (R, rollout.log_prob_use_dynamic_bsz, rollout.log_prob_micro_batch_size_per_gpu,
         rollout.log_prob_max_token_len_per_gpu),
    ):
        dyn_key = "use_dynamic_bsz" if key == A else "log_prob_use_dynamic_bsz"
        budget_key = "ppo_max_token_len_per_gpu" if key == A else "log_prob_max_token_len_per_gpu"
        micro_key = "ppo_micro_batch_size_per_gpu" if key == A else "log_prob_micro_batch_size_per_gpu"
        if dynamic:
            if budget * max(cp, 1) < longest:
                p.append(
                    f"{key}.{budget_key}={budget} (x cp={cp}) is below the longest sequence data.max_prompt_length"
                    f" + data.max_response_length = {longest}; raise it to at least {-(-longest // max(cp, 1))}"
                )
        elif micro is not None and micro < 1:
            p.append(f"{key}.{micro_key}={micro} must be >= 1 (or null to use the actor's)")
        elif micro is None and key == A:
            p.append(f"{A}: set ppo_micro_batch_size_per_gpu (trajectories per micro-batch) or {dyn_key}=true")
        elif micro is None and actor.ppo_micro_batch_size_per_gpu is None and not actor.use_dynamic_bsz:
            p.append(f"{key}.{micro_key} is null and the actor has none to inherit; set it")

    # ---- algorithm names (registries of verl_lite.algorithms)
    if actor.loss_agg_mode not in agg_modes:
        p.append(f"{A}.loss_agg_mode={actor.loss_agg_mode!r} is unknown; choose one of {list(agg_modes)}")
    if actor.policy_loss.loss_mode not in policy_losses:
        p.append(f"{A}.policy_loss.loss_mode={actor.policy_loss.loss_mode!r} is unknown; choose one of {list(policy_losses)}")
    if alg.adv_estimator not in estimators:
        p.append(f"algorithm.adv_estimator={alg.adv_estimator!r} is unknown; choose one of {list(estimators)}")
    elif alg.adv_estimator in CRITIC_ESTIMATORS:
        p.append(
            f"algorithm.adv_estimator={alg.adv_estimator!r} needs a critic, which verl_lite's trainer does not run "
            f"yet; use a critic-free estimator such as grpo, rloo or reinforce_plus_plus"
        )
    elif alg.adv_estimator in ("grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline") and ok_sizes:
        if rollout.n < 2:
            p.append(
                f"algorithm.adv_estimator={alg.adv_estimator!r} compares samples of the same prompt; set {R}.n >= 2 "
                f"(got {rollout.n})"
            )
    if actor.use_kl_loss and actor.kl_loss_type not in kl_types:
        p.append(f"{A}.kl_loss_type={actor.kl_loss_type!r} is unknown; choose one of {list(kl_types)}")
    if alg.use_kl_in_reward and alg.kl_penalty not in kl_types:
        p.append(f"algorithm.kl_penalty={alg.kl_penalty!r} is unknown; choose one of {list(kl_types)}")
    if alg.kl_ctrl.type not in KL_CTRL_TYPES:
        p.append(f"algorithm.kl_ctrl.type={alg.kl_ctrl.type!r} is unknown; choose one of {list(KL_CTRL_TYPES)}")
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        v = getattr(actor, name)
        if v is not None and not v > 0:
            p.append(f"{A}.{name}={v} must be > 0")
    if not actor.clip_ratio_c > 1:
        p.append(f"{A}.clip_ratio_c={actor.clip_ratio_c} must be > 1 (dual-clip lower bound)")
    if actor.loss_scale_factor is not None and not actor.loss_scale_factor > 0:
        p.append(f"{A}.loss_scale_factor={actor.loss_scale_factor} must be > 0 or null (= data.max_response_length)")
    if not 0.0 <= alg.gamma <= 1.0 or not 0.0 <= alg.lam <= 1.0:
        p.append(f"algorithm.gamma={alg.gamma} and algorithm.lam={alg.lam} must lie in [0, 1]")

    # ---- optimizer
    o = actor.optim
    if not o.lr > 0:
        p.append(f"{A}.optim.lr={o.lr} must be > 0")
    if o.lr_decay_style not in ("constant", "linear", "cosine"):
        p.append(f"{A}.optim.lr_decay_style={o.lr_decay_style!r} is unknown; choose constant, linear or cosine")
    if not 0.0 <= o.min_lr <= o.lr:
        p.append(f"{A}.optim.min_lr={o.min_lr} must lie in [0, optim.lr={o.lr}]")
    if o.lr_warmup_steps < 0:
        p.append(f"{A}.optim.lr_warmup_steps={o.lr_warmup_steps} must be >= 0")
    if not o.clip_grad > 0:
        p.append(f"{A}.optim.clip_grad={o.clip_grad} must be > 0 (use 1e9 to effectively disable clipping)")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        p.append(f"{A}.optim.betas={list(o.betas)} must be two numbers in [0, 1)")

    # ---- rollout
    if rollout.name not in ROLLOUT_NAMES:
        p.append(f"{R}.name={rollout.name!r} is unknown; choose one of {list(ROLLOUT_NAMES)}")
    elif rollout.name == "vllm":
        from verl_lite.rollout import vllm_available

        if not vllm_available():
            p.append(f"{R}.name=vllm needs the vllm package and a CUDA GPU; use {R}.name=hf")
    for key, temp, top_p, top_k, sampling in (
        (R, rollout.temperature, rollout.top_p, rollout.top_k, True),
        (f"{R}.val_kwargs", rollout.val_kwargs.temperature, rollout.val_kwargs.top_p, rollout.val_kwargs.top_k,
         rollout.val_kwargs.do_sample),
    ):
        if sampling and not temp > 0:
            p.append(f"{key}.temperature={temp} must be > 0 when sampling (use val_kwargs.do_sample=false for greedy)")
        if not 0.0 < top_p <= 1.0:
            p.append(f"{key}.top_p={top_p} must lie in (0, 1]")
        if top_k < -1:
            p.append(f"{key}.top_k={top_k} must be -1/0 (disabled) or a positive count")
    positive(f"{R}.val_kwargs.n", rollout.val_kwargs.n)
    if rollout.val_kwargs.n > 1 and not rollout.val_kwargs.do_sample:
        p.append(f"{R}.val_kwargs.n={rollout.val_kwargs.n} > 1 needs val_kwargs.do_sample=true (greedy samples repeat)")

    # ---- data
    if d.truncation not in TRUNCATIONS:
        p.append(f"data.truncation={d.truncation!r} is unknown; choose one of {list(TRUNCATIONS)}")
    for key in ("train_files", "val_files"):
        files = getattr(d, key)
        files = [files] if isinstance(files, str) else list(files or [])
        if not files:
            p.append(f"data.{key} is empty; give one or more parquet files (or null for the built-in task)")
        for f in files:
            if not Path(f).is_file():
                p.append(f"data.{key}: {f!r} does not exist; give an existing parquet file")

    # ---- model
    mpath = arr.model.path
    if not mpath or not (Path(mpath) / "config.json").is_file():
        p.append(
            f"actor_rollout_ref.model.path={mpath!r} is not an HF model directory (no config.json); "
            f"give a local HF model dir or null for the shipped tiny model"
        )
    tpath = arr.model.tokenizer_path or mpath
    if tpath and not any((Path(tpath) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        p.append(f"actor_rollout_ref.model.tokenizer_path={tpath!r} holds no tokenizer.json/tokenizer_config.json")

    # ---- reward
    rw = cfg.reward
    if rw.reward_manager not in REWARD_MANAGERS:
        p.append(f"reward.reward_manager={rw.reward_manager!r} is unknown; choose one of {list(REWARD_MANAGERS)}")
    if rw.custom_reward_function.path:
        _check_reward_function(
            rw.custom_reward_function.path, rw.custom_reward_function.name, "reward.custom_reward_function", p
        )

    # ---- trainer
    if tr.save_freq > 0:
        p.append(f"trainer.save_freq={tr.save_freq}: checkpointing is not implemented yet; set trainer.save_freq=-1")
    if not tr.worker_timeout_s > 0:
        p.append(f"trainer.worker_timeout_s={tr.worker_timeout_s} must be > 0 (seconds the driver waits for a worker call)")
    for lg in tr.logger:
        if lg not in LOGGERS:
            p.append(f"trainer.logger entry {lg!r} is unknown; choose from {list(LOGGERS)}")

    if p:
        raise ConfigError(p)
    return Layout(
        world_size=world,
        dp=dp,
        trajectories_per_step=d.train_batch_size * rollout.n,
        trajectories_per_mini_batch=traj_mini,
        trajectories_per_dp_rank=traj_mini // dp,
        optimizer_steps_per_rl_step=(d.train_batch_size // actor.ppo_mini_batch_size) * actor.ppo_epochs,
    )
