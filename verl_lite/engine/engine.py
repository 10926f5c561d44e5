"""``MegatronEngine``: forward-only inference and one optimizer step over packed sequences.

The engine knows no RL. It packs variable-length sequences (prompt + response) THD per micro-batch
(``packing.py``), runs megatron's pipeline schedules, turns the logits into per-token response outputs
(log-probs, entropy, or values; on request the top-k log-probs and their ids, or the log-probs of K given ids per
token: ``TOKEN_OUTPUTS``) and, for training, hands them to the caller's ``loss_fn``. With
``EngineConfig.batch_invariant_length`` every pass is batch-invariant (``batch_invariant.py``): a token's outputs
are bit for bit the same in any batch, pack or micro-batch, and :meth:`MegatronEngine.next_token_logits` gives
what a generator needs to sample tokens whose log-probs the trainer reproduces exactly.

Loss contract. ``loss_fn(outputs, data) -> (contribution, metrics)`` runs once per micro-batch on every
last-stage rank with full-sequence ``[b, W]`` outputs (under CP autograd flows through the rank's own chunks
only); the gradient is exactly grad L, L = sum of contributions over micro-batches and DP ranks: the engine
returns ``contribution * M * DP`` (``calculate_per_token_loss=False``) or ``(contribution * K, k_local)``
with K = ``global_token_count`` (``True``), and checks the count megatron reduced is K
(docs/parallelism.md, "The loss contract and megatron's two modes (`engine/engine.py`)";
docs/contracts.md, Contracts 1-2).

Precision (``megatron.dtype``): float32, or bfloat16 with megatron's mixed precision (fp32 outputs, loss,
gradient reduction and main parameters); ``load_hf`` writes the HF weights unrounded into the main
parameters, ``export_hf`` streams them (docs/models.md, "Mixed precision (bf16)").
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from verl_lite.compat import cpu_adapter, megatron_internals
from verl_lite.compat.cpu_adapter import suspended
from verl_lite.compat.megatron_internals import main_param_shard_range, plain_rotary
from verl_lite.engine import lora, moe
from verl_lite.engine.attention import PackedCoreAttention
from verl_lite.engine.batch_invariant import BatchInvariantMode
from verl_lite.engine.config import EngineConfig
from verl_lite.engine.hf_bridge import export_hf, load_hf_weights, reader
from verl_lite.engine.lora import adapters_disabled, add_adapters, merge_into
from verl_lite.engine.model import build_model_chunks, transformer_config_from_hf
from verl_lite.engine.packing import (PackedMicroBatch, pack_micro_batch, pack_response, pack_tokens, pad_multiple,
                                      token_positions, unpack_response)
from verl_lite.engine.vocab_parallel import (vocab_parallel_entropy, vocab_parallel_log_probs,
                                             vocab_parallel_log_probs_at, vocab_parallel_topk)
from verl_lite.utils.metric_reduce import combine_all

LM_OUTPUTS = ("log_probs", "entropy")
VALUE_OUTPUTS = ("values",)
# per token: the K largest log-probs and their ids (``topk=K``, forward only), and the log-probs of the K ids in
# ``data[ids_key]`` ([n, W, K], with their gradient); each [n, W, K]; the temperature-scaled logits ([n, W, V]
# with V the padded vocabulary; TP = 1)
TOKEN_OUTPUTS = ("topk_log_probs", "topk_ids", "log_probs_at", "logits")

LossFn = Callable[[dict, dict], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


class NonFiniteStepError(FloatingPointError):
    """An optimizer step whose gradient norm is NaN or inf, raised on every rank alike (megatron reduces the norm
    over all gradient groups). The step has been applied: the weights are not usable afterwards. ``grad_norm`` is
    None when megatron skipped the step; ``loss``: this rank's summed contribution (output owners only)."""

    def __init__(self, optimizer_step: int, grad_norm: float | None, loss: float | None = None):
        super().__init__(optimizer_step, grad_norm, loss)  # args as __init__ takes them: pickles through Ray
        self.optimizer_step, self.grad_norm, self.loss = optimizer_step, grad_norm, loss

    def __str__(self) -> str:
        loss = "" if self.loss is None else f" (loss {self.loss})"
        return f"optimizer step {self.optimizer_step}: the gradient norm is {self.grad_norm}{loss}, not finite"


