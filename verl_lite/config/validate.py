"""Pre-flight validation: every cross-key rule checked on the driver, before any worker starts.

`validate_config(cfg, world_size=None)` collects ALL problems and raises one `ConfigError` listing them, each naming
the key(s) and the fix, else returns the `Layout` summary. Each section's own rules are its owner's ``problems``;
this module states the ranges of the config's counts and the batch arithmetic between sections, and collects.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

from verl_lite.config.loader import ConfigError
from verl_lite.config.schema import ACTOR_KEY, LOGGER_BACKENDS, ROLLOUT_KEY, PPOConfig
from verl_lite.controller.config import placement_problems, resolve_placement
from verl_lite.engine.config import (MEGATRON_NAMES, MOE_MODEL_TYPES, RECOMPUTE, router_loss_recompute_problems,
                                     transformer_override_problems)
from verl_lite.engine.model_files import config_int, lora_adapter_problems, model_dir_problem, read_config

A, R = ACTOR_KEY, ROLLOUT_KEY
M = f"{A}.megatron"
RESUME_MODES = ("auto", "disable", "resume_path")
# (key, lower bound, bound included): the counts, sizes and bounds of the config; a null (where allowed) passes
BOUNDS = tuple((key, 1, True) for key in (
    "data.train_batch_size", f"{A}.ppo_mini_batch_size", f"{R}.n", "data.max_prompt_length", "data.max_response_length",
    f"{A}.ppo_epochs", "data.val_batch_size", "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.total_epochs",
    "trainer.total_training_steps", "trainer.log_freq", "trainer.max_actor_ckpt_to_keep")) + (
    ("trainer.log_val_generations", 0, True), ("trainer.critic_warmup", 0, True), ("trainer.worker_timeout_s", 0, False))
CRITIC_BOUNDS = (("critic.num_workers", 1, True), ("critic.ppo_mini_batch_size", 1, True),
                 ("critic.ppo_epochs", 1, True), ("critic.cliprange_value", 0, True))


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


def _out_of_bounds(cfg: PPOConfig, bounds) -> dict[str, str]:
    """key -> its problem, for each key of ``bounds`` whose value lies outside its bound."""
    out = {}
    for key, low, included in bounds:
        v = attrgetter(key)(cfg)
        if v is not None and not (isinstance(v, (int, float)) and (v >= low if included else v > low)):
            out[key] = f"{key}={v} must be {'>=' if included else '>'} {low}"
    return out


def validate_config(cfg: PPOConfig, world_size: int | None = None) -> Layout:
    """Check cfg against every rule below; raise ConfigError listing all problems, else return the Layout.

    world_size defaults to trainer.n_gpus_per_node * trainer.nnodes (the number of workers). The placement and
    policy lag a config leaves to be derived are resolved first (``controller.config.resolve_placement``).
    """
    resolve_placement(cfg)
    d, arr, alg, tr = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    actor, rollout, mg = arr.actor, arr.rollout, arr.actor.megatron
    bad = _out_of_bounds(cfg, BOUNDS)
    p = list(bad.values())
    ok_sizes = not {"data.train_batch_size", f"{A}.ppo_mini_batch_size", f"{R}.n"} & bad.keys()
    if ok_sizes and d.train_batch_size % actor.ppo_mini_batch_size:
        p.append(
            f"{A}.ppo_mini_batch_size={actor.ppo_mini_batch_size} must divide data.train_batch_size="
            f"{d.train_batch_size} (both count prompts); e.g. set ppo_mini_batch_size to a divisor of "
            f"{d.train_batch_size}"
        )
    world = world_size if world_size is not None else tr.n_gpus_per_node * tr.nnodes
    model_cfg = read_config(arr.model.path) if arr.model.path else None
    dp = _check_layout(M, mg, world, "the {world} workers (trainer.n_gpus_per_node x trainer.nnodes)", model_cfg, p)
    recompute = RECOMPUTE if arr.model.enable_gradient_checkpointing else {}
    p.extend(router_loss_recompute_problems(f"{M}.override_transformer_config", model_cfg,
                                            {**recompute, **mg.override_transformer_config},
                                            "actor_rollout_ref.model.enable_gradient_checkpointing"))
    traj_mini = actor.ppo_mini_batch_size * rollout.n if ok_sizes else 0
    if dp and traj_mini and traj_mini % dp:
        p.append(
            f"trajectories per mini-batch = {A}.ppo_mini_batch_size x {R}.n = {actor.ppo_mini_batch_size} x "
            f"{rollout.n} = {traj_mini} must divide by DP = {dp}; change ppo_mini_batch_size, rollout.n or the layout"
        )
    needs = alg.needs
    critic_world, critic_dp = _check_critic(cfg, world, p) if "critic" in needs else (0, 0)

    p.extend(cfg.reward_model.problems(world, _cuda_visible()))
    model = cfg.actor_rollout_ref.model
    p.extend(cfg.distillation.problems(world, _cuda_visible(), model.path, model.tokenizer_path or model.path,
                                       tr.nnodes))
    p.extend(cfg.micro_batch_problems("critic" in needs))
    p.extend(_section_problems(cfg, needs, rollout.n if ok_sizes else None))
    if p:
        raise ConfigError(_without_echoes(cfg, p))
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


def _without_echoes(cfg: PPOConfig, problems: list[str]) -> list[str]:
    """A key that holds another key's value (``loader.INHERITED``: null = that key's) fails with it: its line
    is dropped when the key it copies is reported, so one bad value is one line, at the key the user set."""
    from verl_lite.config.loader import INHERITED

    reported = {line.split("=", 1)[0] for line in problems}
    echoes = {f"{section}.{key}" for section, key, source in INHERITED
              if source in reported and attrgetter(f"{section}.{key}")(cfg) == attrgetter(source)(cfg)}
    return [line for line in problems if line.split("=", 1)[0] not in echoes]


def _check_layout(key: str, mg, world: int, workers: str, model_cfg: dict | None, p: list[str]) -> int:
    """TP/PP/VPP/CP of one engine role (``key`` = its megatron section) over ``world`` workers; returns DP (0 if bad)."""
    before = len(p)
    p.extend(mg.problems(key, world, workers, model_cfg))
    p.extend(transformer_override_problems(f"{key}.override_transformer_config", mg.override_transformer_config,
                                           dtype=mg.dtype, cuda=_cuda_visible()))
    sizes_ok = not any(f"{key}.{MEGATRON_NAMES[f]}=" in line for line in p[before:] for f in ("tp", "pp", "cp"))
    if sizes_ok:
        p.extend(mg.moe_problems(key, world, model_cfg))
    model_parallel = mg.tensor_model_parallel_size * mg.pipeline_model_parallel_size * mg.context_parallel_size
    return world // model_parallel if sizes_ok and world >= 1 and not world % model_parallel else 0


def _check_critic(cfg: PPOConfig, actor_world: int, p: list[str]) -> tuple[int, int]:
    """The critic role: its workers, layout, batch sizes, loss and optimizer; returns (world, dp)."""
    c, actor = cfg.critic, cfg.actor_rollout_ref.actor
    bad = _out_of_bounds(cfg, CRITIC_BOUNDS)
    p.extend(bad.values())
    if "critic.num_workers" in bad:
        return 0, 0
    world = actor_world if c.num_workers is None else c.num_workers
    if c.num_workers is not None and cfg.trainer.nnodes > 1:
        p.append(f"critic.num_workers={c.num_workers} with trainer.nnodes={cfg.trainer.nnodes}: a critic on workers of "
                 f"its own is placed on one node only (its workers would push the actor's ranks onto other nodes); "
                 f"colocate the critic (critic.num_workers=null) or run on one node")
    if c.model.path != cfg.actor_rollout_ref.model.path:
        p.extend(filter(None, [model_dir_problem("critic.model.path", c.model.path,
                                                 "the actor's model with a fresh value head")]))
    model_cfg = read_config(c.model.path) if c.model.path else None
    dp = _check_layout("critic.megatron", c.megatron, world,
                       "the critic's {world} workers (critic.num_workers, null = the actor's)", model_cfg, p)
    mini, n = c.ppo_mini_batch_size, cfg.actor_rollout_ref.rollout.n
    if mini != actor.ppo_mini_batch_size and "critic.ppo_mini_batch_size" not in bad and cfg.data.train_batch_size % mini:
        p.append(f"critic.ppo_mini_batch_size={mini} must divide data.train_batch_size={cfg.data.train_batch_size} "
                 f"(both count prompts)")
    if dp and mini and (mini * n) % dp:
        p.append(f"critic trajectories per mini-batch = {mini} x rollout.n {n} = {mini * n} must divide by the "
                 f"critic's DP = {dp}; change critic.ppo_mini_batch_size or critic.megatron.*")
    p.extend(c.problems())
    return world, dp


def _section_problems(cfg: PPOConfig, needs, n: int | None) -> list[str]:
    """Each section's own rules, collected from its owner's ``problems``, and the cross-key rules of the trainer,
    the model files and LoRA; ``n`` = samples per prompt (None: not a valid size)."""
    d, arr, alg, tr = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    actor, rollout = arr.actor, arr.rollout
    p = actor.problems(A) + alg.problems(n, f"{R}.n", actor.tis_imp_ratio_cap, actor.policy_loss.loss_mode)
    if tr.critic_warmup > 0 and "critic" not in needs:
        p.append(f"trainer.critic_warmup={tr.critic_warmup} needs a critic, but algorithm.adv_estimator="
                 f"{alg.adv_estimator!r} runs none; set it to 0 or use adv_estimator=gae")
    p.extend(actor.optim.problems(f"{A}.optim"))
    for key, lora, model, mg_section, mg_key in (
            ("actor_rollout_ref.model.lora", arr.model.lora, arr.model, actor.megatron, M),
            ("critic.model.lora", cfg.critic.model.lora, cfg.critic.model, cfg.critic.megatron, "critic.megatron")):
        used = key == "actor_rollout_ref.model.lora" or "critic" in needs
        # a PEFT adapter_path (rank > 0, on an engine the run builds) is checked here, before any worker loads it
        p.extend(lora.problems(key) or (lora_adapter_problems(key, lora) if used and lora.rank else []))
        if used and model.path:
            kv = config_int(model.path, "num_key_value_heads") or config_int(model.path, "num_attention_heads")
            p.extend(lora.layout_problems(key, kv, mg_section.tensor_model_parallel_size,
                                          f"{mg_key}.tensor_model_parallel_size"))
    for key, enabled in (("actor_rollout_ref.model", arr.model.enable_gradient_checkpointing),
                         ("critic.model", cfg.critic.model.enable_gradient_checkpointing and "critic" in needs)):
        if enabled and not _cuda_visible():
            p.append(f"{key}.enable_gradient_checkpointing=true: megatron's activation recompute saves and restores "
                     f"the CUDA RNG state, so it runs on GPU only; set it false on CPU")
    model_cfg = read_config(arr.model.path) if arr.model.path else None
    moe = (model_cfg or {}).get("model_type") in MOE_MODEL_TYPES
    p.extend(actor.router_replay.problems(A, rollout, moe, alg.rollout_correction.bypass_mode))
    if actor.router_replay.mode != "disabled" and arr.model.enable_gradient_checkpointing:
        p.append(f"{A}.router_replay.mode={actor.router_replay.mode} with actor_rollout_ref.model.enable_gradient_checkpointing=true is not "
                 f"built (a recomputed router forward would replay another micro-batch's routing); turn one off")
    p.extend(rollout.problems(R, d.max_prompt_length + d.max_response_length, model_cfg, _cuda_visible()))
    p.extend(rollout.batch_invariant_problems(R, actor.megatron, M, arr.hybrid_engine))
    p.extend(d.problems())
    mpath, tpath = arr.model.path, arr.model.tokenizer_path
    p.extend(filter(None, [model_dir_problem("actor_rollout_ref.model.path", mpath)]))
    if tpath and tpath != mpath and not any((Path(tpath) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        p.append(f"actor_rollout_ref.model.tokenizer_path={tpath!r} holds no tokenizer.json/tokenizer_config.json")
    p.extend(cfg.reward.problems(d.max_response_length))
    p.extend(tr.v1.problems(cfg.data, arr.actor, arr.rollout))
    p.extend(cfg.async_training.problems(arr, alg, tr.v1.trainer_mode))
    p.extend(placement_problems(tr.nnodes))
    p.extend(_checkpoint_key_problems(tr))
    p.extend(f"trainer.logger entry {lg!r} is unknown; choose from {list(LOGGER_BACKENDS)}"
             for lg in tr.logger if lg not in LOGGER_BACKENDS)
    return p


def _checkpoint_key_problems(tr) -> list[str]:
    """The checkpoint keys of the ``trainer`` section (whether a resume_from_path directory holds a complete
    checkpoint is the checkpoint manager's check, before Ray starts)."""
    if tr.resume_mode not in RESUME_MODES:
        return [f"trainer.resume_mode={tr.resume_mode!r} is unknown; choose one of {list(RESUME_MODES)}"]
    if tr.resume_mode != "resume_path" and tr.resume_from_path:
        return [f"trainer.resume_from_path is set but trainer.resume_mode={tr.resume_mode!r}; set "
                f"trainer.resume_mode=resume_path to use it"]
    if tr.resume_mode == "resume_path" and not tr.resume_from_path:
        return ["trainer.resume_mode=resume_path needs trainer.resume_from_path=<a global_step_K directory>"]
    if tr.resume_mode == "resume_path" and not Path(tr.resume_from_path).expanduser().is_dir():
        return [f"trainer.resume_from_path={tr.resume_from_path!r} is not a directory; give a global_step_K "
                f"directory written by verl_lite"]
    return []
