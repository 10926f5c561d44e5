"""The PPO-family loop on a single controller (verl's step order).

    trainer = PPOTrainer(cfg)            # validates the config; nothing started yet
    history = trainer.fit()              # starts Ray + workers, trains, validates, tears down

One RL step:
    1. generate      n responses per prompt (uid per prompt), split over the workers
    2. reward        score every response; the score sits at its last valid token
    3. old log-probs the engine recomputes them (+ entropy); rollout-vs-engine diff is logged
    4. ref log-probs when the KL loss or the in-reward KL needs them
    5. KL in reward  (optional) token_level_rewards = scores - beta * KL
    6. advantages    on the driver (algorithms.compute_advantage)
    7. actor update  for each of ppo_epochs, for each mini-batch: the driver builds the
                     NormalizationPlan from the WHOLE mini-batch, plans micro-batches per DP
                     rank, and the workers take one optimizer step
    8. weight sync   actor -> rollout, in process
    9. metrics, validation every test_freq

No formula lives here: the math is in ``verl_lite.algorithms``, the data movement in
``verl_lite.controller``. GRPO, GSPO, ... differ only by config.
"""

from __future__ import annotations

import os
import random
from typing import Any, Callable, Iterator

import ray
import torch

from verl_lite.algorithms import ActorLossConfig, NormalizationPlan, apply_kl_penalty, compute_advantage, get_kl_controller
from verl_lite.controller import (
    WorkerGroup,
    collect_from_owners,
    make_layouts,
    per_rank_args,
    shard_by_plan,
    start_ray,
    stop_ray,
)
from verl_lite.protocol import Batch
from verl_lite.reward import RewardError, RewardManager
from verl_lite.trainer import metrics as M
from verl_lite.workers import ActorRolloutRefWorker, WorkerConfig

ROLLOUT_COLUMNS = ["prompt_ids", "responses", "response_mask"]


