"""LoRA adapters on megatron's column- and row-parallel linears, PEFT-compatible in and out.

An adapter adds ``delta(x) = scaling * B (A dropout(x))`` (``scaling = alpha / rank``) to the output of one HF
projection (``config.LORA_TARGETS``), one (A, B) pair per projection exactly as PEFT builds it. Column-parallel
linears: A replicated, B split on its rows like the base (q/k/v interleaved per KV group); row-parallel: A split
on its input columns, B replicated; routed experts: whole pairs on the expert's EP rank. The base is frozen
before DDP is built, so the optimizer holds the adapters only (docs/lora.md, "Adapters on megatron's fused,
tensor-parallel linears" and "Mixture-of-experts: adapters on the experts").
"""

from __future__ import annotations

import contextlib
import json
import types
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from verl_lite.engine.config import LORA_ATTENTION, LORA_TARGETS, LoraConfig, as_names
from verl_lite.engine.distributed import merged_over
from verl_lite.engine.model import _get, projection_shapes, qkv_heads, unwrap_model

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

# megatron linear (attribute path inside a TransformerLayer) -> (parallel style, its HF projections in
# output order, HF module prefix inside model.layers.{i})
LINEARS = {
    "self_attention.linear_qkv": ("column", ("q_proj", "k_proj", "v_proj"), "self_attn."),
    "self_attention.linear_proj": ("row", ("o_proj",), "self_attn."),
    "mlp.linear_fc1": ("column", ("gate_proj", "up_proj"), "mlp."),
    "mlp.linear_fc2": ("row", ("down_proj",), "mlp."),
}
# the MLP's two linears (a dense MLP, a routed expert, the shared expert): (parallel style, HF projections)
MLP_LINEARS = {"linear_fc1": ("column", ("gate_proj", "up_proj")), "linear_fc2": ("row", ("down_proj",))}
ADAPTER_ATTR = "lora"  # the adapter module's attribute name on a megatron linear


def _split_dim(style: str, factor: str) -> int | None:
    """The dim a factor of a TP-sharded linear is split on (column B on rows, row A on columns), else None."""
    return {("column", "B"): 0, ("row", "A"): 1}.get((style, factor))


class _Pair(torch.nn.Module):
    """One HF projection's adapter as this rank holds it: ``A [r, in_local]``, ``B [out_local, r]``."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.A = torch.nn.Parameter(a)
        self.B = torch.nn.Parameter(b)


class LinearAdapter(torch.nn.Module):
    """The adapters of one megatron linear: ``pairs[proj]`` for each targeted HF projection; ``projs``: all
    the linear's projections in output order (an untargeted one contributes zeros), ``out_sizes`` their
    local output rows; ``qkv_groups``: local KV groups of ``linear_qkv`` (interleaving)."""

    def __init__(self, style, projs, pairs: dict, out_sizes, scaling, dropout, tp_group, sequence_parallel,
                 qkv_groups=None, expert_allreduce=None):
        super().__init__()
        self.style, self.projs, self.out_sizes = style, tuple(projs), tuple(out_sizes)
        self.pairs = torch.nn.ModuleDict(pairs)
        self.scaling, self.dropout = float(scaling), float(dropout)
        self.tp_group, self.sequence_parallel, self.qkv_groups = tp_group, bool(sequence_parallel), qkv_groups
        self.enabled = True
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        replicated, split = ("A", "B") if style == "column" else ("B", "A")
        for pair in self.pairs.values():
            if expert_allreduce is not None:  # a routed expert's adapter: marked as the expert's weights are
                for factor in ("A", "B"):
                    set_tensor_model_parallel_attributes(getattr(pair, factor), True, 0 if factor == "B" else 1, 1)
                    getattr(pair, factor).allreduce = bool(expert_allreduce)
                continue
            # the replicated factor's grad comes from this rank's tokens only under SP: summed over TP
            getattr(pair, replicated).sequence_parallel = self.sequence_parallel
            # the split factor is TP-parallel (counted on every rank in megatron's grad norm)
            set_tensor_model_parallel_attributes(getattr(pair, split), True, _split_dim(style, split), 1)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' contribution to the linear's local output for its input ``x``."""
        from megatron.core import tensor_parallel as tpl

        if self.dropout > 0 and self.training:
            x = F.dropout(x, p=self.dropout)
        parts = []
        for proj in self.projs:
            if proj not in self.pairs:
                parts.append(None)
                continue
            pair = self.pairs[proj]
            h = F.linear(x, pair.A)
            if self.tp_group is not None and self.tp_group.size() > 1:
                if self.style == "column" and self.sequence_parallel:
                    h = tpl.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
                elif self.style == "column":
                    h = tpl.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
                elif self.sequence_parallel:
                    h = tpl.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
                else:
                    h = tpl.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
            parts.append(F.linear(h, pair.B) * self.scaling)
        ref = next(p for p in parts if p is not None)
        parts = [p if p is not None else ref.new_zeros(*ref.shape[:-1], rows) for p, rows in zip(parts, self.out_sizes)]
        if self.qkv_groups is None:
            return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        lead = parts[0].shape[:-1]
        grouped = [p.reshape(*lead, self.qkv_groups, -1) for p in parts]
        return torch.cat(grouped, dim=-1).reshape(*lead, -1)