@dataclass
class SequenceBatch:
    """Sequences of one DP rank: ``input_ids[i]`` = prompt + response tokens (1-D LongTensor),
    ``response_lengths[i]`` = how many trailing tokens are response, ``data`` = per-row tensors
    ``[n, ...]`` handed (row-selected per micro-batch) to the loss function.
    ``response_width`` = W of the ``[n, W]`` outputs (default: the longest response).
    ``routing`` (MoE, an engine built with ``routing_replay``): ``[n, >= max L_i, num_layers, k]`` expert ids
    each token is routed to, position p of sequence i at ``routing[i, p]`` (``moe.UNKNOWN_EXPERT``: not recorded)."""

    input_ids: list[torch.Tensor]
    response_lengths: torch.Tensor
    data: dict[str, torch.Tensor] = field(default_factory=dict)
    response_width: int | None = None
    routing: torch.Tensor | None = None

    def __post_init__(self):
        self.response_lengths = torch.as_tensor(self.response_lengths, dtype=torch.long).reshape(-1)
        n = len(self.input_ids)
        if n == 0:
            raise ValueError("SequenceBatch: no sequences")
        if self.response_lengths.numel() != n:
            raise ValueError(f"SequenceBatch: {n} sequences but {self.response_lengths.numel()} response lengths")
        for k, v in self.data.items():
            if not torch.is_tensor(v) or v.ndim == 0 or v.shape[0] != n:
                raise ValueError(f"SequenceBatch.data[{k!r}] must be a tensor with {n} rows, got {getattr(v, 'shape', v)}")
        if self.routing is not None and (self.routing.ndim != 4 or self.routing.shape[0] != n
                                         or self.routing.shape[1] < max(self.lengths)):
            raise ValueError(f"SequenceBatch.routing must be [{n}, >= {max(self.lengths)}, layers, k], got "
                             f"{tuple(self.routing.shape)}")
        longest = int(self.response_lengths.max())
        if self.response_width is None:
            self.response_width = longest
        elif self.response_width < longest:
            raise ValueError(f"SequenceBatch.response_width={self.response_width} < longest response {longest}")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> list[int]:
        return [int(x.numel()) for x in self.input_ids]

    def rows(self, indices: list[int]) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return {k: v[idx] for k, v in self.data.items()}


@dataclass
class _MicroBatch:
    packed: PackedMicroBatch
    data: dict[str, torch.Tensor]
    indices: list[int]
    routing: moe.RoutingReplay | None = None


def _schedule_shape(s: dict) -> str:
    if s["style"] == "constant":
        shape = f"constant lr {s['max_lr']:g}"
    else:
        shape = f"{s['style']} decay from {s['max_lr']:g} to {s['min_lr']:g} at step {s['decay_steps']}"
    return f"{shape}, warmup {s['warmup_steps']}" if s["warmup_steps"] else shape


def format_lr_schedule(schedule: dict) -> str:
    """One line for :meth:`MegatronEngine.load_scheduler_state`'s result: the schedule a resumed engine uses,
    where it stands, and the checkpoint's own schedule when that one is not used and differs."""
    own = schedule["source"] == "checkpoint"
    whose = "kept from the checkpoint" if own else "this run's"
    text = (f"schedule step {schedule['step']}, lr schedule {_schedule_shape(schedule)} ({whose}), "
            f"next lr {schedule['next_lr']:.6g}")
    saved = schedule.get("saved")
    if not own and saved and None not in saved.values() and _schedule_shape(saved) != _schedule_shape(schedule):
        text += (f"; the checkpoint's was {_schedule_shape(saved)} "
                 f"(optim.use_checkpoint_opt_param_scheduler=true keeps it)")
    return text


def _megatron_attention_backend(name: str):
    """EngineConfig.attention_backend -> megatron's ``AttnBackend`` (read by ``PackedCoreAttention``)."""
    from megatron.core.transformer.enums import AttnBackend

    return AttnBackend[{"sdpa": "unfused"}.get(name, name)]


