"""The structured config schema: the sections composed under verl's key names.

Each package owns its sections (fields, defaults, choices and ``problems``) next to the code they configure; only
the trainer's section and the actor/ref/critic composition live here. Hydra composes the schema from its
ConfigStore entry `ppo_trainer`; docs/config.md is generated from it (`python scripts/config_docs.py`).
`None` for `actor_rollout_ref.model.path`, `data.train_files` or `data.val_files` means the built-in default (the
shipped tiny model and the synthetic addition task), which `load_config` fills in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from verl_lite.algorithms.aggregation import AGG_MODES
from verl_lite.algorithms.config import AlgorithmConfig, DistillationLossConfig
from verl_lite.algorithms.distillation import uses_topk
from verl_lite.algorithms.objective import ActorLossConfig
from verl_lite.controller.config import AsyncTrainingConfig, V1Config
from verl_lite.data.config import DataConfig
from verl_lite.engine.config import LoraConfig, MegatronConfig, OptimConfig
from verl_lite.reward.config import RewardConfig, RewardModelConfig
from verl_lite.rollout.config import RolloutConfig

LOGGER_BACKENDS = ("console", "jsonl", "tensorboard", "wandb")  # trainer.logger's names (trainer.tracking)
ACTOR_KEY, ROLLOUT_KEY = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


@dataclass
class ModelConfig:
    path: Optional[str] = None  # HF model dir (config.json, safetensors, tokenizer) or HF hub id (fetched into the HF cache); None = shipped tiny model
    tokenizer_path: Optional[str] = None  # None = same as path
    enable_gradient_checkpointing: bool = False  # megatron activation recompute (full, uniform, 1 layer); GPU only
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA on the actor (the KL reference = its adapters off)


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


@dataclass
class RouterReplayConfig:
    """verl's ``actor.router_replay``: MoE routing replay (docs/algorithms.md "Routing replay")."""

    mode: str = "disabled"  # disabled | R2: the update replays the old-log-prob pass's own routing | R3: both forwards replay the rollout's

    def problems(self, A: str, rollout, moe: bool, bypass_mode: bool) -> list[str]:
        """The mode's rules with the ``rollout`` section; ``moe``: the actor's model has experts; ``bypass_mode``:
        ``algorithm.rollout_correction.bypass_mode``."""
        K, R = f"{A}.router_replay.mode", "actor_rollout_ref.rollout"
        if self.mode not in ROUTER_REPLAY_MODES:
            return [f"{K}={self.mode!r} is unknown; choose one of {list(ROUTER_REPLAY_MODES)}"]
        if self.mode != "R3" and rollout.enable_rollout_routing_replay:
            return [f"{R}.enable_rollout_routing_replay=true records the rollout's routing, which only {K}=R3 "
                    f"replays; set both or neither"]
        if self.mode == "disabled":
            return []
        out = [] if moe else [f"{K}={self.mode}: actor_rollout_ref.model.path is no mixture-of-experts model the "
                              f"engine builds (config.json model_type qwen3_moe / qwen2_moe); routing replay is for "
                              f"MoE models"]
        if self.mode == "R2":
            if bypass_mode:
                out.append(f"{K}=R2 replays the old-log-prob pass's routing, and algorithm.rollout_correction."
                           f"bypass_mode=true runs none (the old log-probs are the rollout's); use R3 or drop bypass")
            return out
        if not rollout.enable_rollout_routing_replay:
            out.append(f"{K}=R3 replays the rollout's routing: set {R}.enable_rollout_routing_replay=true (verl's rule)")
        if rollout.name != "hf":
            out.append(f"{K}=R3 with {R}.name={rollout.name}: only the hf rollout records routing here (vLLM 0.32's "
                       f"enable_return_routed_experts needs its model runner V2, which needs Triton; not wired); "
                       f"use name=hf")
        return out