def _adapted_forward(self, input_, *args, **kwargs):
    """A megatron linear's forward with its adapter's delta added (bound to the linear by :func:`add_adapters`)."""
    out, bias = self._lora_base_forward(input_, *args, **kwargs)
    adapter = getattr(self, ADAPTER_ATTR)
    return (out + adapter.delta(input_) if adapter.enabled else out), bias


@dataclass(frozen=True)
class _Site:
    """One adaptable megatron linear of a layer: its HF projections in output order, ``hf_module`` the HF
    module path inside ``model.layers.{i}`` (e.g. ``mlp.experts.{e}.``), ``ffn`` that MLP's intermediate
    size, ``expert``: a routed expert (whole on this rank, gathered over EP)."""

    linear: torch.nn.Module
    style: str
    projs: tuple[str, ...]
    hf_module: str
    ffn: int
    expert: bool = False

    @property
    def is_qkv(self) -> bool:
        return self.projs == ("q_proj", "k_proj", "v_proj")


def _attr(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _layer_sites(layer, hf_config=None):
    """The layer's adaptable linears: attention and a dense MLP (:data:`LINEARS`), or a MoE layer's local
    routed experts and its shared expert. ``hf_config`` gives the sites' ``ffn`` (0 without it: naming only)."""
    for path, (style, projs, prefix) in LINEARS.items():
        linear = _attr(layer, path)
        if linear is not None:
            yield _Site(linear, style, projs, prefix, int(_get(hf_config, "intermediate_size", 0) or 0))
    experts = _attr(layer, "mlp.experts.local_experts")
    if experts is not None:
        from megatron.core import parallel_state as ps

        offset = ps.get_expert_model_parallel_rank() * len(experts)
        ffn = int(_get(hf_config, "moe_intermediate_size", 0) or 0)
        for k, expert in enumerate(experts):
            for fc, (style, projs) in MLP_LINEARS.items():
                yield _Site(getattr(expert, fc), style, projs, f"mlp.experts.{offset + k}.", ffn, expert=True)
    shared = _attr(layer, "mlp.shared_experts")
    if shared is not None:
        ffn = int(_get(hf_config, "shared_expert_intermediate_size", 0) or 0)
        for fc, (style, projs) in MLP_LINEARS.items():
            yield _Site(getattr(shared, fc), style, projs, "mlp.shared_expert.", ffn)


def peft_name(layer_index: int, proj: str, factor: str, module: str | None = None) -> str:
    """PEFT's saved name of one factor (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``);
    ``module``: the HF module path inside the layer (default ``self_attn.`` / ``mlp.``)."""
    prefix = module if module is not None else ("self_attn." if proj in LORA_ATTENTION else "mlp.")
    return f"{PEFT_PREFIX}model.layers.{layer_index}.{prefix}{proj}.lora_{factor}.weight"


def initial_factors(hf_config, cfg: LoraConfig, layer_index: int, proj: str, seed: int, module: str | None = None,
                    ffn: int | None = None):
    """Full (A, B) of a fresh adapter: A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming_uniform(a=sqrt(5))),
    B = 0, drawn from a generator seeded by ``seed`` and the PEFT name (the same in every layout)."""
    out_f, in_f = projection_shapes(hf_config, ffn)[proj]
    name = peft_name(layer_index, proj, "A", module)
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / in_f**0.5
    a = (torch.rand(cfg.rank, in_f, generator=g, dtype=torch.float64) * 2 - 1) * bound
    return a.float(), torch.zeros(out_f, cfg.rank)


def shard_factor(style: str, factor: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's piece of a full factor (:func:`_split_dim`); the other factor is replicated."""
    dim = _split_dim(style, factor)
    return full if dim is None else full.chunk(tp, dim=dim)[rank]


def add_adapters(chunks, hf_config, cfg: LoraConfig, seed: int) -> int:
    """Freeze ``chunks`` and attach fresh adapters (:func:`initial_factors`) to the targeted linears, before DDP
    and the optimizer are built. Returns the number of adapter parameters this rank holds."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    n_kv = qkv_heads(hf_config)[1]
    problems = cfg.layout_problems("lora", n_kv, tp)  # pre-flight checks the same before any worker starts
    if problems:
        raise ValueError("; ".join(problems))
    rank = ps.get_tensor_model_parallel_rank()
    count = 0
    for chunk in chunks:
        model = unwrap_model(chunk)
        for p in model.parameters():
            p.requires_grad_(False)
        if getattr(model, "is_value_model", False) and model.post_process:
            model.output_layer.weight.requires_grad_(True)  # a critic's head is new: it trains whole
        for layer in model.decoder.layers:
            i = layer.layer_number - 1
            for site in _layer_sites(layer, hf_config):
                chosen = [p for p in site.projs if p in cfg.projections]
                if not chosen:
                    continue
                linear, style = site.linear, site.style
                site_tp, site_rank = (1, 0) if site.expert else (tp, rank)  # a routed expert is whole (ETP = 1)
                device, dtype = linear.weight.device, linear.weight.dtype
                pairs = {}
                for proj in chosen:
                    a, b = initial_factors(hf_config, cfg, i, proj, seed, site.hf_module, site.ffn)
                    pairs[proj] = _Pair(shard_factor(style, "A", a, site_tp, site_rank).to(device, dtype).contiguous(),
                                        shard_factor(style, "B", b, site_tp, site_rank).to(device, dtype).contiguous())
                    count += pairs[proj].A.numel() + pairs[proj].B.numel()
                out_sizes = [projection_shapes(hf_config, site.ffn)[p][0] // (site_tp if style == "column" else 1)
                             for p in site.projs]
                adapter = LinearAdapter(style, site.projs, pairs, out_sizes, cfg.scaling, cfg.dropout,
                                        linear.tp_group if site_tp > 1 else None,
                                        False if site.expert else linear.sequence_parallel,
                                        qkv_groups=n_kv // tp if site.is_qkv else None,
                                        expert_allreduce=getattr(linear.weight, "allreduce", True) if site.expert else None)
                setattr(linear, ADAPTER_ATTR, adapter)
                linear._lora_base_forward = linear.forward
                linear.forward = types.MethodType(_adapted_forward, linear)
                _declare_sharding(linear, style, split=not site.expert)
    return count


def _declare_sharding(linear, style: str, split: bool = True) -> None:
    """The linear's ``sharded_state_dict`` with its adapter factors declared with their TP split (megatron declares
    a linear's children replicated); ``split=False``: a routed expert's whole adapters."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    base = linear.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        out = base(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        adapter = getattr(linear, ADAPTER_ATTR)
        state, axes = {}, {}
        for proj, pair in adapter.pairs.items():
            for factor in ("A", "B"):
                key = f"{ADAPTER_ATTR}.pairs.{proj}.{factor}"
                state[key] = getattr(pair, factor)
                if split and _split_dim(style, factor) is not None:
                    axes[key] = _split_dim(style, factor)
        out.update(make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets))
        return out

    linear.sharded_state_dict = sharded_state_dict


def is_adapter_name(name: str) -> bool:
    """Whether a chunk parameter name is an adapter factor (``...linear_qkv.lora.pairs.q_proj.A``)."""
    return f".{ADAPTER_ATTR}.pairs." in name


@contextlib.contextmanager
def adapters_disabled(chunks):
    """Inside: the chunks compute the base model (the adapters contribute nothing)."""
    mods = [m for chunk in chunks for m in unwrap_model(chunk).modules() if isinstance(m, LinearAdapter)]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.enabled = True


def local_factors(chunks):
    """(PEFT name, TP split dim or None, factor letter, parameter, is a routed expert's) of every factor
    this rank holds."""
    for chunk in chunks:
        for layer in unwrap_model(chunk).decoder.layers:
            for site in _layer_sites(layer):
                adapter = getattr(site.linear, ADAPTER_ATTR, None)
                if adapter is None:
                    continue
                for proj, pair in adapter.pairs.items():
                    for factor in ("A", "B"):
                        dim = None if site.expert else _split_dim(site.style, factor)
                        yield (peft_name(layer.layer_number - 1, proj, factor, site.hf_module), dim, factor,
                               getattr(pair, factor), site.expert)


@torch.no_grad()
def load_adapter_state(chunks, state: dict, copy_fn=None) -> None:
    """Copy full PEFT-named factors (``state``) into this rank's shards, in place; ``copy_fn(param, shard)``
    instead when given (a bf16 engine's fp32 main parameters). Raises naming a missing or misshaped factor."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, dim, factor, param, _ in local_factors(chunks):
        if name not in state:
            raise KeyError(f"the adapter lacks {name!r} (the engine's target modules have it)")
        shard = state[name] if dim is None else state[name].chunk(tp, dim=dim)[rank]
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"adapter tensor {name}: shape {tuple(state[name].shape)} does not fit this model "
                             f"(this rank's shard is {tuple(param.shape)}, the full factor {'rows' if factor == 'B' else 'columns'} differ)")
        if copy_fn is not None:
            copy_fn(param, shard.to(param.device))
        else:
            param.copy_(shard.to(param.device, param.dtype))


def export_adapter_state(chunks, read=None) -> dict:
    """Full PEFT-named factors on every rank (float32 on cpu), gathered over TP, EP and PP (collective);
    ``read(param)`` chooses what is exported (default: the parameter)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    read = read or (lambda p: p.detach())
    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    mine, experts = {}, {}
    for name, dim, factor, param, expert in local_factors(chunks):
        t = read(param).float().contiguous()
        if dim is not None and tp > 1:
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t, group=tp_group)
            t = torch.cat(shards, dim=dim)
        (experts if expert else mine)[name] = t.cpu()
    if experts:  # each EP rank holds its experts' adapters
        mine.update(merged_over(ps.get_expert_model_parallel_group(), experts))
    return dict(sorted(merged_over(ps.get_pipeline_model_parallel_group(), mine).items()))