class MegatronEngine:
    """A megatron-core GPT (or critic) on the current process groups (``init_distributed`` must have run on
    every rank first)."""

    def __init__(self, cfg: EngineConfig):
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("MegatronEngine: call verl_lite.engine.distributed.init_distributed(...) first")
        self.cfg = cfg
        par = cfg.megatron
        groups = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                  ps.get_context_parallel_world_size())
        if groups != (par.tp, par.pp, par.cp):
            raise ValueError(f"EngineConfig.megatron (tp={par.tp}, pp={par.pp}, cp={par.cp}) differs from the "
                             f"initialised groups (tp={groups[0]}, pp={groups[1]}, cp={groups[2]})")
        self.tp, self.pp, self.cp = par.tp, par.pp, par.cp
        self.vpp = par.vpp or 1
        self.dp = ps.get_data_parallel_world_size()  # without CP
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group()
        self.pad_multiple = pad_multiple(self.cp, self.tp, par.sequence_parallel)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

        self.hf_config = AutoConfig.from_pretrained(cfg.model_path)
        self.tf_config = transformer_config_from_hf(
            self.hf_config, par, calculate_per_token_loss=par.calculate_per_token_loss, params_dtype=par.torch_dtype,
            attention_backend=_megatron_attention_backend(cfg.attention_backend), **cfg.model_overrides,
            **({"moe_enable_routing_replay": True} if cfg.routing_replay else {}))
        if cfg.routing_replay and (self.tf_config.num_moe_experts is None or self.tf_config.recompute_granularity):
            raise ValueError("routing_replay needs an MoE model without activation recompute (a recomputed router "
                             "forward would replay another micro-batch's routing)")
        # shared prompts packed once (packing.py) where attention and RoPE can read it; not MoE, whose router
        # statistics count every token of every sequence
        self.share_prompts = (self.cp == 1 and self.tf_config.num_moe_experts is None and plain_rotary(self.tf_config)
                              and not cfg.batch_invariant_length)
        self.chunks = build_model_chunks(self.hf_config, self.tf_config, value_head=cfg.value_head)
        for module in (m for chunk in self.chunks for m in chunk.modules() if isinstance(m, PackedCoreAttention)):
            module.invariant_length = cfg.batch_invariant_length
        megatron_internals.reduce_replicated_experts(self.chunks, self.tf_config)
        if cfg.forward_only:  # nothing trains: megatron's frozen-weight linears (the same kernels as a LoRA base)
            for chunk in self.chunks:
                chunk.requires_grad_(False)
        if cfg.lora is not None:  # freeze the base, attach the adapters (engine/lora.py)
            add_adapters(self.chunks, self.hf_config, cfg.lora, cfg.seed)
        load_hf_weights(self.chunks, cfg.model_path, self.hf_config)
        self._adapter_source = self._initial_adapter_state()
        self.output_names = VALUE_OUTPUTS if cfg.value_head else LM_OUTPUTS + TOKEN_OUTPUTS
        self.default_outputs = VALUE_OUTPUTS if cfg.value_head else LM_OUTPUTS
        self._reduced_token_count: int | None = None

        self.mixed_precision = cfg.megatron.torch_dtype != torch.float32
        self.model = list(self.chunks)  # what the schedules run: Float16Module-wrapped in bf16, then DDP when training
        if self.mixed_precision:
            from megatron.core.transformer.module import Float16Module

            self.model = [Float16Module(self.tf_config, chunk) for chunk in self.chunks]
        self.optimizer = None
        self.scheduler = None
        self.optimizer_steps = 0  # optimizer steps this engine took (the schedule counts the caller's steps)
        if not cfg.forward_only:
            self._wrap_ddp()
            self._build_optimizer()
            self._after_new_weights(False, partial(load_hf_weights, self.chunks, cfg.model_path, self.hf_config))
        if self._adapter_source is not None:
            self.load_adapter(self._adapter_source, reset_optimizer=False)

    # ------------------------------------------------------------------ set-up
    # -- fp32 main parameters of a bf16 engine (megatron's mixed-precision optimizer holds them) --
    def _copy_into_main(self, param, full: torch.Tensor) -> None:
        """Write ``full`` (this rank's TP shard of ``param``, unrounded) into its fp32 main copy; with the
        distributed optimizer only this DP rank's slice of it. A frozen parameter (a LoRA base) has none."""
        main = getattr(param, "main_param", None)
        if not param.requires_grad or (main is None and getattr(param, "main_param_sharded", False)):
            return
        if main is None:
            raise RuntimeError("a bf16 parameter without an fp32 main copy: the optimizer is not mixed-precision")
        if getattr(param, "main_param_sharded", False):
            start, end = main_param_shard_range(self.optimizer, param)
            full = full.reshape(-1)[start:end]
        main.copy_(full.to(main.dtype))

    def _full_main_param(self, param) -> torch.Tensor:
        """The fp32 main copy of ``param`` as a full tensor of this rank's (TP) shape. With the
        distributed optimizer the DP x CP ranks each hold a slice: summed over that group
        (collective: every rank of the group calls it for the same parameters in the same order)."""
        main = getattr(param, "main_param", None)
        if not getattr(param, "main_param_sharded", False):
            return main.detach() if main is not None else param.detach().float()
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        if main is not None:
            start, end = main_param_shard_range(self.optimizer, param)
            full[start:end] = main.detach().view(-1)
        dist.all_reduce(full, group=ps.get_data_parallel_group(with_context_parallel=True))
        return full.view(param.shape)

    def _wrap_ddp(self):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, average_in_collective=False,
            use_distributed_optimizer=self.cfg.megatron.use_distributed_optimizer)
        self.model = [DistributedDataParallel(self.tf_config, ddp_config, chunk, disable_bucketing=(i > 0))
                      for i, chunk in enumerate(self.model)]
        self.tf_config.finalize_model_grads_func = self._finalize_model_grads

    def _finalize_model_grads(self, model, num_tokens, pg_collection=None, force_all_reduce=False):
        """megatron's finalize_model_grads, also recording the token count it reduced (per-token mode)."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        self._reduced_token_count = None if num_tokens is None else int(num_tokens)

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.cfg.optim
        dtype = self.cfg.megatron.torch_dtype
        opt_config = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
            adam_beta2=o.betas[1], adam_eps=self.cfg.adam_eps, clip_grad=o.clip_grad,
            use_distributed_optimizer=self.cfg.megatron.use_distributed_optimizer,
            params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
        self.optimizer = get_megatron_optimizer(opt_config, self.model)
        megatron_internals.use_fused_adam(self.optimizer)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.lr_warmup_steps > 0 else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps, lr_decay_steps=max(self.cfg.total_steps, o.lr_warmup_steps + 1),
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=1,
            wd_incr_style="constant",
            # verl's semantics: the checkpoint's schedule is kept only when asked; otherwise a loaded
            # checkpoint restores the step count and this config's schedule continues from it
            use_checkpoint_opt_param_scheduler=o.use_checkpoint_opt_param_scheduler,
            override_opt_param_scheduler=not o.use_checkpoint_opt_param_scheduler)

    def _after_new_weights(self, reset_optimizer: bool, load_main) -> None:
        """After the model's weights were overwritten: fresh Adam state and schedule when ``reset_optimizer``;
        a trainable bf16 engine also writes them into its main parameters (``load_main(copy_fn)``)."""
        if self.optimizer is None:
            return
        if reset_optimizer:
            for m in self.model:
                m.zero_grad_buffer()
            self._build_optimizer()
        if self.mixed_precision:
            with torch.no_grad():
                load_main(self._copy_into_main)

    def load_scheduler_state(self, state: dict) -> dict:
        """Load a saved ``scheduler.state_dict()``: the step count always, the shape as ``OptimConfig`` says.
        Returns :meth:`lr_schedule` with ``"saved"``: the checkpoint's shape."""
        self.scheduler.load_state_dict(state)
        saved = {"style": state.get("lr_decay_style"), "warmup_steps": state.get("lr_warmup_steps"),
                 "decay_steps": state.get("lr_decay_steps"), "max_lr": state.get("max_lr"),
                 "min_lr": state.get("min_lr")}
        return {**self.lr_schedule(), "saved": saved}

    def advance_lr_schedule(self) -> None:
        """One step of the LR schedule; the caller says when a schedule step ends (``OptimConfig``)."""
        self.scheduler.step(1)

    def lr_schedule(self) -> dict:
        """The LR schedule in use: ``style``, ``warmup_steps``, ``decay_steps`` (the step at which it reaches
        ``min_lr``), ``max_lr``, ``min_lr``, ``step`` (schedule steps taken), ``next_lr`` (the lr the next
        :meth:`train_step` uses) and ``source``."""
        s = self.scheduler
        next_lr = float(s.get_lr({}))
        return {"style": s.lr_decay_style, "warmup_steps": int(s.lr_warmup_steps), "decay_steps": int(s.lr_decay_steps),
                "max_lr": float(s.max_lr), "min_lr": float(s.min_lr), "step": int(s.num_steps), "next_lr": next_lr,
                "source": "checkpoint" if self.cfg.optim.use_checkpoint_opt_param_scheduler else "config"}

    # ------------------------------------------------------------------ properties
    @property
    def is_output_owner(self) -> bool:
        """Last pipeline stage, TP rank 0 and CP rank 0: where results and loss metrics are returned."""
        from megatron.core import parallel_state as ps

        return self._is_last_stage and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0

    @property
    def _is_last_stage(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage(ignore_virtual=True)

    # ------------------------------------------------------------------ batches
    def _check_micro_batches(self, batch: SequenceBatch, micro_batches: list[list[int]]) -> None:
        if not micro_batches:
            raise ValueError("micro_batches is empty: give at least one micro-batch of row indices")
        seen: list[int] = []
        for k, mb in enumerate(micro_batches):
            if len(mb) == 0:
                raise ValueError(f"micro-batch {k} is empty; every micro-batch needs at least one sequence (plan fewer "
                                 f"micro-batches, e.g. a smaller vpp multiple or a larger micro-batch size)")
            seen.extend(int(i) for i in mb)
        if sorted(seen) != list(range(len(batch))):
            raise ValueError(
                f"micro_batches must use every row 0..{len(batch) - 1} of the batch exactly once, got {micro_batches}")
        if self.vpp > 1 and (len(micro_batches) % self.pp or len(micro_batches) < self.pp):
            raise ValueError(
                f"virtual pipeline parallelism (pp={self.pp}, vpp={self.vpp}) needs the number of micro-batches "
                f"to be a positive multiple of pp={self.pp}, got {len(micro_batches)}; plan them with "
                f"plan_micro_batches(..., vpp_multiple={self.pp})")

    def _prepare(self, batch: SequenceBatch, micro_batches, outputs, temperature: float, topk: int | None = None,
                 ids_key: str | None = None, record_routing: bool = False):
        """The checked output names and the packed micro-batches of one :meth:`infer` / :meth:`train_step`."""
        outputs = tuple(outputs)
        if not outputs or any(o not in self.output_names for o in outputs):
            raise ValueError(f"outputs={outputs}: this model produces {self.output_names}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if {"topk_log_probs", "topk_ids"} & set(outputs) and not (isinstance(topk, int) and topk >= 1):
            raise ValueError(f"outputs={outputs} need topk=K >= 1, got {topk!r}")
        if "log_probs_at" in outputs:
            ids = batch.data.get(ids_key) if ids_key else None
            if ids is None or ids.ndim != 3 or ids.shape[1] != batch.response_width:
                raise ValueError(f"output 'log_probs_at' needs ids_key naming [n, {batch.response_width}, K] token ids "
                                 f"in the batch's data, got ids_key={ids_key!r} ({getattr(ids, 'shape', None)})")
        self._check_micro_batches(batch, micro_batches)
        return outputs, self._pack(batch, micro_batches, record_routing)

    def _pack(self, batch: SequenceBatch, micro_batches: list[list[int]],
              record_routing: bool = False) -> list[_MicroBatch]:
        if batch.routing is not None and not self.cfg.routing_replay:
            raise ValueError("SequenceBatch.routing given to an engine built without routing_replay")
        if record_routing and (batch.routing is not None or self.tf_config.num_moe_experts is None):
            raise ValueError("record_routing needs an MoE model and a batch without routing to replay")
        with suspended():  # CPU-side index work only
            mbs = [_MicroBatch(packed=pack_micro_batch([batch.input_ids[i] for i in mb],
                                                       [int(batch.response_lengths[i]) for i in mb],
                                                       multiple=self.pad_multiple, cp_size=self.cp,
                                                       cp_rank=self.cp_rank, share_prompts=self.share_prompts),
                               data=batch.rows(mb), indices=list(mb))
                   for mb in micro_batches]
            if batch.routing is not None or record_routing:
                layers, k = int(self.tf_config.num_layers), int(self.tf_config.moe_router_topk)
                for m in mbs:
                    experts = None if record_routing else self._packed_routing(batch.routing[m.indices], m.packed)
                    m.routing = moe.RoutingReplay(experts, moe.sequence_ids(m.packed).to(self.device), len(m.indices),
                                                  bool(self.tf_config.sequence_parallel), layers, k)
            return mbs

    def _packed_routing(self, routing: torch.Tensor, packed: PackedMicroBatch) -> torch.Tensor:
        """A micro-batch's routing to replay on the local pack (``packing.pack_tokens``), on the device; every
        recorded id checked against the experts here, once."""
        experts = pack_tokens(routing, packed, moe.UNKNOWN_EXPERT)
        recorded = experts[experts != moe.UNKNOWN_EXPERT]
        if recorded.numel() and int(recorded.max()) >= self.tf_config.num_moe_experts:
            raise ValueError(f"replayed routing names expert {int(recorded.max())} of a model with "
                             f"{self.tf_config.num_moe_experts} experts per layer")
        return experts.to(self.device)

    def _replica_groups(self) -> tuple:
        """The groups of this rank's model replica (TP, CP, PP), in that order on every rank."""
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group(), self.cp_group, ps.get_pipeline_model_parallel_group()

    def _run_schedule(self, mbs: list[_MicroBatch], step_func, **kwargs):
        """megatron's pipeline schedule over the micro-batches; ``step_func(mb, output)`` makes each one's loss."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        with cpu_adapter.in_this_thread(), (BatchInvariantMode() if self.cfg.batch_invariant_length
                                            else contextlib.nullcontext()):
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, step_func), model=self.model,
                data_iterator=[iter(mbs) for _ in range(self.vpp)] if self.vpp > 1 else iter(mbs),
                num_microbatches=len(mbs), seq_length=max(m.packed.num_local_tokens for m in mbs), micro_batch_size=1,
                **kwargs)

    def _packed_seq_params(self, packed: PackedMicroBatch):
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = packed.cu_seqlens.to(self.device)
        if packed.shared is not None:  # read by the attention and RoPE (engine/packing.py)
            cu.shared_prompts = packed.shared.to(self.device)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=packed.max_seqlen,
                               max_seqlen_kv=packed.max_seqlen)

    # ------------------------------------------------------------------ outputs
    def _per_token_outputs(self, output: torch.Tensor, mb: _MicroBatch, names: tuple[str, ...], temperature: float,
                           width: int, topk: int | None = None, ids_key: str | None = None,
                           topk_below: int | None = None) -> dict[str, torch.Tensor]:
        """Last-stage model output on the local pack -> {name: [b, W] (or [b, W, K])} full rows (CP-gathered)."""
        per_token: dict[str, torch.Tensor] = {}
        tokens = mb.packed.num_local_tokens
        if self.cfg.value_head:
            per_token["values"] = output.reshape(-1).float()
        else:
            logits = output if temperature == 1.0 else output / temperature
            vocab = self.hf_config.vocab_size
            if "log_probs" in names:
                labels = mb.packed.labels.to(logits.device)
                per_token["log_probs"] = vocab_parallel_log_probs(logits, labels, vocab_size=vocab).reshape(-1)
            if "entropy" in names:
                per_token["entropy"] = vocab_parallel_entropy(logits, vocab_size=vocab).reshape(-1)
            if "topk_log_probs" in names or "topk_ids" in names:
                values, ids = vocab_parallel_topk(logits.reshape(tokens, -1), topk, vocab_size=vocab,
                                                  candidates=topk_below)
                per_token["topk_log_probs"], per_token["topk_ids"] = values, ids
            if "log_probs_at" in names:
                ids = pack_response(mb.data[ids_key], mb.packed, width).to(logits.device)
                per_token["log_probs_at"] = vocab_parallel_log_probs_at(logits.reshape(tokens, -1), ids,
                                                                        vocab_size=vocab)
            if "logits" in names:
                if self.tp > 1:
                    raise ValueError("output 'logits' needs TP = 1 (each TP rank holds a slice of the vocabulary)")
                per_token["logits"] = logits.reshape(tokens, -1)
        return {k: unpack_response(v, mb.packed, width, self.cp_group) for k, v in per_token.items() if k in names}

    def _plain_torch(self):
        """Where the forward and the loss run: without torch-function modes (the forward needs no CUDA->CPU
        rewriting, see cpu_adapter), except a batch-invariant engine's, whose mode must see every call."""
        return contextlib.nullcontext() if self.cfg.batch_invariant_length else suspended()

    def _forward_step(self, step_func, data_iterator, model):
        mb: _MicroBatch = next(data_iterator)
        router_step = getattr(self, "_router_step", None)
        if router_step is not None:  # MoE router losses (moe.py)
            router_step.micro_batch(mb.packed)
        ids = mb.packed.input_ids.to(self.device)
        with self._plain_torch(), moe.replaying(mb.routing):
            output = model(ids, None, None, packed_seq_params=self._packed_seq_params(mb.packed))
        return output, partial(step_func, mb)

    # ------------------------------------------------------------------ infer
    @torch.no_grad()
    def infer(self, batch: SequenceBatch, micro_batches: list[list[int]], temperature: float = 1.0,
              outputs=LM_OUTPUTS, topk: int | None = None, ids_key: str | None = None,
              topk_below: int | None = None, record_routing: bool = False) -> dict[str, torch.Tensor] | None:
        """Forward only. Returns {name: [n, W] (``TOKEN_OUTPUTS``: [n, W, K])} in batch row order on output owners,
        None elsewhere. ``topk_below``: the top k only among the ids below it (the softmax is the whole vocabulary's).
        With ``batch.routing`` also ``routing_mismatched`` / ``routing_compared`` [n, num_layers]: per sequence and
        layer, the recorded tokens whose router would have chosen other experts, of those compared
        (``moe.RoutingReplay``); with ``record_routing`` (MoE) ``routed_experts`` [n, max L_i, num_layers, k] uint8:
        the experts each token was routed to (``SequenceBatch.routing``'s form, for a later pass to replay)."""
        names, mbs = self._prepare(batch, micro_batches, outputs if not self.cfg.value_head else VALUE_OUTPUTS,
                                   temperature, topk, ids_key, record_routing)

        def collect(mb, output, non_loss_data=True):
            res = self._per_token_outputs(output, mb, names, temperature, batch.response_width, topk, ids_key,
                                          topk_below)
            return {k: v.detach().cpu() for k, v in res.items()}

        for m in self.model:
            m.eval()
        store = self._run_schedule(mbs, collect, forward_only=True, collect_non_loss_data=True)
        routing = self._routing_counts(mbs) if batch.routing is not None else {}
        if record_routing:
            routing = {"routed_experts": self._recorded_routing(mbs, max(batch.lengths))}
        if not self.is_output_owner:
            return None
        order = torch.as_tensor([i for m in mbs for i in m.indices])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        out = {name: torch.cat([d[name] for d in store])[inverse] for name in names}
        return out | {name: counts[inverse] for name, counts in routing.items()}

    @torch.no_grad()
    def next_token_logits(self, sequences: list[list[int]], temperature: float,
                          max_tokens: int | None = None) -> torch.Tensor:
        """The temperature-scaled logits (the output's dtype, [n, padded vocabulary]) each sequence's last position gives
        for its next token (TP = 1), in micro-batches of at most ``max_tokens`` tokens (a longer sequence alone;
        None: one; the output layer's logits of a micro-batch are [tokens, vocabulary]). Batch-invariant engines give
        bit for bit the logits of that position in any longer sequence's forward, so :meth:`token_log_probs` of
        them is the log-prob :meth:`infer` reports for the token drawn there."""
        placeholder = [torch.tensor([*seq, 0], dtype=torch.long) for seq in sequences]  # its logits are not read
        batch = SequenceBatch(placeholder, torch.ones(len(sequences), dtype=torch.long))
        micro_batches = self.token_budget_micro_batches(batch.lengths, max_tokens)
        return self.infer(batch, micro_batches, temperature, outputs=("logits",))["logits"][:, 0]

    def token_budget_micro_batches(self, lengths: list[int], max_tokens: int | None) -> list[list[int]]:
        """Consecutive rows in micro-batches of at most ``max_tokens`` tokens (None: one micro-batch; a longer row
        alone), a row counted at the batch-invariant attention's fixed length where that is longer (its scores)."""
        micro_batches: list[list[int]] = [[]]
        used = 0
        for i, length in enumerate(lengths):
            cost = max(length, self.cfg.batch_invariant_length)
            if micro_batches[-1] and max_tokens is not None and used + cost > max_tokens:
                micro_batches.append([])
                used = 0
            micro_batches[-1].append(i)
            used += cost
        return micro_batches

    def token_log_probs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """log softmax(logits)[tokens] per row ([n, V], [n] -> [n], on the CPU): :meth:`infer`'s ``log_probs``
        arithmetic, on the engine's device as there."""
        with BatchInvariantMode() if self.cfg.batch_invariant_length else contextlib.nullcontext():
            return vocab_parallel_log_probs(logits.to(self.device), tokens.to(self.device),
                                            vocab_size=self.hf_config.vocab_size).cpu()

    def _recorded_routing(self, mbs: list[_MicroBatch], width: int) -> torch.Tensor:
        """The routing the micro-batches' routers chose, per sequence in micro-batch order [n, width, layers, k]
        (collective over TP, CP and PP)."""
        groups = self._replica_groups()
        return torch.cat([m.routing.reduced_routing(token_positions(m.packed), width, groups) for m in mbs])

    def _routing_counts(self, mbs: list[_MicroBatch], whole_mini_batch: bool = False) -> dict[str, torch.Tensor]:
        """The micro-batches' routing mismatch counts per sequence, in micro-batch order, summed over TP, CP and PP
        (collective over this model replica's ranks); ``whole_mini_batch``: summed over the sequences and DP too."""
        from megatron.core import parallel_state as ps

        groups = self._replica_groups()
        if whole_mini_batch:
            totals = sum(torch.stack([m.routing.mismatched.sum(0), m.routing.compared.sum(0)]) for m in mbs)
            totals = moe.summed_over(totals, (*groups, ps.get_data_parallel_group())).cpu()
            return {"routing_mismatched": totals[0], "routing_compared": totals[1]}
        counts = [m.routing.reduced_counts(groups) for m in mbs]
        return {"routing_mismatched": torch.cat([c[0] for c in counts]),
                "routing_compared": torch.cat([c[1] for c in counts])}

    # ------------------------------------------------------------------ train
    def train_step(self, batch: SequenceBatch, micro_batches: list[list[int]], loss_fn: LossFn,
                   temperature: float = 1.0, outputs=None, global_token_count: int | None = None,
                   ids_key: str | None = None) -> dict[str, float]:
        """One optimizer step over this DP rank's share of a mini-batch (the module docstring's loss contract).

        ``global_token_count`` (per-token mode and MoE router losses): the sum of sequence lengths over the WHOLE
        mini-batch, all DP ranks; may be omitted when DP = 1. Returns {"grad_norm" (before clipping), "lr", and on
        output owners "loss" plus the micro-batches' summed loss metrics}; raises :class:`NonFiniteStepError`."""
        if self.optimizer is None:
            raise RuntimeError("train_step on a forward_only engine; build it with forward_only=False")
        names, mbs = self._prepare(batch, micro_batches, outputs if outputs is not None else self.default_outputs,
                                   temperature, ids_key=ids_key)
        per_token = self.cfg.megatron.calculate_per_token_loss
        if per_token or moe.router_losses_enabled(self.tf_config):
            global_token_count = self._global_token_count(global_token_count, sum(batch.lengths))
        n_mb = len(mbs)
        owner = self.is_output_owner

        def loss_func(mb, output):
            with self._plain_torch():  # outputs + the caller's loss: plain tensor math on the output's device
                outs = self._per_token_outputs(output, mb, names, temperature, batch.response_width, ids_key=ids_key)
                data = {k: v.to(self.device) for k, v in mb.data.items()}
                contribution, metrics = loss_fn(outs, data)
                if contribution.ndim != 0:
                    raise ValueError(f"loss_fn must return a scalar contribution, got shape "
                                     f"{tuple(contribution.shape)}")
                report = {}
                if owner:
                    report = {"loss": float(contribution.detach())}
                    report.update({k: float(torch.as_tensor(v).detach()) for k, v in metrics.items()})
                if per_token:
                    k_local = torch.tensor(mb.packed.num_real_local_tokens, dtype=torch.int, device=contribution.device)
                    return contribution * global_token_count, k_local, report
                return contribution * (n_mb * self.dp), report

        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._reduced_token_count = None
        with moe.train_step_router_losses(self, global_token_count) as self._router_step:
            store = self._run_schedule(mbs, loss_func, forward_only=False)
        router_step, self._router_step = self._router_step, None
        if per_token and self._reduced_token_count != global_token_count:
            raise RuntimeError(
                f"megatron reduced {self._reduced_token_count} tokens over DP x CP but global_token_count="
                f"{global_token_count}: the caller's count is not the sum of sequence lengths over the whole "
                f"mini-batch (or DP ranks were given different counts); the optimizer step was not taken")
        lr = self.scheduler.get_lr({})
        success, grad_norm, _ = self.optimizer.step()
        self.optimizer_steps += 1
        self._check_finite_step(success, grad_norm, store if owner and self._is_last_stage else None)
        result = {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "lr": float(lr)}
        if router_step is not None:  # every rank: each MoE stage adds its layers
            result.update(router_step.metrics(int(self.tf_config.num_layers), self.tf_config.router_loss))
        if batch.routing is not None:  # every rank: the mini-batch's replayed routing against the routers' own
            counts = self._routing_counts(mbs, whole_mini_batch=True)
            result.update(moe.mismatch_shares(counts["routing_mismatched"], counts["routing_compared"]))
        if owner and self._is_last_stage:
            result.update(combine_all(store))  # the micro-batches' loss metrics (utils/metric_reduce.py)
        return result

    def _global_token_count(self, given: int | None, local_tokens: int) -> int:
        """``train_step``'s ``global_token_count``, or this rank's own count when DP = 1."""
        if given is None:
            if self.dp != 1:
                raise ValueError(
                    "calculate_per_token_loss=True or MoE router losses (moe_aux_loss_coeff / moe_z_loss_coeff > 0) "
                    "with data parallelism need train_step(..., global_token_count=<sum of sequence lengths over "
                    "the whole mini-batch, all DP ranks>)")
            return local_tokens
        if int(given) < local_tokens:
            raise ValueError(f"global_token_count={given} is smaller than this rank's own {local_tokens} tokens; "
                             f"it must be the sum of lengths over the whole mini-batch")
        return int(given)

    def _check_finite_step(self, success: bool, grad_norm, reports: list[dict] | None) -> None:
        """Raise :class:`NonFiniteStepError` when the step's gradient norm is NaN / inf or megatron skipped
        the step. ``reports``: the micro-batches' loss reports on an output owner, else None."""
        if success and grad_norm is not None and math.isfinite(float(grad_norm)):
            return
        loss = None if reports is None else sum(float(d.get("loss", 0.0)) for d in reports)
        raise NonFiniteStepError(self.optimizer_steps, None if grad_norm is None else float(grad_norm), loss)

    # ------------------------------------------------------------------ weights
    def export_hf(self, attr: str = "param"):
        """Iterator of (hf_name, full tensor) on every rank (a trainable bf16 engine's fp32 main parameters);
        ``attr="main_grad"``: the reduced float32 grads (with the distributed optimizer valid on each rank's shard)."""
        main = self._full_main_param if (attr == "param" and self.mixed_precision and self.optimizer) else None
        return export_hf(self.chunks, self.hf_config, attr=attr, main_params=main)

    def load_hf(self, state_dict_or_dir, reset_optimizer: bool = True) -> None:
        """Overwrite the weights (an HF state dict or directory); rebuild optimizer + schedule state."""
        with torch.no_grad():
            load_hf_weights(self.chunks, state_dict_or_dir, self.hf_config)
        self._after_new_weights(reset_optimizer, partial(load_hf_weights, self.chunks, state_dict_or_dir,
                                                         self.hf_config))

    # ------------------------------------------------------------------ LoRA adapters
    def _initial_adapter_state(self) -> dict | None:
        """The adapters' starting factors (PEFT-named, full): ``lora.adapter_path``'s, or the fresh draw."""
        if self.cfg.lora is None:
            return None
        if self.cfg.lora.adapter_path:
            config, tensors = lora.read_peft_adapter(self.cfg.lora.adapter_path)
            lora.check_adapter_matches(self.cfg.lora, config, self.cfg.lora.adapter_path)
            return tensors
        return None if self.cfg.forward_only else {}

    def load_adapter(self, state_or_dir, reset_optimizer: bool = True) -> None:
        """Overwrite the LoRA factors from PEFT-named full tensors or a PEFT adapter directory; an empty dict
        keeps the current factors. ``reset_optimizer``: fresh Adam state."""
        if self.cfg.lora is None:
            raise RuntimeError("load_adapter on an engine without LoRA (EngineConfig.lora is None)")
        state = state_or_dir if isinstance(state_or_dir, dict) else lora.read_peft_adapter(state_or_dir)[1]
        if not state:
            return
        lora.load_adapter_state(self.chunks, state)
        self._after_new_weights(reset_optimizer, partial(lora.load_adapter_state, self.chunks, state))

    def export_adapter(self, attr: str = "param") -> dict:
        """The LoRA factors as full PEFT-named float32 tensors on every rank (``attr="main_grad"``: their
        reduced gradients; with the distributed optimizer only valid on each rank's shard). Collective."""
        if self.cfg.lora is None:
            raise RuntimeError("export_adapter on an engine without LoRA (EngineConfig.lora is None)")
        if attr == "param" and self.mixed_precision and self.optimizer is not None:
            return lora.export_adapter_state(self.chunks, read=self._full_main_param)
        return lora.export_adapter_state(self.chunks, read=reader(attr))

    def export_merged_hf(self):
        """Iterator of (hf_name, full tensor) of the model with the adapters merged (W + scaling B A):
        what a rollout engine or an HF export receives. Without LoRA: :meth:`export_hf`. Collective."""
        if self.cfg.lora is None:
            return self.export_hf()
        return merge_into(self.export_hf(), self.export_adapter(), self.cfg.lora.scaling)

    def adapters_disabled(self):
        """Context manager: inside, the engine computes its base model (LoRA's KL reference); a no-op without LoRA."""
        return adapters_disabled(self.chunks) if self.cfg.lora is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory) -> None:
        """Model + optimizer + LR schedule into ``directory`` (megatron dist_checkpointing; collective)."""
        from verl_lite.engine.checkpoint import save_engine_state  # megatron's dist_checkpointing: on the first save

        save_engine_state(self, directory)

    def load_checkpoint(self, directory) -> dict:
        """Load a :meth:`save_checkpoint` directory, resharding into this engine's layout (collective).
        Returns the saver's description; raises ``CheckpointLayoutError`` for an unsupported change."""
        from verl_lite.engine.checkpoint import load_engine_state  # megatron's dist_checkpointing: on the first load

        return load_engine_state(self, directory)
