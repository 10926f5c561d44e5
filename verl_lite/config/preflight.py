"""Pre-flight checks that read what the config's keys point at (model files, data), before Ray starts; both raise
`ConfigError` (exit 2), every problem naming the key and the fix.

    check_model_files(cfg)   # every engine's model (engine_models): config.json, weights (safetensors headers
                             # only), then every engine's memory estimate against its device (engine/memory.py)
    preflight(cfg, train_dataset, val_dataset, tokenizer)   # after the datasets are built
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_lite.config.loader import ConfigError
from verl_lite.config.validate import _cuda_visible
from verl_lite.engine.model_files import config_int, model_config_problems, model_weight_problems, tokenizer_id_problems

MODEL_KEY = "actor_rollout_ref.model.path"


@dataclass(frozen=True)
class EngineModel:
    """A model one of the run's engines loads: ``key`` (the config key of its path), ``path``, ``head`` (what
    its output layer is: ``model_files.HEADS``) and ``tokenizer`` ((key, path) of the tokenizer whose ids it reads)."""

    key: str
    path: str
    head: str
    tokenizer: tuple[str, str]


def _tokenizer_of(section, path_key: str) -> tuple[str, str]:
    """(key, path) of a model section's tokenizer: its ``tokenizer_path`` when that is another directory."""
    if section.tokenizer_path and section.tokenizer_path != section.path:
        return path_key.rsplit(".", 1)[0] + ".tokenizer_path", section.tokenizer_path
    return path_key, section.path


def engine_models(cfg) -> list[EngineModel]:
    """Every model the run loads: the actor's (the reference and the rollout load the same one), a critic's
    own when the estimator runs a critic (it reads the actor's token ids), and the reward model or
    generative judge when ``reward_model.enable`` (with its own tokenizer)."""
    m, critic, rm = cfg.actor_rollout_ref.model, cfg.critic.model, cfg.reward_model
    actor_tok = _tokenizer_of(m, MODEL_KEY)
    out = [EngineModel(MODEL_KEY, m.path, "lm", actor_tok)]
    if critic.path and critic.path != m.path and "critic" in cfg.algorithm.needs:
        out.append(EngineModel("critic.model.path", critic.path, "value", actor_tok))
    if rm.enable and rm.model.path:
        key = "reward_model.model.path"
        out.append(EngineModel(key, rm.model.path, "lm" if rm.generative else "reward", _tokenizer_of(rm.model, key)))
    return out


def model_file_problems(model: EngineModel) -> list[str]:
    """The model-file rules for one engine's model: config.json first, then the weights against it."""
    return model_config_problems(model.key, model.path) or model_weight_problems(model.key, model.path, model.head)


def check_model_files(cfg) -> None:
    """Raise ConfigError when an engine's model has a broken config.json or weights that are missing or do not
    match it, or when the engines' estimated memory cannot fit the device (``memory_problems``)."""
    problems = [p for model in engine_models(cfg) for p in model_file_problems(model)]
    problems = problems or memory_problems(cfg)
    if problems:
        raise ConfigError(problems)


def preflight(cfg, train_dataset, val_dataset, tokenizer=None) -> None:
    """Checks that need the built datasets (after ``check_model_files``), raised as one ConfigError: every
    tokenizer's ids below the ``vocab_size`` of every model reading them; ``data.train_batch_size`` prompts in the
    train set; the longest prompt kept plus ``data.max_response_length`` within ``max_position_embeddings``."""
    d, m = cfg.data, cfg.actor_rollout_ref.model
    p = tokenizer_problems(cfg, tokenizer)
    n_train = len(train_dataset)
    if isinstance(d.train_batch_size, int) and d.train_batch_size > n_train:
        dropped = getattr(train_dataset, "num_filtered", 0)
        note = f" ({dropped} longer than data.max_prompt_length were dropped)" if dropped else ""
        p.append(
            f"data.train_batch_size={d.train_batch_size} exceeds the {n_train} prompts in data.train_files{note}; "
            f"set data.train_batch_size <= {n_train} or add data"
        )
    limit = config_int(m.path, "max_position_embeddings")
    if limit is not None:
        longest_prompt = max((len(it["prompt_ids"]) for ds in (train_dataset, val_dataset) if ds is not None
                              for it in ds.items),
                             default=0) if hasattr(train_dataset, "items") else d.max_prompt_length
        longest_prompt = min(longest_prompt, d.max_prompt_length)
        if longest_prompt + d.max_response_length > limit:
            p.append(
                f"data.max_response_length={d.max_response_length} + the longest prompt ({longest_prompt} tokens, "
                f"data.max_prompt_length={d.max_prompt_length}) = {longest_prompt + d.max_response_length} exceeds "
                f"the model's max_position_embeddings={limit} ({MODEL_KEY}/config.json); set "
                f"data.max_response_length <= {limit - longest_prompt} or lower data.max_prompt_length"
            )
    if p:
        raise ConfigError(p)