def merge_into(hf_stream, adapter_state: dict, scaling: float):
    """HF (name, tensor) pairs with ``W + scaling * B @ A`` for each adapted projection (the merged model)."""
    for name, tensor in hf_stream:
        if name.endswith(".weight"):
            a = adapter_state.get(f"{PEFT_PREFIX}{name[: -len('.weight')]}.lora_A.weight")
            if a is not None:
                b = adapter_state[f"{PEFT_PREFIX}{name[: -len('.weight')]}.lora_B.weight"]
                delta = (b.double() @ a.double()) * scaling
                tensor = (tensor.double().cpu() + delta).to(tensor.dtype).to(tensor.device)
        yield name, tensor


def peft_adapter_config(cfg: LoraConfig, base_model_path: str | None = None) -> dict:
    """``adapter_config.json`` as PEFT writes it for these adapters."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(cfg.rank), "lora_alpha": float(cfg.alpha),
        "lora_dropout": float(cfg.dropout), "target_modules": list(cfg.projections), "bias": "none",
        "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
        "modules_to_save": None, "base_model_name_or_path": base_model_path, "inference_mode": True,
    }


def save_peft_adapter(directory, cfg: LoraConfig, adapter_state: dict, base_model_path: str | None = None) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (``peft.PeftModel.from_pretrained`` loads them)."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / ADAPTER_CONFIG).write_text(json.dumps(peft_adapter_config(cfg, base_model_path), indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in adapter_state.items()}, str(d / ADAPTER_WEIGHTS))


def read_peft_adapter(directory) -> tuple[dict, dict]:
    """(adapter_config.json, PEFT-named tensors) of a PEFT adapter directory; the names are normalised to
    PEFT's saved form (``...lora_A.weight``, adapter name dropped). Raises naming what is missing."""
    from safetensors.torch import load_file

    d = Path(directory)
    if not (d / ADAPTER_CONFIG).is_file() or not (d / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"lora.adapter_path={str(d)!r} is not a PEFT adapter directory "
                                f"({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} expected)")
    config = json.loads((d / ADAPTER_CONFIG).read_text())
    check_plain_lora(config, d / ADAPTER_CONFIG)
    tensors = {k.replace(".default.weight", ".weight"): v for k, v in load_file(str(d / ADAPTER_WEIGHTS)).items()}
    return config, tensors


def check_plain_lora(config: dict, where) -> None:
    """An adapter_config.json of plain LoRA (no DoRA / rsLoRA): what the engine builds."""
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise ValueError(f"{where}: only plain LoRA adapters are supported (no DoRA / rsLoRA)")


def check_adapter_matches(cfg: LoraConfig, config: dict, where: str) -> None:
    """The run's LoRA settings must be the adapter's (rank, alpha and its target projections)."""
    targets = sorted({p for t in as_names(config.get("target_modules")) for p in LORA_TARGETS.get(t, (t,))})
    mismatch = []
    if int(config.get("r", -1)) != int(cfg.rank):
        mismatch.append(f"rank {cfg.rank} vs the adapter's r={config.get('r')}")
    if float(config.get("lora_alpha", -1)) != float(cfg.alpha):
        mismatch.append(f"alpha {cfg.alpha} vs the adapter's lora_alpha={config.get('lora_alpha')}")
    if targets != sorted(cfg.projections):
        mismatch.append(f"target modules {sorted(cfg.projections)} vs the adapter's {targets}")
    if mismatch:
        raise ValueError(f"lora.adapter_path={where!r} does not match the lora settings: " + "; ".join(mismatch))