@dataclass
class ActorConfig(ActorLossConfig):
    """The actor: its batch sizes, optimizer and layout; the loss keys are algorithms' ``ActorLossConfig``."""

    ppo_mini_batch_size: int = 16  # prompts per optimizer step (x rollout.n trajectories)
    ppo_micro_batch_size_per_gpu: Optional[int] = 128  # trajectories per micro-batch on one DP rank
    use_dynamic_bsz: bool = False  # cut micro-batches by token budget instead
    ppo_max_token_len_per_gpu: int = 16384  # token budget per micro-batch (x CP) with use_dynamic_bsz
    ppo_epochs: int = 1  # passes over the step's trajectories
    shuffle: bool = False  # reshuffle trajectories between mini-batches each epoch
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)


@dataclass
class RefConfig:
    """The frozen reference policy; it uses the actor's megatron layout."""

    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # None = actor.ppo_micro_batch_size_per_gpu
    log_prob_use_dynamic_bsz: Optional[bool] = None  # None = actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # None = actor.ppo_max_token_len_per_gpu


@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # HF dir of the value model; None = the actor's model.path (fresh value head)
    tokenizer_path: Optional[str] = None  # must tokenize like the actor's; None = model.path
    enable_gradient_checkpointing: bool = False  # megatron activation recompute for the critic; GPU only
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA on the critic's body (its value head trains whole)


