"""A per-device memory estimate of one engine, from the model's config.json and the run's layout, before
anything is built (arithmetic on the config; only ``device_memory`` asks torch or psutil). What is counted, the
formula and its calibration: docs/memory.md, "The formula (per device, one rank of the layout)", "Calibration".

    estimate = estimate_engine(EngineSpec(name="actor", model=config_json_dict, dtype="bfloat16", tp=2, ...))
    device_memory()                         # (bytes, what): a GPU's total memory, or the available RAM
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}
FP32 = 4
ADAM_MOMENTS_FP32 = 2  # exp_avg, exp_avg_sq (fp32)
LOGIT_COPIES = 3  # fp32 logits, their log-softmax, and the gradient
# LoRA's HF projection -> (in features, out features) as functions of (h, q, kv, ffn): q = heads x head_dim,
# kv = kv heads x head_dim
_PROJECTION_SHAPES = {
    "q_proj": lambda h, q, kv, f: (h, q), "k_proj": lambda h, q, kv, f: (h, kv),
    "v_proj": lambda h, q, kv, f: (h, kv), "o_proj": lambda h, q, kv, f: (q, h),
    "gate_proj": lambda h, q, kv, f: (h, f), "up_proj": lambda h, q, kv, f: (h, f),
    "down_proj": lambda h, q, kv, f: (f, h),
}
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # the output is split over TP
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class EngineSpec:
    """One engine as the run would build it."""

    name: str
    model: dict  # its config.json
    dtype: str = "float32"
    trains: bool = True  # False: a forward-only engine (reference, reward model)
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    lora_rank: int = 0
    lora_projections: tuple[str, ...] = ()
    micro_batch_tokens: int = 0  # one micro-batch on one DP rank, before the CP split
    micro_batch_sequences: int = 1
    longest_sequence: int = 0
    flash_attention: bool = False  # the attention kernel keeps no [L, L] score matrix
    value_head: bool = False
    rollout_dtype: str | None = None  # an HF rollout's full model copy in the same process (None: no copy)
    gloo: bool = False  # CPU collectives: gloo's reduce-scatter works on a full copy of its input


@dataclass
class Estimate:
    """Bytes per part of one engine on one device; ``total`` their sum."""

    name: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def largest(self) -> str:
        return max(self.parts, key=self.parts.get)

    def describe(self) -> str:
        """``actor 12.3 GiB (parameters 1.0, gradients 2.0, ...)``, parts under 0.05 GiB left out."""
        shown = ", ".join(f"{k} {gib(v)}" for k, v in self.parts.items() if v >= 0.05 * GIB)
        return f"{self.name} {gib(self.total)} GiB" + (f" ({shown})" if shown else "")


def gib(n: float) -> str:
    return f"{n / GIB:.1f}" if n >= 0.05 * GIB else f"{n / GIB:.2f}"


def _int(model: dict, name: str, default: int = 0) -> int:
    v = model.get(name)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else default


@dataclass(frozen=True)
class _Dims:
    h: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # a dense layer's intermediate size
    vocab: int
    experts: int  # routed experts per layer (0: dense)
    expert_ffn: int
    top_k: int
    shared_ffn: int
    tied: bool
    qkv_bias: bool = False  # Qwen2 (or attention_bias)
    qk_norm: bool = False  # Qwen3's per-head q/k norms

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim


def model_dims(model: dict) -> _Dims:
    """The sizes the estimate needs, from an HF config.json (Qwen2/Qwen3/Llama and their MoE variants)."""
    h, heads = _int(model, "hidden_size", 1), _int(model, "num_attention_heads", 1)
    experts = _int(model, "num_experts") or _int(model, "num_local_experts")
    qwen2_moe = model.get("model_type") == "qwen2_moe"
    return _Dims(h=h, layers=_int(model, "num_hidden_layers", 1), heads=heads,
                 kv_heads=_int(model, "num_key_value_heads", heads),
                 head_dim=_int(model, "head_dim", max(1, h // heads)),
                 ffn=_int(model, "intermediate_size", 4 * h), vocab=_int(model, "vocab_size", 1), experts=experts,
                 expert_ffn=_int(model, "moe_intermediate_size", _int(model, "intermediate_size", 4 * h)),
                 top_k=_int(model, "num_experts_per_tok", 1) if experts else 0,
                 shared_ffn=_int(model, "shared_expert_intermediate_size") if qwen2_moe else 0,
                 tied=bool(model.get("tie_word_embeddings", False)),
                 qkv_bias=model.get("model_type") in ("qwen2", "qwen2_moe") or bool(model.get("attention_bias")),
                 qk_norm=model.get("model_type") in ("qwen3", "qwen3_moe"))


def parameter_count(d: _Dims, tp: int = 1, pp: int = 1, ep: int = 1, value_head: bool = False) -> int:
    """Weights one rank holds: its stage's layers (the larger of the first stage and the last), the linears and
    vocabulary split over TP (KV heads replicated where TP exceeds them), the routed experts split over EP."""
    kv_rows = max(1, d.kv_heads // tp) * d.head_dim
    attention = d.h * d.q // tp + 2 * d.h * kv_rows + d.q * d.h // tp + 2 * d.h  # q, k, v, o, the two norms
    attention += (d.q // tp + 2 * kv_rows if d.qkv_bias else 0) + (2 * d.head_dim if d.qk_norm else 0)
    if d.experts:
        mlp = (d.experts // max(1, ep)) * 3 * d.h * d.expert_ffn + d.experts * d.h + 3 * d.h * d.shared_ffn // tp
    else:
        mlp = 3 * d.h * d.ffn // tp
    layers = -(-d.layers // pp) * (attention + mlp)
    embedding = -(-d.vocab // tp) * d.h
    head = d.h + (d.h if value_head else (0 if d.tied and pp == 1 else embedding))  # the final norm and the head
    return layers + (embedding + head if pp == 1 else max(embedding, head))


def lora_factor_count(d: _Dims, rank: int, projections, tp: int = 1, pp: int = 1, ep: int = 1) -> int:
    """LoRA's A [r, in] and B [out, r] on one rank, for every targeted projection of its stage's layers: a
    column-parallel linear splits B over TP, a row-parallel one A; an MoE layer has one pair per expert."""
    if rank <= 0:
        return 0
    per_layer = 0
    for proj in projections:
        ffn = d.expert_ffn if d.experts and proj in MLP_PROJECTIONS else d.ffn
        fan_in, fan_out = _PROJECTION_SHAPES[proj](d.h, d.q, d.kv, ffn)
        split_in, split_out = (fan_in, fan_out // tp) if proj in _COLUMN_PARALLEL else (fan_in // tp, fan_out)
        copies = d.experts // max(1, ep) if d.experts and proj in MLP_PROJECTIONS else 1
        per_layer += copies * rank * (split_in + split_out)
    return -(-d.layers // pp) * per_layer


def activation_bytes(spec: EngineSpec, d: _Dims) -> int:
    """Saved activations of the micro-batches one rank holds at once (rough; docs/memory.md): per token and
    layer ``4 h`` (/ TP under SP) + ``(2 q + 2 kv + 3 ffn_active) / TP`` in the parameter dtype, plus without
    flash attention the [L, L] scores and probabilities of each sequence and head; x :func:`_saved_layers`;
    plus the last stage's fp32 logits (x ``LOGIT_COPIES``)."""
    tokens = _local_tokens(spec)
    if tokens <= 0:
        return 0
    act = DTYPE_BYTES.get(spec.dtype, 4)
    tp = max(1, spec.tp)
    ffn_active = d.top_k * d.expert_ffn + d.shared_ffn if d.experts else d.ffn
    outside = 4 * d.h // (tp if spec.sequence_parallel else 1)
    inside = (2 * d.q + 2 * d.kv + 3 * ffn_active) // tp
    per_layer = tokens * (outside + inside) * act
    if not spec.flash_attention and spec.longest_sequence:
        seq = spec.longest_sequence
        per_layer += 2 * spec.micro_batch_sequences * max(1, d.heads // tp) * -(-seq // max(1, spec.cp)) * seq * act
    copies = LOGIT_COPIES if spec.trains else LOGIT_COPIES - 1  # no gradient without training
    logits = tokens * (1 if spec.value_head else -(-d.vocab // tp)) * FP32 * copies
    return per_layer * _saved_layers(spec, d) + logits


def lora_activation_bytes(spec: EngineSpec, d: _Dims) -> int:
    """LoRA's saved ``A x`` ([tokens, rank] per targeted projection, for B's gradient), fp32, per layer and
    micro-batch in flight as :func:`activation_bytes` counts them (an MoE expert's share: top-k of its tokens)."""
    if spec.lora_rank <= 0:
        return 0
    routed = sum(d.top_k if d.experts and p in MLP_PROJECTIONS else 1 for p in spec.lora_projections)
    return _local_tokens(spec) * spec.lora_rank * routed * FP32 * _saved_layers(spec, d)


def _local_tokens(spec: EngineSpec) -> int:
    """One micro-batch's tokens on one rank (CP splits each sequence)."""
    return -(-spec.micro_batch_tokens // max(1, spec.cp))


def _saved_layers(spec: EngineSpec, d: _Dims) -> int:
    """Layers whose activations are held at once: the stage's layers x PP micro-batches in flight (1F1B)
    when training; one layer's when forward only."""
    return -(-d.layers // max(1, spec.pp)) * max(1, spec.pp) if spec.trains else 1


def _reduce_scatter_copy(spec: EngineSpec, trainable: int) -> int:
    """The distributed optimizer reduce-scatters the whole fp32 gradient buffer (one bucket: megatron buckets only
    to overlap the reduction, which the engine does not); gloo's ``reduce_scatter_tensor`` all-reduces a full copy
    of its input, NCCL's writes the shard in place. After backward, before the step."""
    sharded = spec.distributed_optimizer and max(1, spec.dp) * max(1, spec.cp) > 1
    return trainable * FP32 if spec.gloo and sharded else 0


def estimate_engine(spec: EngineSpec) -> Estimate:
    """The engine's bytes per part on one device (see the module docstring)."""
    d = model_dims(spec.model)
    param_bytes = DTYPE_BYTES.get(spec.dtype, 4)
    base = parameter_count(d, spec.tp, spec.pp, spec.ep, spec.value_head)
    factors = lora_factor_count(d, spec.lora_rank, spec.lora_projections, spec.tp, spec.pp, spec.ep)
    trainable = 0 if not spec.trains else (factors + (d.h if spec.value_head else 0) if spec.lora_rank > 0 else base)
    shards = max(1, spec.dp) * max(1, spec.cp) if spec.distributed_optimizer else 1
    master = FP32 if param_bytes < FP32 else 0  # a bf16 run's fp32 main parameters
    parts = {"parameters": base * param_bytes}
    if factors:
        parts["LoRA factors"] = factors * param_bytes
    if trainable:
        parts["gradients"] = trainable * FP32
        parts["optimizer"] = -(-trainable * (ADAM_MOMENTS_FP32 * FP32 + master) // shards)
    parts["activations"] = activation_bytes(spec, d)
    if factors:
        parts["LoRA activations"] = lora_activation_bytes(spec, d)
    if trainable:  # the step's fp32 scratch comes after backward freed the activations: only its excess counts
        scratch = max(-(-trainable * FP32 // shards), _reduce_scatter_copy(spec, trainable))
        parts["optimizer step"] = max(0, scratch - parts["activations"] - parts.get("LoRA activations", 0))
    if spec.rollout_dtype:
        parts["rollout weights"] = parameter_count(d, value_head=False) * DTYPE_BYTES.get(spec.rollout_dtype, 4)
    return Estimate(spec.name, parts)


def device_memory() -> tuple[int, str]:
    """(bytes, what they are) of the device a worker runs on: GPU 0's total memory (asked without a CUDA context
    in this process), else the RAM available now, which every worker process of this machine shares."""
    import torch

    if torch.cuda.is_available():
        total, name = _gpu0_total_memory()
        return total, f"the GPU's {gib(total)} GiB ({name})"
    import psutil

    available = int(psutil.virtual_memory().available)
    return available, f"this machine's {gib(available)} GiB of available RAM"


GPU_QUERY_TIMEOUT_S = 60.0


def _gpu0_total_memory() -> tuple[int, str]:
    """GPU 0's total memory and name from ``nvidia-smi``, else from torch in a child process (whose CUDA context
    ends with it)."""
    import subprocess
    import sys

    try:
        out = subprocess.run(["nvidia-smi", "--id=0", "--query-gpu=memory.total,name", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S, check=True).stdout
        mib, name = out.strip().splitlines()[0].split(",", 1)
        return int(float(mib)) << 20, name.strip()
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    probe = ("import torch; p = torch.cuda.get_device_properties(0); print(p.total_memory); print(p.name)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S,
                         check=True).stdout.splitlines()
    return int(out[0]), out[1]
