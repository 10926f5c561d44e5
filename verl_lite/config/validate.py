"""Pre-flight validation: every cross-key rule checked on the driver, before any worker starts.

`validate_config(cfg, world_size=None)` collects ALL problems and raises one `ConfigError`
listing them; each names the key(s) and the fix. It returns a small `Layout` summary
(world size, DP, trajectories per step / per mini-batch / per DP rank) the controller can use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verl_lite.config.loader import ConfigError
from verl_lite.config.schema import LOGGER_BACKENDS, PPOConfig
from verl_lite.engine import rules
from verl_lite.engine.model_files import config_int, read_config

RESUME_MODES = ("auto", "disable", "resume_path")
FILTER_GROUPS_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


@dataclass(frozen=True)
class Layout:
    """Derived sizes: world = workers, dp = world / (tp * pp * cp)."""

    world_size: int
    dp: int
    critic_world_size: int  # 0 when the estimator needs no critic
    critic_dp: int
    trajectories_per_step: int
    trajectories_per_mini_batch: int
    trajectories_per_dp_rank: int  # of one mini-batch
    optimizer_steps_per_rl_step: int


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _registries():
    """(agg modes, policy losses, advantage estimators, KL types) from verl_lite.algorithms."""
    from verl_lite.algorithms import ADVANTAGE_ESTIMATORS, AGG_MODES, POLICY_LOSSES
    from verl_lite.algorithms.kl import KL_TYPES

    return tuple(AGG_MODES), tuple(sorted(POLICY_LOSSES)), tuple(sorted(ADVANTAGE_ESTIMATORS)), tuple(KL_TYPES)


def _checkpoint_key_problems(tr) -> list[str]:
    """The checkpoint keys of the ``trainer`` section (whether a resume_from_path directory holds a complete
    checkpoint is the checkpoint manager's check, before Ray starts)."""
    p: list[str] = []
    if tr.resume_mode not in RESUME_MODES:
        p.append(f"trainer.resume_mode={tr.resume_mode!r} is unknown; choose one of {list(RESUME_MODES)}")
    if tr.resume_mode == "resume_path":
        if not tr.resume_from_path:
            p.append("trainer.resume_mode=resume_path needs trainer.resume_from_path=<a global_step_K directory>")
        elif not Path(tr.resume_from_path).expanduser().is_dir():
            p.append(f"trainer.resume_from_path={tr.resume_from_path!r} is not a directory; give a global_step_K "
                     f"directory written by verl_lite")
    elif tr.resume_from_path:
        p.append(f"trainer.resume_from_path is set but trainer.resume_mode={tr.resume_mode!r}; set "
                 f"trainer.resume_mode=resume_path to use it")
    if tr.max_actor_ckpt_to_keep is not None and tr.max_actor_ckpt_to_keep < 1:
        p.append(f"trainer.max_actor_ckpt_to_keep={tr.max_actor_ckpt_to_keep} must be >= 1 or null (keep all)")
    if tr.log_freq < 1:
        p.append(f"trainer.log_freq={tr.log_freq} must be >= 1")
    return p


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
    model_cfg = read_config(arr.model.path) if arr.model.path else None
    dp = _check_layout(M, mg, world, "the {world} workers (trainer.n_gpus_per_node x trainer.nnodes)", model_cfg,
                       positive, p)
    from verl_lite.workers.from_config import engine_model_overrides

    p.extend(rules.router_loss_recompute_problems(f"{M}.override_transformer_config", model_cfg,
                                                  engine_model_overrides(arr.model, mg),
                                                  "actor_rollout_ref.model.enable_gradient_checkpointing"))
    traj_mini = actor.ppo_mini_batch_size * rollout.n if ok_sizes else 0
    if dp and traj_mini and traj_mini % dp:
        p.append(
            f"trajectories per mini-batch = {A}.ppo_mini_batch_size x {R}.n = {actor.ppo_mini_batch_size} x "
            f"{rollout.n} = {traj_mini} must divide by DP = {dp}; change ppo_mini_batch_size, rollout.n or the layout"
        )
    needs = _estimator_needs(alg.adv_estimator)
    critic_world = critic_dp = 0
    if "critic" in needs:
        critic_world, critic_dp = _check_critic(cfg, world, positive, p)

    # ---- micro-batching (never changes the math, but must be well defined)
    longest = d.max_prompt_length + d.max_response_length
    sections = [
        (A, actor.use_dynamic_bsz, actor.ppo_micro_batch_size_per_gpu, actor.ppo_max_token_len_per_gpu,
         "use_dynamic_bsz", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", True),
        ("actor_rollout_ref.ref", ref.log_prob_use_dynamic_bsz, ref.log_prob_micro_batch_size_per_gpu,
         ref.log_prob_max_token_len_per_gpu, "log_prob_use_dynamic_bsz", "log_prob_micro_batch_size_per_gpu",
         "log_prob_max_token_len_per_gpu", False),
        (R, rollout.log_prob_use_dynamic_bsz, rollout.log_prob_micro_batch_size_per_gpu,
         rollout.log_prob_max_token_len_per_gpu, "log_prob_use_dynamic_bsz", "log_prob_micro_batch_size_per_gpu",
         "log_prob_max_token_len_per_gpu", False),
    ]
    if "critic" in needs:
        c = cfg.critic
        sections += [
            ("critic", c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu, c.ppo_max_token_len_per_gpu,
             "use_dynamic_bsz", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", False),
            ("critic", c.use_dynamic_bsz, c.forward_micro_batch_size_per_gpu,
             c.forward_max_token_len_per_gpu, "use_dynamic_bsz",
             "forward_micro_batch_size_per_gpu", "forward_max_token_len_per_gpu", False),
        ]
    for key, dynamic, micro, budget, dyn_key, micro_key, budget_key, required in sections:
        section_cp = cfg.critic.megatron.context_parallel_size if key == "critic" else mg.context_parallel_size
        section_cp = section_cp if isinstance(section_cp, int) and section_cp >= 1 else 1
        if dynamic:
            if budget * section_cp < longest:
                p.append(
                    f"{key}.{budget_key}={budget} (x cp={section_cp}) is below the longest sequence "
                    f"data.max_prompt_length + data.max_response_length = {longest}; raise it to at least "
                    f"{-(-longest // section_cp)}"
                )
        elif micro is not None and micro < 1:
            p.append(f"{key}.{micro_key}={micro} must be >= 1 (or null to use the actor's)")
        elif micro is None and required:
            p.append(f"{A}: set ppo_micro_batch_size_per_gpu (trajectories per micro-batch) or {dyn_key}=true")
        elif micro is None and actor.ppo_micro_batch_size_per_gpu is None and not actor.use_dynamic_bsz:
            p.append(f"{key}.{micro_key} is null and the actor has none to inherit; set it")
    return _validate_rest(cfg, p, positive, world, dp, traj_mini, ok_sizes, needs, critic_world, critic_dp)


def _estimator_needs(name: str) -> frozenset:
    from verl_lite.algorithms import ESTIMATOR_NEEDS

    return ESTIMATOR_NEEDS.get(name, frozenset())


def _check_layout(key: str, mg, world: int, workers: str, model_cfg: dict | None, positive, p: list[str]) -> int:
    """TP/PP/VPP/CP of one engine role (``key`` = its megatron section) over ``world`` workers; returns DP (0 if bad)."""
    tp, pp, cp = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size, mg.context_parallel_size
    ok_par = all([positive(f"{key}.tensor_model_parallel_size", tp), positive(f"{key}.pipeline_model_parallel_size", pp),
                  positive(f"{key}.context_parallel_size", cp)])
    M = key
    dp = 0
    if ok_par and world >= 1:
        if world % (tp * pp * cp):
            p.append(
                f"{workers.format(world=world)} must divide by tp*pp*cp = "
                f"{tp}*{pp}*{cp} = {tp * pp * cp}; change {M}.tensor/pipeline/context_parallel_size or the worker count"
            )
        else:
            dp = world // (tp * pp * cp)
    vpp = mg.virtual_pipeline_model_parallel_size
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
        if heads is not None and (heads % tp or (kv_heads % tp and tp % kv_heads)):
            p.append(
                f"{M}.tensor_model_parallel_size={tp} must divide the model's attention heads ({heads}), and "
                f"TP and the key/value heads ({kv_heads}) must divide one another (megatron replicates KV heads "
                f"when TP exceeds them)"
            )
    if mg.sequence_parallel and ok_par and tp < 2:
        p.append(f"{M}.sequence_parallel=true needs tensor_model_parallel_size > 1 (got {tp}); set it to false")
    if mg.timeout_s is None or mg.timeout_s <= 0:
        p.append(f"{M}.timeout_s={mg.timeout_s} must be > 0 seconds (a stuck collective fails after it)")
    p.extend(rules.dtype_problems(f"{M}.dtype", mg.dtype))
    p.extend(rules.transformer_override_problems(f"{M}.override_transformer_config", mg.override_transformer_config,
                                                 dtype=mg.dtype, cuda=_cuda_visible()))
    if ok_par:
        p.extend(rules.moe_layout_problems(M, mg, world, model_cfg))
    return dp


def _check_critic(cfg: PPOConfig, actor_world: int, positive, p: list[str]) -> tuple[int, int]:
    """The critic role: its workers, layout, batch sizes, loss and optimizer; returns (world, dp)."""
    from verl_lite.algorithms import AGG_MODES

    c, actor = cfg.critic, cfg.actor_rollout_ref.actor
    world = actor_world if c.num_workers is None else c.num_workers
    if c.num_workers is not None and not positive("critic.num_workers", c.num_workers):
        return 0, 0
    path = c.model.path
    if path != cfg.actor_rollout_ref.model.path and not (Path(path) / "config.json").is_file():
        p.append(f"critic.model.path={c.model.path!r} is not an HF model directory (no config.json); give one or "
                 f"null for the actor's model with a fresh value head")
    model_cfg = read_config(path) if path else None
    dp = _check_layout("critic.megatron", c.megatron, world,
                       "the critic's {world} workers (critic.num_workers, null = the actor's)", model_cfg, positive, p)
    mini = c.ppo_mini_batch_size
    n = cfg.actor_rollout_ref.rollout.n
    if mini != actor.ppo_mini_batch_size and positive("critic.ppo_mini_batch_size", mini):
        if cfg.data.train_batch_size % c.ppo_mini_batch_size:
            p.append(f"critic.ppo_mini_batch_size={c.ppo_mini_batch_size} must divide data.train_batch_size="
                     f"{cfg.data.train_batch_size} (both count prompts)")
    if dp and mini and (mini * n) % dp:
        p.append(f"critic trajectories per mini-batch = {mini} x rollout.n {n} = {mini * n} must divide by the "
                 f"critic's DP = {dp}; change critic.ppo_mini_batch_size or critic.megatron.*")
    positive("critic.ppo_epochs", c.ppo_epochs)
    if not c.cliprange_value >= 0:
        p.append(f"critic.cliprange_value={c.cliprange_value} must be >= 0")
    if c.loss_agg_mode not in AGG_MODES:
        p.append(f"critic.loss_agg_mode={c.loss_agg_mode!r} is unknown; choose one of {list(AGG_MODES)} or null")
    p.extend(rules.optim_problems("critic.optim", c.optim))
    return world, dp


def _validate_rest(cfg: PPOConfig, p: list[str], positive, world, dp, traj_mini, ok_sizes, needs, critic_world,
                   critic_dp) -> Layout:
    d, arr, alg, tr = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    actor, rollout = arr.actor, arr.rollout
    A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    agg_modes, policy_losses, estimators, kl_types = _registries()

    # ---- algorithm names (registries of verl_lite.algorithms)
    if actor.loss_agg_mode not in agg_modes:
        p.append(f"{A}.loss_agg_mode={actor.loss_agg_mode!r} is unknown; choose one of {list(agg_modes)}")
    if actor.policy_loss.loss_mode not in policy_losses:
        p.append(f"{A}.policy_loss.loss_mode={actor.policy_loss.loss_mode!r} is unknown; choose one of {list(policy_losses)}")
    if alg.adv_estimator not in estimators:
        p.append(f"algorithm.adv_estimator={alg.adv_estimator!r} is unknown; choose one of {list(estimators)}")
    elif "groups" in needs and ok_sizes:
        if rollout.n < 2:
            p.append(
                f"algorithm.adv_estimator={alg.adv_estimator!r} compares samples of the same prompt; set {R}.n >= 2 "
                f"(got {rollout.n})"
            )
    if actor.use_kl_loss and actor.kl_loss_type not in kl_types:
        p.append(f"{A}.kl_loss_type={actor.kl_loss_type!r} is unknown; choose one of {list(kl_types)}")
    if alg.use_kl_in_reward and alg.kl_penalty not in kl_types:
        p.append(f"algorithm.kl_penalty={alg.kl_penalty!r} is unknown; choose one of {list(kl_types)}")
    from verl_lite.algorithms.kl import KL_CTRL_TYPES

    if alg.kl_ctrl.type not in KL_CTRL_TYPES:
        p.append(f"algorithm.kl_ctrl.type={alg.kl_ctrl.type!r} is unknown; choose one of {list(KL_CTRL_TYPES)}")
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        v = getattr(actor, name)
        if v is not None and not v > 0:
            p.append(f"{A}.{name}={v} must be > 0")
    if not actor.clip_ratio_c > 1:
        p.append(f"{A}.clip_ratio_c={actor.clip_ratio_c} must be > 1 (dual-clip lower bound)")
    if not actor.loss_scale_factor > 0:
        p.append(f"{A}.loss_scale_factor={actor.loss_scale_factor} must be > 0 or null (= data.max_response_length)")
    if not 0.0 <= alg.gamma <= 1.0 or not 0.0 <= alg.lam <= 1.0:
        p.append(f"algorithm.gamma={alg.gamma} and algorithm.lam={alg.lam} must lie in [0, 1]")
    pl = actor.policy_loss
    for name in ("clip_cov_ratio", "kl_cov_ratio", "tau_pos", "tau_neg"):
        if not getattr(pl, name) > 0:
            p.append(f"{A}.policy_loss.{name}={getattr(pl, name)} must be > 0")
    if not pl.clip_cov_lb < pl.clip_cov_ub:
        p.append(f"{A}.policy_loss.clip_cov_lb={pl.clip_cov_lb} must be < clip_cov_ub={pl.clip_cov_ub}")
    if actor.tis_imp_ratio_cap != -1 and not actor.tis_imp_ratio_cap > 0:
        p.append(f"{A}.tis_imp_ratio_cap={actor.tis_imp_ratio_cap} must be > 0 (the truncation cap) or -1 (off)")
    if tr.critic_warmup < 0:
        p.append(f"trainer.critic_warmup={tr.critic_warmup} must be >= 0 (RL steps that update only the critic)")
    elif tr.critic_warmup > 0 and "critic" not in needs:
        p.append(f"trainer.critic_warmup={tr.critic_warmup} needs a critic, but algorithm.adv_estimator="
                 f"{alg.adv_estimator!r} runs none; set it to 0 or use adv_estimator=gae")
    fg = alg.filter_groups
    if fg.enable:
        if fg.metric not in FILTER_GROUPS_METRICS:
            p.append(f"algorithm.filter_groups.metric={fg.metric!r} is unknown; choose one of {list(FILTER_GROUPS_METRICS)}")
        if not isinstance(fg.max_num_gen_batches, int) or fg.max_num_gen_batches < 1:
            p.append(f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} must be >= 1: every "
                     f"step needs a bound on its generation rounds (verl's 0 = unbounded could loop forever)")
        if ok_sizes and rollout.n < 2:
            p.append(f"algorithm.filter_groups.enable=true compares the samples of a prompt; set {R}.n >= 2")
    ob = cfg.reward.overlong_buffer
    if ob.enable:
        if not 0 < ob.len <= d.max_response_length:
            p.append(f"reward.overlong_buffer.len={ob.len} must lie in (0, data.max_response_length="
                     f"{d.max_response_length}]")
        if not ob.penalty_factor >= 0:
            p.append(f"reward.overlong_buffer.penalty_factor={ob.penalty_factor} must be >= 0")

    # ---- optimizer
    p.extend(rules.optim_problems(f"{A}.optim", actor.optim))
    for key, enabled in (("actor_rollout_ref.model", arr.model.enable_gradient_checkpointing),
                         ("critic.model", cfg.critic.model.enable_gradient_checkpointing and "critic" in needs)):
        if enabled and not _cuda_visible():
            p.append(f"{key}.enable_gradient_checkpointing=true: megatron's activation recompute saves and restores "
                     f"the CUDA RNG state, so it runs on GPU only; set it false on CPU")

    # ---- rollout
    from verl_lite.rollout.rules import rollout_problems

    p.extend(rollout_problems(R, rollout, d.max_prompt_length + d.max_response_length,
                              config_int(arr.model.path, "max_position_embeddings") if arr.model.path else None,
                              _cuda_visible()))

    # ---- data
    from verl_lite.data.rules import data_problems

    p.extend(data_problems(d))

    # ---- model
    mpath = arr.model.path
    if not mpath or not (Path(mpath) / "config.json").is_file():
        p.append(
            f"actor_rollout_ref.model.path={mpath!r} is not an HF model directory (no config.json); "
            f"give a local HF model dir or null for the shipped tiny model"
        )
    tpath = arr.model.tokenizer_path
    if tpath and not any((Path(tpath) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        p.append(f"actor_rollout_ref.model.tokenizer_path={tpath!r} holds no tokenizer.json/tokenizer_config.json")

    # ---- reward
    from verl_lite.reward.rules import reward_problems

    p.extend(reward_problems(cfg.reward))

    # ---- trainer
    p.extend(_checkpoint_key_problems(tr))
    if not isinstance(tr.log_val_generations, int) or tr.log_val_generations < 0:
        p.append(f"trainer.log_val_generations={tr.log_val_generations} must be >= 0 (validation samples logged)")
    if not tr.worker_timeout_s > 0:
        p.append(f"trainer.worker_timeout_s={tr.worker_timeout_s} must be > 0 (seconds the driver waits for a worker call)")
    for lg in tr.logger:
        if lg not in LOGGER_BACKENDS:
            p.append(f"trainer.logger entry {lg!r} is unknown; choose from {list(LOGGER_BACKENDS)}")

    if p:
        raise ConfigError(p)
    return Layout(
        world_size=world,
        dp=dp,
        critic_world_size=critic_world,
        critic_dp=critic_dp,
        trajectories_per_step=d.train_batch_size * rollout.n,
        trajectories_per_mini_batch=traj_mini,
        trajectories_per_dp_rank=traj_mini // dp,
        optimizer_steps_per_rl_step=(d.train_batch_size // actor.ppo_mini_batch_size) * actor.ppo_epochs,
    )