@dataclass
class CriticConfig:
    """The value model (a critic role on its own workers/layout); used by critic estimators (gae)."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: Optional[int] = None  # prompts per critic optimizer step; None = the actor's
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # None = the actor's
    forward_micro_batch_size_per_gpu: Optional[int] = None  # value pass; None = ppo_micro_batch_size_per_gpu
    use_dynamic_bsz: Optional[bool] = None  # cut critic micro-batches by token budget; None = the actor's
    ppo_max_token_len_per_gpu: int = 32768  # critic token budget per micro-batch (x CP) with use_dynamic_bsz
    forward_max_token_len_per_gpu: Optional[int] = None  # None = ppo_max_token_len_per_gpu
    ppo_epochs: Optional[int] = None  # None = the actor's
    shuffle: Optional[bool] = None  # reshuffle trajectories between critic mini-batches; None = the actor's
    cliprange_value: float = 0.5  # values stay within old_values +- this in the clipped loss
    loss_agg_mode: Optional[str] = None  # None = the actor's loss_agg_mode
    num_workers: Optional[int] = None  # None = colocated on the actor's workers; N = N workers of its own (one node: trainer.nnodes=1)
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)

    def problems(self) -> list[str]:
        """The critic's loss aggregation (null is the actor's, filled in when the config loads) and optimizer."""
        mode = [] if self.loss_agg_mode in AGG_MODES else [
            f"critic.loss_agg_mode={self.loss_agg_mode!r} is unknown; choose one of {list(AGG_MODES)}"]
        return mode + self.optim.problems("critic.optim")


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True  # true: rollout on the actor's workers (colocated); false: rollout workers of their own (docs/async.md)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class TrainerConfig:
    total_epochs: int = 1  # passes over the train split (sets the step count when total_training_steps is null)
    total_training_steps: Optional[int] = None  # None = total_epochs x steps per epoch (built-in task: 60)
    n_gpus_per_node: int = 1  # workers per node (on CPU: worker processes)
    nnodes: int = 1  # nodes; workers = n_gpus_per_node x nnodes; > 1 joins the cluster at RAY_ADDRESS (a local Ray is one node)
    test_freq: int = 10  # validate every this many steps (<= 0: never during training)
    critic_warmup: int = 0  # RL steps that update only the critic before the actor starts
    save_freq: int = -1  # > 0: checkpoint every save_freq steps and at the end; <= 0: never
    val_before_train: bool = True  # validate once before the first step (step 0 of metrics.jsonl)
    output_dir: str = "outputs/verl_lite"  # runs write <output_dir>/<experiment_name>-<UTC time>/
    project_name: str = "verl_lite"  # logger project (wandb/tensorboard) and checkpoint path part
    experiment_name: Optional[str] = None  # run name (run directory, loggers, checkpoints); None = <estimator>_<train file>_<model>
    seed: int = 0  # seed of sampling, engine initialization and the driver's RNG
    logger: List[str] = field(default_factory=lambda: ["console", "jsonl"])  # console | jsonl | tensorboard | wandb; the run dir's metrics.jsonl is written either way
    log_freq: int = 1  # without a TTY the console prints one line every log_freq steps
    log_val_generations: int = 0  # > 0: the first N validation samples (prompt, response, score) -> <run dir>/val_generations.jsonl
    default_local_dir: Optional[str] = None  # checkpoint root; None = <cwd>/checkpoints/<project_name>/<experiment_name> (absolute, set when the config loads)
    resume_mode: str = "auto"  # auto (latest complete checkpoint) | disable | resume_path
    resume_from_path: Optional[str] = None  # a global_step_K directory, with resume_mode=resume_path
    resume_ignore_fingerprint: bool = False  # true: resume even from a checkpoint of another model, train data or math keys (trainer/fingerprint.py)
    max_actor_ckpt_to_keep: Optional[int] = None  # newest global_step_* checkpoints kept; None = all
    worker_timeout_s: float = 1800.0  # the driver waits this long for any worker call, then tears the group down
    use_v1: bool = True  # verl's v1 trainer (true) or its legacy one (false): one trainer here, the same run either way
    v1: V1Config = field(default_factory=V1Config)  # verl's v1 trainer modes and sampler (controller/config.py)


@dataclass
class DistillationTeacherModelConfig:
    """verl's ``distillation.teacher_model``: the frozen teacher, an engine role (processes and a layout of its own,
    as the reward model) colocated on the actor's workers, or with ``enable_resource_pool`` on workers of its own
    (verl's keys; verl serves the teacher with vLLM there, here it is the engine)."""

    model_path: Optional[str] = None  # HF dir of the teacher; its tokenizer must equal the student's (required when enabled)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # the teacher's layout over its workers
    enable_resource_pool: bool = False  # true: the teacher on n_gpus_per_node x nnodes workers of its own; false: on the actor's
    n_gpus_per_node: int = 0  # with enable_resource_pool: the teacher's workers (per node)
    nnodes: int = 0  # with enable_resource_pool: 1 (a teacher pool across nodes is not built)

    def world(self, actor_world: int) -> int:
        """The teacher's workers: its own pool's, or the actor's."""
        return self.n_gpus_per_node * self.nnodes if self.enable_resource_pool else actor_world

    def pool_problems(self, trainer_nnodes: int) -> list[str]:
        """verl's rule for a pool of its own (both sizes >= 1), and the single-node limit of this placement."""
        if not self.enable_resource_pool:
            return []
        key = "distillation.teacher_model"
        out = [f"{key}.{name}={getattr(self, name)} must be >= 1 with {key}.enable_resource_pool=true"
               for name in ("n_gpus_per_node", "nnodes") if not getattr(self, name) >= 1]
        if self.nnodes > 1 or trainer_nnodes > 1:
            out.append(f"{key}.enable_resource_pool=true with {key}.nnodes={self.nnodes} and trainer.nnodes="
                       f"{trainer_nnodes}: a teacher pool of its own is built on one node only (the pool's workers "
                       f"follow the actor's on it); set both to 1, or colocate the teacher (enable_resource_pool=false)")
        return out


@dataclass
class DistillationConfig:
    """verl's ``distillation`` section: on-policy distillation from a frozen teacher (docs/algorithms.md
    "Distillation"; the losses: algorithms/distillation.py)."""

    enabled: bool = False  # score every sampled token with the teacher and add the distillation term to the actor's loss
    teacher_model: DistillationTeacherModelConfig = field(default_factory=DistillationTeacherModelConfig)
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)

    def problems(self, world: int, cuda: bool, student_model: str | None, student_tokenizer: str | None,
                 nnodes: int = 1) -> list[str]:
        """When enabled: the loss's rules, a teacher model directory whose tokenizer equals the student's
        (``student_tokenizer``: its path), a top k both vocabularies hold (``student_model``: the student's
        directory), its pool (``nnodes``: the trainer's), and the teacher's layout over its workers (colocated:
        the actor's ``world``)."""
        from verl_lite.engine.config import transformer_override_problems
        from verl_lite.engine.model_files import model_dir_problem, read_config
        from verl_lite.workers.teacher import TEACHER_KEY, teacher_problems  # lazy on purpose: workers load megatron

        if not self.enabled:
            return []
        p = self.distillation_loss.problems()
        path = self.teacher_model.model_path
        if not path:
            return p + [f"distillation.enabled=true needs {TEACHER_KEY}: an HF causal-LM directory sharing the "
                        f"student's tokenizer"]
        missing = model_dir_problem(TEACHER_KEY, path, "(no default: give the teacher)")
        if missing:
            return p + [missing]
        p += teacher_problems(path, student_tokenizer)
        p += self.topk_problems(path, student_model)
        pool = self.teacher_model.pool_problems(nnodes)
        if pool:
            return p + pool
        mg = self.teacher_model.megatron
        workers = ("the teacher's {world} workers (its own pool: n_gpus_per_node x nnodes)"
                   if self.teacher_model.enable_resource_pool else "the teacher's {world} workers (colocated: the actor's)")
        p.extend(mg.problems("distillation.teacher_model.megatron", self.teacher_model.world(world), workers,
                             read_config(path)))
        p.extend(transformer_override_problems("distillation.teacher_model.megatron.override_transformer_config",
                                               mg.override_transformer_config, dtype=mg.dtype, cuda=cuda))
        return p


    def topk_problems(self, teacher_model: str, student_model: str | None) -> list[str]:
        """forward_kl_topk: ``topk`` no larger than the ids both models score (the smaller vocabulary)."""
        from verl_lite.engine.model_files import read_config
        from verl_lite.workers.teacher import STUDENT_KEY, TEACHER_KEY

        loss = self.distillation_loss
        if not uses_topk(loss.loss_mode) or not isinstance(loss.topk, int):
            return []
        sizes = {key: (read_config(path) or {}).get("vocab_size") for key, path in
                 ((TEACHER_KEY, teacher_model), (STUDENT_KEY, student_model)) if path}
        sizes = {key: size for key, size in sizes.items() if isinstance(size, int)}
        if sizes and loss.topk > min(sizes.values()):
            shown = ", ".join(f"{key}'s vocab_size={size}" for key, size in sizes.items())
            return [f"distillation.distillation_loss.topk={loss.topk} is larger than the ids the teacher may choose "
                    f"({shown}); set topk <= {min(sizes.values())}"]
        return []