def _load_tokenizer(tok: tuple[str, str]):
    """The tokenizer at ``tok`` = (key, path), or one problem line when it does not load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tok[1])
    except Exception as e:  # noqa: BLE001 - whatever the tokenizer's loader raises, named with the key
        return (f"{tok[0]}={tok[1]!r}: the tokenizer cannot be loaded ({type(e).__name__}: {e}); give a directory "
                f"with tokenizer.json / tokenizer_config.json")


def tokenizer_problems(cfg, policy_tokenizer) -> list[str]:
    """``model_files.tokenizer_id_problems`` for each tokenizer of ``engine_models`` and the models reading its
    ids; ``policy_tokenizer`` (already loaded) is the actor's, any other is loaded here (None: not checked)."""
    readers: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for model in engine_models(cfg):
        readers.setdefault(model.tokenizer, []).append((model.key, model.path))
    policy = _tokenizer_of(cfg.actor_rollout_ref.model, MODEL_KEY)
    out = []
    for tok, models in readers.items():
        loaded = policy_tokenizer if tok == policy else _load_tokenizer(tok)
        out += [loaded] if isinstance(loaded, str) else tokenizer_id_problems(tok, loaded, models)
    return out


# ---------------------------------------------------------------- memory (engine/memory.py's estimate)
R = "actor_rollout_ref.rollout"


@dataclass(frozen=True)
class _Role:
    """An engine as pre-flight sizes it: its ``spec`` (engine/memory.py), its megatron ``section``, LoRA section
    (or None), ``micro`` (``key=value`` of its micro-batch knob) and the process it lives in."""

    spec: object
    section: str
    lora: str | None
    micro: str
    process: str