def _split_contiguous(n: int, parts: int) -> list[range]:
    """``n`` items into ``parts`` contiguous near-equal ranges (the first ones one longer)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


class PPOTrainer:
    """The RL loop.

    ``reward_fn`` (optional) replaces the configured reward function with user code, in verl's
    signature: ``reward_fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``
    (``reward.reward_manager=naive``) or the batched ``reward_fn(data_sources, solution_strs,
    ground_truths, extra_infos) -> list`` (``reward_manager=batch``).
    """

    def __init__(self, cfg, reward_fn: Callable | None = None, world_size: int | None = None,
                 worker_timeout_s: float | None = None):
        from transformers import AutoTokenizer

        from verl_lite.config import validate_config

        self.cfg = cfg
        self.layout = validate_config(cfg, world_size=world_size)  # before anything starts
        self.world_size = self.layout.world_size
        arr = cfg.actor_rollout_ref
        self.tokenizer = AutoTokenizer.from_pretrained(arr.model.tokenizer_path or arr.model.path)
        self.reward_manager = RewardManager(cfg.reward, self.tokenizer, compute_score=reward_fn)
        self.train_dataset, self.val_dataset = self._make_datasets()
        self.worker_timeout_s = worker_timeout_s or cfg.trainer.worker_timeout_s
        self.need_ref = arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.kl_ctrl = get_kl_controller(**vars(cfg.algorithm.kl_ctrl)) if cfg.algorithm.use_kl_in_reward else None
        self.loss_cfg = ActorLossConfig(
            clip_ratio=arr.actor.clip_ratio,
            clip_ratio_low=arr.actor.clip_ratio_low,
            clip_ratio_high=arr.actor.clip_ratio_high,
            clip_ratio_c=arr.actor.clip_ratio_c,
            policy_loss=arr.actor.policy_loss.loss_mode,
            loss_agg_mode=arr.actor.loss_agg_mode,
            entropy_coeff=arr.actor.entropy_coeff,
            use_kl_loss=arr.actor.use_kl_loss,
            kl_loss_coef=arr.actor.kl_loss_coef,
            kl_loss_type=arr.actor.kl_loss_type,
        )
        self.group: WorkerGroup | None = None
        self.layouts = None
        self._owns_ray = False
        self.global_step = 0
        self.update_history: list[list[dict]] = []  # per RL step: the per-optimizer-step results

    # ================================================================ set-up / teardown
    def _make_datasets(self):
        from verl_lite.data import RLDataset

        d = self.cfg.data
        kw = dict(tokenizer=self.tokenizer, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                  filter_overlong_prompts=d.filter_overlong_prompts, truncation=d.truncation)
        return RLDataset(d.train_files, **kw), RLDataset(d.val_files, **kw)

    def _worker_config(self) -> WorkerConfig:
        arr = self.cfg.actor_rollout_ref
        mg, opt = arr.actor.megatron, arr.actor.optim
        return WorkerConfig(
            model_path=arr.model.path,
            tokenizer_path=arr.model.tokenizer_path or arr.model.path,
            tp=mg.tensor_model_parallel_size,
            pp=mg.pipeline_model_parallel_size,
            vpp=mg.virtual_pipeline_model_parallel_size,
            cp=mg.context_parallel_size,
            sequence_parallel=mg.sequence_parallel,
            timeout_s=mg.timeout_s,
            optim=dict(lr=opt.lr, weight_decay=opt.weight_decay, clip_grad=opt.clip_grad, betas=tuple(opt.betas),
                       lr_warmup_steps=opt.lr_warmup_steps, lr_decay_style=opt.lr_decay_style, min_lr=opt.min_lr,
                       total_steps=max(1, self.total_optimizer_steps())),
            calculate_per_token_loss=mg.calculate_per_token_loss,
            use_distributed_optimizer=mg.use_distributed_optimizer,
            need_ref=self.need_ref,
            rollout_name=arr.rollout.name,
            seed=self.cfg.trainer.seed,
        )

    def start(self) -> None:
        """Start (or join) Ray, create the workers, build engines and rollouts (both load ``model.path``)."""
        if self.group is not None:
            return
        self._owns_ray = start_ray(num_cpus=os.cpu_count() or 1)
        try:
            self.group = WorkerGroup(ActorRolloutRefWorker, self.world_size,
                                     init_kwargs={"cfg": self._worker_config()}, timeout_s=self.worker_timeout_s)
            self.group.call_all("init_model")
            self.layouts = make_layouts(self.group.call_all("layout"))
            self.dp = self.layouts[0].dp_size
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill the workers and stop Ray if this trainer started it (idempotent)."""
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        if self._owns_ray:
            stop_ray()
            self._owns_ray = False

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    # ================================================================ sizes
    def steps_per_epoch(self) -> int:
        return len(self.train_dataset) // self.cfg.data.train_batch_size

    def total_steps(self) -> int:
        t = self.cfg.trainer
        return t.total_training_steps if t.total_training_steps is not None else t.total_epochs * self.steps_per_epoch()

    def total_optimizer_steps(self) -> int:
        return self.total_steps() * self.layout.optimizer_steps_per_rl_step

    # ================================================================ data
    def _train_batches(self) -> Iterator[list[dict]]:
        """Prompt batches (lists of dataset rows) forever, one epoch after another."""
        from verl_lite.data import iterate_batches

        d = self.cfg.data
        epoch = 0
        while True:
            yield from iterate_batches(self.train_dataset, d.train_batch_size, d.shuffle, d.seed, epoch)
            epoch += 1

    # ================================================================ stages
    def generate(self, rows: list[dict], n: int, sampling: dict, seed: int | None) -> Batch:
        """n responses per prompt, prompts split over all workers (each process holds a full rollout
        model). With a seed, prompt p is sampled with its own seed ``seed + p``, so the rollouts do
        not depend on the layout. Trajectory p * n + k is sample k of prompt p."""
        prompts = [list(r["prompt_ids"]) for r in rows]
        ranges = _split_contiguous(len(prompts), self.world_size)
        args = [([prompts[i] for i in rg], None if seed is None else [seed + i for i in rg], dict(sampling, n=n))
                for rg in ranges]
        per_rank = self.group.call_per_rank("generate", args)
        outs = [o for rank_out in per_rank for o in rank_out]
        width = max(len(o["response_ids"]) for o in outs)
        N = len(outs)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        responses = torch.full((N, width), pad, dtype=torch.long)
        mask = torch.zeros((N, width), dtype=torch.float32)
        rollout_lp = torch.zeros((N, width), dtype=torch.float32)
        for i, o in enumerate(outs):
            k = len(o["response_ids"])
            responses[i, :k] = torch.as_tensor(o["response_ids"], dtype=torch.long)
            mask[i, :k] = 1.0
            rollout_lp[i, :k] = o["log_probs"].float()

        def repeat(values):
            return [v for v in values for _ in range(n)]

        return Batch.from_dict(
            {"responses": responses, "response_mask": mask, "rollout_log_probs": rollout_lp},
            {
                "prompt_ids": repeat(prompts),
                "uid": repeat([f"{self.global_step}-{p}" for p in range(len(rows))]),
                "data_source": repeat([r["data_source"] for r in rows]),
                "ground_truth": repeat([r["ground_truth"] for r in rows]),
                "extra_info": repeat([r.get("extra_info") for r in rows]),
            },
        )

    def score(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """Scores [n] of the responses (the reward manager decodes them and names the function and
        the sample in any RewardError: a raise, a non-number, NaN/inf, or a wrong count)."""
        lengths = batch["response_mask"].sum(-1).long().tolist()
        responses = [batch["responses"][i, :k].tolist() for i, k in enumerate(lengths)]
        scores, extra = self.reward_manager(responses, batch["data_source"], batch["ground_truth"],
                                            batch["extra_info"])
        if scores.numel() != len(batch):  # the manager checks this too; never train on misaligned rewards
            raise RewardError(f"reward returned {scores.numel()} scores for {len(batch)} responses")
        return scores.float(), extra

    def _lengths(self, batch: Batch) -> list[int]:
        resp = batch["response_mask"].sum(-1).long().tolist()
        return [len(p) + r for p, r in zip(batch["prompt_ids"], resp)]

    def _infer(self, method: str, batch: Batch, sizes) -> dict:
        """Run a forward-only engine method over the batch, split by DP rank; outputs in row order.

        ``sizes`` is the config section holding ``log_prob_micro_batch_size_per_gpu`` (falls back to
        the actor's micro-batch size), ``log_prob_use_dynamic_bsz`` and ``log_prob_max_token_len_per_gpu``."""
        micro_batch_size = (sizes.log_prob_micro_batch_size_per_gpu
                            or self.cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu)
        use_dynamic, max_tokens = sizes.log_prob_use_dynamic_bsz, sizes.log_prob_max_token_len_per_gpu
        shards = shard_by_plan(
            batch.columns(ROLLOUT_COLUMNS), self._lengths(batch), self.dp,
            micro_batch_size=None if use_dynamic else micro_batch_size,
            max_tokens_per_micro_batch=max_tokens * self._cp() if use_dynamic else None,
            vpp_multiple=self._vpp_multiple(),
        )
        # one object-store copy per DP piece, shared by its TP/PP/CP peers
        args = [(ray.put(p), m, self.cfg.actor_rollout_ref.rollout.temperature)
                for p, m in zip(shards.pieces, shards.micro_batches)]
        results = self.group.call_per_rank(method, per_rank_args(args, self.layouts))
        return shards.gather(collect_from_owners(results, self.layouts))

    def _cp(self) -> int:
        return self.cfg.actor_rollout_ref.actor.megatron.context_parallel_size

    def _vpp_multiple(self) -> int:
        mg = self.cfg.actor_rollout_ref.actor.megatron
        return mg.pipeline_model_parallel_size if mg.virtual_pipeline_model_parallel_size else 1

    def compute_old_log_probs(self, batch: Batch) -> dict:
        return self._infer("compute_log_prob", batch, self.cfg.actor_rollout_ref.rollout)

    def compute_ref_log_probs(self, batch: Batch) -> dict:
        return self._infer("compute_ref_log_prob", batch, self.cfg.actor_rollout_ref.ref)

    def mini_batches(self, num_trajectories: int, epoch: int) -> list[list[int]]:
        """Trajectory indices of each mini-batch of one epoch (whole prompt groups unless shuffled)."""
        a = self.cfg.actor_rollout_ref.actor
        size = a.ppo_mini_batch_size * self.cfg.actor_rollout_ref.rollout.n
        order = list(range(num_trajectories))
        if a.shuffle:
            random.Random(self.cfg.trainer.seed * 7919 + self.global_step * 104729 + epoch).shuffle(order)
        return [order[k:k + size] for k in range(0, num_trajectories, size)]

    def update_actor(self, batch: Batch) -> list[dict]:
        """ppo_epochs x mini-batches optimizer steps; returns per-step merged results."""
        a = self.cfg.actor_rollout_ref.actor
        horizon = a.loss_scale_factor if a.loss_scale_factor is not None else self.cfg.data.max_response_length
        keys = ROLLOUT_COLUMNS + ["old_log_probs", "advantages"] + (["ref_log_probs"] if a.use_kl_loss else [])
        jobs_per_dp: list[list[dict]] = [[] for _ in range(self.dp)]
        for epoch in range(a.ppo_epochs):
            for k, rows in enumerate(self.mini_batches(len(batch), epoch)):
                mini = batch.select(rows).columns(keys)
                if not bool((mini["response_mask"] != 0).any()):
                    raise ValueError(
                        f"mini-batch {k} of epoch {epoch} at step {self.global_step} has no valid response token "
                        f"(N = 0): the loss is undefined; check the rollout (max_response_length) and the data"
                    )
                plan = NormalizationPlan.from_mask(mini["response_mask"], a.loss_agg_mode, horizon=horizon)
                lengths = self._lengths(mini)
                shards = shard_by_plan(
                    mini, lengths, self.dp,
                    micro_batch_size=None if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu,
                    max_tokens_per_micro_batch=a.ppo_max_token_len_per_gpu * self._cp() if a.use_dynamic_bsz else None,
                    vpp_multiple=self._vpp_multiple(),
                )
                for d in range(self.dp):
                    jobs_per_dp[d].append({"piece": shards.pieces[d], "micro_batches": shards.micro_batches[d],
                                           "plan": plan, "global_token_count": sum(lengths)})
        temperature = self.cfg.actor_rollout_ref.rollout.temperature
        results = self.group.call_per_rank(
            "update_actor",
            per_rank_args([(ray.put(jobs), self.loss_cfg, temperature) for jobs in jobs_per_dp], self.layouts),
        )
        owners = collect_from_owners(results, self.layouts)  # [dp][step] -> dict
        merged = []
        for s in range(len(owners[0])):
            per_dp = [owners[d][s] for d in range(self.dp)]
            loss_metrics = M.sum_dicts([{k: v for k, v in r.items() if k not in ("grad_norm", "lr")} for r in per_dp])
            merged.append({**loss_metrics, "grad_norm": per_dp[0]["grad_norm"], "lr": per_dp[0]["lr"]})
        return merged

    def sync_weights(self) -> None:
        self.group.call_all("sync_rollout_weights")

    # ================================================================ one step
    def step(self, rows: list[dict]) -> dict[str, Any]:
        """One RL step on a batch of prompt rows; returns its metrics."""
        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        m: dict[str, Any] = {"step": self.global_step + 1}
        with M.timer(m, "step"):
            with M.timer(m, "generate"):
                r = arr.rollout
                sampling = dict(do_sample=True, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_new_tokens=cfg.data.max_response_length)
                seed = (cfg.trainer.seed * 1_000_003 + self.global_step * 10_007) % (2**31 - 2**20)
                batch = self.generate(rows, r.n, sampling, seed)
            mask = batch["response_mask"]
            with M.timer(m, "reward"):
                scores, _ = self.score(batch)
                last = (mask.sum(-1).long() - 1).clamp(min=0)
                token_scores = torch.zeros_like(mask)
                token_scores[torch.arange(len(batch)), last] = scores
            with M.timer(m, "old_log_prob"):
                old = self.compute_old_log_probs(batch)
                batch.set("old_log_probs", old["log_probs"]).set("entropy", old["entropy"])
                m["rollout/logprob_diff_mean"], m["rollout/logprob_diff_max"] = M.masked_abs_diff(
                    batch["rollout_log_probs"], old["log_probs"], mask)
            if self.need_ref:
                with M.timer(m, "ref_log_prob"):
                    batch.set("ref_log_probs", self.compute_ref_log_probs(batch)["ref_log_probs"])
            if cfg.algorithm.use_kl_in_reward:
                token_rewards, kl_metrics = apply_kl_penalty(token_scores, batch["old_log_probs"],
                                                            batch["ref_log_probs"], mask, self.kl_ctrl,
                                                            cfg.algorithm.kl_penalty)
                m.update({f"reward_kl/{k}": v for k, v in kl_metrics.items()})
            else:
                token_rewards = token_scores
            with M.timer(m, "advantage"):
                advantages, returns = compute_advantage(
                    cfg.algorithm.adv_estimator, token_rewards, mask, index=batch["uid"],
                    gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                    norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
                )
                batch.set("advantages", advantages).set("returns", returns)
            with M.timer(m, "update_actor"):
                updates = self.update_actor(batch)
            with M.timer(m, "sync_weights"):
                self.sync_weights()
        self.global_step += 1
        self.update_history.append(updates)
        m.update(M.stats("reward", scores))
        m["response_length/mean"] = float(mask.sum(-1).mean())
        m["advantages/mean"] = M.masked_mean(advantages, mask)
        # loss terms: mean over this step's optimizer steps of each mini-batch's summed contribution
        m.update({f"actor/{'entropy_term' if k == 'entropy' else k}": v for k, v in M.mean_dicts(updates).items()})
        m["actor/entropy"] = M.masked_mean(batch["entropy"], mask)  # token mean over the rollouts
        m["actor/num_updates"] = len(updates)
        return m

    # ================================================================ validation
    def validate(self) -> dict[str, float]:
        """Held-out prompts, decoded per ``rollout.val_kwargs`` (greedy by default): mean score and accuracy."""
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        rows = [self.val_dataset[i] for i in range(len(self.val_dataset))]
        size = self.cfg.data.val_batch_size or len(rows)
        sampling = dict(do_sample=vk.do_sample, temperature=vk.temperature, top_p=vk.top_p, top_k=vk.top_k,
                        max_new_tokens=self.cfg.data.max_response_length)
        all_scores, all_correct = [], []
        for k in range(0, len(rows), size):
            seed = (self.cfg.trainer.seed + 12345 + k) if vk.do_sample else None
            batch = self.generate(rows[k:k + size], vk.n, sampling, seed)
            scores, extra = self.score(batch)
            all_scores.append(scores)
            all_correct.append(self.correct(scores, extra))
        scores, correct = torch.cat(all_scores), torch.cat(all_correct)
        return {"val/reward_mean": float(scores.mean()), "val/accuracy": float(correct.float().mean())}

    @staticmethod
    def correct(scores: torch.Tensor, extra: dict) -> torch.Tensor:
        """Per-sample correctness: the reward's own ``acc`` field when it returns one, else the full score 1.0
        (so shaped rewards with partial credit do not count as correct)."""
        if extra.get("acc") is not None and all(a is not None for a in extra["acc"]):
            return torch.as_tensor([bool(a) for a in extra["acc"]])
        return scores >= 1.0

    # ================================================================ the loop
    def fit(self, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Train for ``total_steps()`` steps (validation per ``test_freq``); returns every step's metrics.

        Starts the workers if needed and always tears them down at the end (also on error).
        """
        t = self.cfg.trainer
        history: list[dict] = []
        try:
            self.start()
            if t.val_before_train:
                with M.timer(record := {"step": 0}, "validate"):
                    record.update(self.validate())
                history.append(record)
                if on_step:
                    on_step(record)
            batches = self._train_batches()
            for _ in range(self.total_steps()):
                record = self.step(next(batches))
                last = self.global_step == self.total_steps()
                if t.test_freq > 0 and (self.global_step % t.test_freq == 0 or last):
                    with M.timer(record, "validate"):
                        record.update(self.validate())
                history.append(record)
                if on_step:
                    on_step(record)
        finally:
            self.close()
        return history