@dataclass
class PPOConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)

    def micro_batch_problems(self, critic: bool) -> list[str]:
        """How each role cuts a DP rank's share for memory (it never changes the math, but must be well defined): a
        token budget (x CP) that holds the longest sequence, or a micro-batch size >= 1."""
        arr, c, p = self.actor_rollout_ref, self.critic, []
        actor, mg = arr.actor, arr.actor.megatron
        longest = self.data.max_prompt_length + self.data.max_response_length
        roles = [(ACTOR_KEY, actor, "use_dynamic_bsz", "ppo", mg),
                 ("actor_rollout_ref.ref", arr.ref, "log_prob_use_dynamic_bsz",
                 "log_prob", mg), (ROLLOUT_KEY, arr.rollout, "log_prob_use_dynamic_bsz", "log_prob", mg)]
        roles += [("critic", c, "use_dynamic_bsz", stem, c.megatron) for stem in ("ppo", "forward")] if critic else []
        for key, section, dynamic, stem, megatron in roles:
            micro_key, budget_key = f"{stem}_micro_batch_size_per_gpu", f"{stem}_max_token_len_per_gpu"
            micro, budget, cp = getattr(section, micro_key), getattr(section, budget_key), megatron.context_parallel_size
            cp = cp if isinstance(cp, int) and cp >= 1 else 1
            if getattr(section, dynamic):
                if budget * cp < longest:
                    p.append(f"{key}.{budget_key}={budget} (x cp={cp}) is below the longest sequence data.max_prompt_length"
                             f" + data.max_response_length = {longest}; raise it to at least {-(-longest // cp)}")
            elif micro is not None and micro < 1:
                p.append(f"{key}.{micro_key}={micro} must be >= 1"
                         + ("" if key == ACTOR_KEY else " (or null to use the actor's)"))
            elif micro is None and key == ACTOR_KEY:  # the others' null is the actor's (inherited when the config loads)
                p.append(f"{ACTOR_KEY}: set ppo_micro_batch_size_per_gpu (trajectories per micro-batch) or "
                         f"use_dynamic_bsz=true")
        return p