def _dp(mg, world: int) -> int:
    return max(1, world // (mg.tensor_model_parallel_size * mg.pipeline_model_parallel_size * mg.context_parallel_size))


def _micro_batch(dynamic: bool, micro, budget, cp: int, per_rank: int, longest: int) -> tuple[int, int]:
    """(tokens, sequences) of the largest micro-batch of a DP rank's ``per_rank`` trajectories, each counted at
    the ``longest`` length: a token budget (x CP) with dynamic batching, else ``micro`` sequences."""
    per_rank = max(1, per_rank)
    if dynamic:
        tokens = min(max(budget or longest, longest) * cp, per_rank * longest)
        return tokens, max(1, min(per_rank, tokens // max(1, longest)))
    seqs = min(micro or 1, per_rank)
    return seqs * longest, seqs


def _spec(name: str, model_path: str, mg, world: int, micro: tuple[int, int], longest: int, cuda: bool, *,
          trains: bool, lora=None, value_head: bool = False, rollout_dtype: str | None = None,
          batch_invariant: bool = False):
    from verl_lite.engine.memory import EngineSpec
    from verl_lite.engine.model_files import read_config
    from verl_lite.engine.config import canonical_dtype, lora_projections

    tp, pp, cp = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size, mg.context_parallel_size
    rank = int(lora.rank) if lora is not None and lora.rank else 0
    return EngineSpec(
        name=name, model=read_config(model_path) or {}, dtype=canonical_dtype(mg.dtype), trains=trains, tp=tp, pp=pp,
        vpp=mg.vpp, cp=cp, ep=mg.expert_model_parallel_size,
        dp=_dp(mg, world), sequence_parallel=bool(mg.sequence_parallel),
        distributed_optimizer=bool(mg.use_distributed_optimizer), lora_rank=rank,
        lora_projections=lora_projections(lora.target_modules, lora.exclude_modules) if rank else (),
        micro_batch_tokens=micro[0], micro_batch_sequences=micro[1], longest_sequence=longest,
        flash_attention=cuda and canonical_dtype(mg.dtype) == "bfloat16" and not batch_invariant,
        value_head=value_head, rollout_dtype=rollout_dtype, gloo=not cuda)


def _roles(cfg, cuda: bool) -> list[_Role]:
    """The engines of the run (actor with the reference and the rollout in its process, a critic, the reward
    model or judge, the distillation teacher), each sized at its largest micro-batch."""
    d, arr, c, rm, tr = cfg.data, cfg.actor_rollout_ref, cfg.critic, cfg.reward_model, cfg.trainer
    actor, rollout, mg, n = arr.actor, arr.rollout, arr.actor.megatron, arr.rollout.n
    world, longest = tr.n_gpus_per_node * tr.nnodes, d.max_prompt_length + d.max_response_length
    dp = _dp(mg, world)
    A, M = "actor_rollout_ref.actor", "actor_rollout_ref.actor.megatron"
    lora_on = bool(arr.model.lora.rank)
    dyn_key = f"{A}.ppo_max_token_len_per_gpu={actor.ppo_max_token_len_per_gpu}"
    micro_key = dyn_key if actor.use_dynamic_bsz else \
        f"{A}.ppo_micro_batch_size_per_gpu={actor.ppo_micro_batch_size_per_gpu}"
    micro = _micro_batch(actor.use_dynamic_bsz, actor.ppo_micro_batch_size_per_gpu, actor.ppo_max_token_len_per_gpu,
                         mg.context_parallel_size, actor.ppo_mini_batch_size * n // dp, longest)
    hybrid = getattr(arr, "hybrid_engine", True)
    roles = [_Role(_spec("actor", arr.model.path, mg, world, micro, longest, cuda, trains=True, lora=arr.model.lora,
                         rollout_dtype=rollout.dtype if hybrid and not rollout.batch_invariant else None,
                         batch_invariant=rollout.batch_invariant),
                   M, "actor_rollout_ref.model.lora", micro_key, "actor")]
    if (actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not lora_on:
        ref = arr.ref
        ref_micro = _micro_batch(ref.log_prob_use_dynamic_bsz, ref.log_prob_micro_batch_size_per_gpu,
                                 ref.log_prob_max_token_len_per_gpu, mg.context_parallel_size,
                                 d.train_batch_size * n // dp, longest)
        roles.append(_Role(_spec("reference", arr.model.path, mg, world, ref_micro, longest, cuda, trains=False),
                           M, None, f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="
                                    f"{ref.log_prob_micro_batch_size_per_gpu}", "actor"))
    if "critic" in cfg.algorithm.needs:
        cw = world if c.num_workers is None else c.num_workers
        cmg = c.megatron
        cdp = _dp(cmg, cw)
        cmicro = _micro_batch(c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu, c.ppo_max_token_len_per_gpu,
                              cmg.context_parallel_size, (c.ppo_mini_batch_size or 1) * n // cdp, longest)
        ckey = (f"critic.ppo_max_token_len_per_gpu={c.ppo_max_token_len_per_gpu}" if c.use_dynamic_bsz
                else f"critic.ppo_micro_batch_size_per_gpu={c.ppo_micro_batch_size_per_gpu}")
        roles.append(_Role(_spec("critic", c.model.path, cmg, cw, cmicro, longest, cuda, trains=True,
                                 lora=c.model.lora, value_head=True),
                           "critic.megatron", "critic.model.lora", ckey,
                           "critic" if c.num_workers is None else "critic (own workers)"))
    if rm.enable and rm.model.path and not rm.generative:
        rmicro = _micro_batch(False, rm.micro_batch_size_per_gpu, None, 1, d.train_batch_size * n // dp, longest)
        roles.append(_Role(_spec("reward model", rm.model.path, rm.megatron, world, rmicro, longest, cuda,
                                 trains=False, value_head=True),
                           "reward_model.megatron", None,
                           f"reward_model.micro_batch_size_per_gpu={rm.micro_batch_size_per_gpu}", "reward model"))
    teacher = cfg.distillation.teacher_model
    if cfg.distillation.enabled and teacher.model_path:  # forward only, micro-batched like the reference
        ref, tmg = arr.ref, teacher.megatron
        tmicro = _micro_batch(ref.log_prob_use_dynamic_bsz, ref.log_prob_micro_batch_size_per_gpu,
                              ref.log_prob_max_token_len_per_gpu, tmg.context_parallel_size,
                              d.train_batch_size * n // _dp(tmg, teacher.world(world)), longest)
        tworld = teacher.world(world)
        roles.append(_Role(_spec("teacher", teacher.model_path, tmg, tworld, tmicro, longest, cuda, trains=False),
                           "distillation.teacher_model.megatron", None,
                           f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="
                           f"{ref.log_prob_micro_batch_size_per_gpu}",
                           "teacher (own workers)" if teacher.enable_resource_pool else "teacher"))
    return roles


def _fixes(role: _Role, estimate) -> tuple[str, str]:
    """(the key to name first, what to turn) for the part of ``estimate`` that dominates it."""
    parts, spec, s = estimate.parts, role.spec, role.section
    adapters = sum(parts.get(k, 0) for k in ("LoRA factors", "LoRA activations", "gradients", "optimizer")) \
        if spec.lora_rank else 0
    if adapters * 2 >= estimate.total:
        return (f"{role.lora}.rank={spec.lora_rank}",
                f"lower {role.lora}.rank (the adapters' factors, activations, gradients and Adam state grow with it)")
    largest = estimate.largest()
    if largest == "activations":
        return role.micro, (f"lower {role.micro.split('=')[0]}, or split the sequences / layers over more ranks "
                            f"({s}.context_parallel_size, tensor_model_parallel_size with sequence_parallel)")
    if largest == "rollout weights":
        return f"{R}.dtype={spec.rollout_dtype}", f"use {R}.dtype=bfloat16 (the rollout's copy of the model)"
    tp = spec.tp
    return (f"{s}.tensor_model_parallel_size={tp}",
            f"raise {s}.tensor_model_parallel_size / pipeline_model_parallel_size, set {s}.use_distributed_optimizer="
            f"true, use {s}.dtype=bfloat16" + (f", or train LoRA adapters ({role.lora}.rank > 0)" if role.lora else ""))


def memory_problems(cfg, device=None) -> list[str]:
    """The engines' estimated memory (``verl_lite.engine.memory``) against the device: on GPU each GPU holds
    one actor worker (actor, reference, rollout) and the workers colocated with it (a critic without workers of
    its own, the reward model, the teacher), whose estimates must fit the GPU's memory (a critic or teacher with
    workers of its own: its GPU alone); on CPU every worker process of this machine shares its available RAM.
    One line when they do not fit: the numbers per engine and the knobs of the largest. ``device``: (bytes,
    description), default ``memory.device_memory()``. An engine whose config.json does not read is not estimated."""
    from verl_lite.engine.memory import device_memory, estimate_engine, gib

    cuda = _cuda_visible()
    roles = [r for r in _roles(cfg, cuda) if r.spec.model]
    if not roles:
        return []
    budget, what = device if device is not None else device_memory()
    estimates = [(r, estimate_engine(r.spec)) for r in roles]
    tr = cfg.trainer
    own = {"critic (own workers)": cfg.critic.num_workers,  # roles on workers of their own: their worker counts
           "teacher (own workers)": cfg.distillation.teacher_model.world(0)}
    if cuda:  # the colocated engines share a GPU; each role of its own has GPUs of its own
        groups = [[re for re in estimates if re[0].process not in own]]
        groups += [[re for re in estimates if re[0].process == process] for process in own]
    else:
        groups = [estimates]
    out = []
    for group in filter(None, groups):
        count = {r.process: 1 if cuda else (-(-own[r.process] // max(1, tr.nnodes)) if r.process in own
                                            else tr.n_gpus_per_node) for r, _ in group}
        total = sum(e.total * count[r.process] for r, e in group)
        if total <= budget:
            continue
        role, estimate = max(group, key=lambda re: re[1].total)
        lead, fix = _fixes(role, estimate)
        engines = "; ".join(f"per {process} worker: " +
                            ", ".join(e.describe() for r, e in group if r.process == process) for process in count)
        if cuda:
            where = f"each GPU holds engines needing an estimated {gib(total)} GiB ({engines}), more than {what}"
        else:
            workers = ", ".join(f"{n} {name} worker(s)" for name, n in count.items())
            where = (f"the worker processes on this machine ({workers}) need an estimated {gib(total)} GiB in all "
                     f"({engines}), more than {what}")
            fix += "; or run fewer worker processes on this machine (fewer workers per node, the layout still dividing them)"
        out.append(f"{lead}: {where}; {fix} (how it is estimated: docs/memory.md)")
    return out
