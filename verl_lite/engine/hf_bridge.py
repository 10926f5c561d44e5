"""HF <-> megatron weights for the Qwen2 / Qwen3 / Llama family (and their MoE), in any TP / PP / VPP / EP layout.

Layout rules (megatron-core 0.16.1, per TP rank r):

- embedding / output layer: vocabulary rows ``[r*Vp/tp, (r+1)*Vp/tp)`` of the vocabulary padded to
  ``Vp = padded_vocab_size(V, tp)``: load appends zero rows, export drops them (HF -> engine -> HF is exact).
- ``linear_qkv``: interleaved per KV group g as ``[q heads of g; k_g; v_g]`` (query head h in group
  ``h // (np/ng)``, as HF's GQA), rank r holding the r-th of ``tp`` row blocks; Qwen2's bias the same.
- ``linear_fc1``: rank r holds ``[gate rows of shard r; up rows of shard r]``; ``linear_proj`` and
  ``linear_fc2``: columns split in ``tp`` blocks; norms replicated; routed experts whole on their EP rank.
- A chunk's ``decoder.layers[j]`` is HF layer ``layer_number - 1``. Tied embeddings: the last stage's copy
  (PP > 1) is loaded from ``embed_tokens`` and never exported. Value head: ``output_layer`` <-> ``score.weight``.

``load_hf_weights`` fills the chunks in place; ``export_hf`` streams full HF tensors, one at a time,
gathered over TP (and EP for experts) and broadcast over PP, identical on every rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from verl_lite.engine.distributed import merged_over
from verl_lite.engine.lora import is_adapter_name
from verl_lite.engine.model import (_get, has_qk_norm, has_qkv_bias, is_moe, num_experts, projection_shapes,
                                    qkv_heads, unwrap_model)
from verl_lite.engine.regather import pad_rows
from verl_lite.engine.vocab_parallel import padded_vocab_size


@dataclass(frozen=True)
class _Entry:
    """One megatron parameter <-> one or more HF tensors. ``kind``: 'replicated' | 'vocab' | 'row' |
    'qkv' | 'fc1' | 'head' (value head) | 'expert' | 'expert_fc1'; ``export``: False for duplicate copies (tied
    output layer under PP)."""

    mcore_name: str
    hf_names: tuple[str, ...]
    kind: str
    export: bool = True


@dataclass(frozen=True)
class _MoELayout:
    """The MoE MLP of a layer as one rank holds it: experts ``[offset, offset + num_local)`` of
    ``num_experts`` (expert parallelism), and whether a gated shared expert exists (Qwen2-MoE)."""

    num_experts: int
    num_local: int
    offset: int
    shared: bool


EXPERT_KINDS = ("expert_fc1", "expert")  # whole per expert (ETP = 1), split over EP ranks


def _mlp_entries(m: str, hf: str, fc1: str = "fc1", fc2: str = "row") -> list[_Entry]:
    """An MLP's ``linear_fc1`` <-> [gate_proj; up_proj] and ``linear_fc2`` <-> down_proj."""
    return [_Entry(m + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), fc1),
            _Entry(m + "linear_fc2.weight", (hf + "down_proj.weight",), fc2)]


def _moe_mlp_entries(m: str, hf: str, moe: _MoELayout) -> list[_Entry]:
    """Router ``mlp.router.weight`` <-> ``mlp.gate.weight``; local expert k is global expert offset + k;
    the shared expert (TP-sharded like a dense MLP) and its sigmoid gate (replicated)."""
    out = [_Entry(m + "mlp.router.weight", (hf + "mlp.gate.weight",), "replicated")]
    for k in range(moe.num_local):
        out += _mlp_entries(m + f"mlp.experts.local_experts.{k}.", hf + f"mlp.experts.{moe.offset + k}.",
                            "expert_fc1", "expert")
    if moe.shared:
        out += _mlp_entries(m + "mlp.shared_experts.", hf + "mlp.shared_expert.")
        out.append(_Entry(m + "mlp.shared_experts.gate_weight", (hf + "mlp.shared_expert_gate.weight",), "replicated"))
    return out


def _moe_layout(hf_config, global_view: bool = False) -> _MoELayout | None:
    """This rank's ``_MoELayout`` (None for a dense model); ``global_view``: as if it held every expert."""
    if not is_moe(hf_config):
        return None
    n = num_experts(hf_config)
    shared = bool(_get(hf_config, "shared_expert_intermediate_size", 0)) and _get(hf_config, "model_type") == "qwen2_moe"
    if global_view:
        return _MoELayout(n, n, 0, shared)
    ep, ep_rank = _ep()
    return _MoELayout(n, n // ep, ep_rank * (n // ep), shared)


def _ep() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()


def _layer_entries(j: int, i: int, qkv_bias: bool, qk_norm: bool, moe: _MoELayout | None = None) -> list[_Entry]:
    m, hf = f"decoder.layers.{j}.", f"model.layers.{i}."
    a = hf + "self_attn."
    out = [
        _Entry(m + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated"),
        _Entry(m + "self_attention.linear_qkv.weight", (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), "qkv"),
    ]
    if qkv_bias:
        out.append(_Entry(m + "self_attention.linear_qkv.bias", (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), "qkv"))
    if qk_norm:
        out.append(_Entry(m + "self_attention.q_layernorm.weight", (a + "q_norm.weight",), "replicated"))
        out.append(_Entry(m + "self_attention.k_layernorm.weight", (a + "k_norm.weight",), "replicated"))
    out += [
        _Entry(m + "self_attention.linear_proj.weight", (a + "o_proj.weight",), "row"),
        _Entry(m + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "replicated"),
    ]
    return out + (_moe_mlp_entries(m, hf, moe) if moe is not None else _mlp_entries(m + "mlp.", hf + "mlp."))


def _chunk_entries(model, hf_config, value_head: bool) -> list[_Entry]:
    """Entries for the parameters of one (unwrapped) GPTModel chunk."""
    cfg = model.config
    layers = [layer.layer_number - 1 for layer in model.decoder.layers]
    return _entries(hf_config, value_head, model.pre_process, model.post_process, layers, cfg.add_qkv_bias,
                    cfg.qk_layernorm, _moe_layout(hf_config))


def _global_entries(hf_config, value_head: bool) -> list[_Entry]:
    """The entries of the whole model (every layer and expert, as one rank would hold it), in export order."""
    layers = range(_get(hf_config, "num_hidden_layers"))
    return _entries(hf_config, value_head, True, True, layers, has_qkv_bias(hf_config), has_qk_norm(hf_config),
                    _moe_layout(hf_config, global_view=True))


def _entries(hf_config, value_head: bool, pre: bool, post: bool, layers, qkv_bias: bool, qk_norm: bool,
             moe: _MoELayout | None) -> list[_Entry]:
    """The entries of a chunk holding HF ``layers`` (and the embedding when ``pre``, the head when ``post``)."""
    tied = bool(_get(hf_config, "tie_word_embeddings", False)) and not value_head
    entries = []
    if pre:
        entries.append(_Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    for j, i in enumerate(layers):
        entries += _layer_entries(j, i, qkv_bias, qk_norm, moe)
    if post:
        entries.append(_Entry("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
        if value_head:
            entries.append(_Entry("output_layer.weight", ("score.weight",), "head"))
        elif not tied:
            entries.append(_Entry("output_layer.weight", ("lm_head.weight",), "vocab"))
        elif not pre:  # tied, PP > 1: the last stage's duplicate of the embedding
            entries.append(_Entry("output_layer.weight", ("model.embed_tokens.weight",), "vocab", export=False))
    return entries


def _chunks_value_head(models) -> bool:
    """Whether the chunks form a value model (set by ``build_model_chunks`` on every stage)."""
    return bool(getattr(models[0], "is_value_model", False))


def _interleave_qkv(q, k, v, hf_config):
    """HF q [np*hn, ...], k/v [ng*hn, ...] -> megatron full [ng*(np/ng+2)*hn, ...]."""
    n_heads, n_kv, hn = qkv_heads(hf_config)
    rest = q.shape[1:]
    qg = q.reshape(n_kv, (n_heads // n_kv) * hn, *rest)
    kg = k.reshape(n_kv, hn, *rest)
    vg = v.reshape(n_kv, hn, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def _split_qkv(full, hf_config):
    """Inverse of ``_interleave_qkv``."""
    n_heads, n_kv, hn = qkv_heads(hf_config)
    rest = full.shape[1:]
    g = full.reshape(n_kv, (n_heads // n_kv + 2) * hn, *rest)
    q, k, v = torch.split(g, [(n_heads // n_kv) * hn, hn, hn], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _shard(entry: _Entry, hf: list[torch.Tensor], hf_config, tp: int, r: int) -> torch.Tensor:
    """This TP rank's megatron tensor for ``entry`` from the full HF tensors."""
    if entry.kind in ("replicated", "head", "expert"):  # an expert is whole on its rank (ETP = 1)
        return hf[0]
    if entry.kind == "vocab":
        vocab = _get(hf_config, "vocab_size")
        if hf[0].shape[0] != vocab:
            raise ValueError(
                f"shape mismatch for {entry.mcore_name!r}: HF {entry.hf_names[0]} has {hf[0].shape[0]} rows, "
                f"the config's vocab_size is {vocab}")
        return pad_rows(hf[0], padded_vocab_size(vocab, tp)).chunk(tp, dim=0)[r]
    if entry.kind == "row":
        return hf[0].chunk(tp, dim=1)[r]
    if entry.kind == "qkv":
        return _interleave_qkv(*hf, hf_config).chunk(tp, dim=0)[r]
    if entry.kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp, dim=0)[r], up.chunk(tp, dim=0)[r]], dim=0)
    if entry.kind == "expert_fc1":  # [gate; up]
        return torch.cat(hf, dim=0)
    raise AssertionError(entry.kind)


def _unshard(entry: _Entry, shards: list[torch.Tensor], hf_config) -> list[torch.Tensor]:
    """Full HF tensors for ``entry`` from the shards of all TP ranks (in TP rank order)."""
    if entry.kind in ("replicated", "head", "expert"):
        return [shards[0]]
    if entry.kind == "vocab":
        return [torch.cat(shards, dim=0)[: _get(hf_config, "vocab_size")]]
    if entry.kind == "row":
        return [torch.cat(shards, dim=1)]
    if entry.kind == "qkv":
        return list(_split_qkv(torch.cat(shards, dim=0), hf_config))
    if entry.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    if entry.kind == "expert_fc1":
        return list(shards[0].chunk(2, dim=0))
    raise AssertionError(entry.kind)


def weight_files(model_dir: Path) -> list[Path]:
    """The model's safetensors files: those the index names, else every ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({model_dir / name for name in weight_map.values()})
    return sorted(model_dir.glob("*.safetensors"))


class _HFTensors:
    """Lazy access to an HF checkpoint dir (:func:`weight_files`) or a state dict."""

    def __init__(self, source):
        self._sd = source if isinstance(source, Mapping) else None
        self._files: dict[str, str] = {}  # tensor name -> its file
        if self._sd is None:
            from safetensors import safe_open

            files = weight_files(Path(source))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {source}; save the HF model with "
                                        f"save_pretrained(safe_serialization=True)")
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    self._files.update(dict.fromkeys(h.keys(), str(f)))

    def __contains__(self, name: str) -> bool:
        return name in (self._sd if self._sd is not None else self._files)

    def get(self, name: str) -> torch.Tensor:
        if self._sd is not None:
            return self._sd[name]
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as h:
            return h.get_tensor(name)


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()


@torch.no_grad()
def load_hf_weights(chunks, hf_model_dir_or_state_dict: str | os.PathLike | Mapping[str, torch.Tensor], hf_config,
                    copy_fn=None) -> None:
    """Copy HF weights into this rank's chunks, in place (``copy_fn(param, shard)`` instead when given: a bf16
    engine's fp32 main params). Raises if a parameter has no HF source or a shape disagrees; a value head keeps its
    fresh init when the checkpoint has no ``score.weight``."""
    src = _HFTensors(hf_model_dir_or_state_dict)
    tp, r, _ = _tp()
    models = [unwrap_model(c) for c in chunks]
    value_head = _chunks_value_head(models)
    for model in models:
        params = dict(model.named_parameters())
        entries = _chunk_entries(model, hf_config, value_head)
        covered = set()
        for e in entries:
            covered.add(e.mcore_name)
            p = params.get(e.mcore_name)
            if p is None:
                raise KeyError(f"megatron parameter {e.mcore_name!r} not found in the chunk; layout mismatch")
            missing = [n for n in e.hf_names if n not in src]
            if missing:
                if e.kind == "head":
                    continue
                raise KeyError(f"HF checkpoint lacks {missing} needed for {e.mcore_name!r}")
            t = _shard(e, [src.get(n) for n in e.hf_names], hf_config, tp, r)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(
                    f"shape mismatch for {e.mcore_name!r}: HF gives {tuple(t.shape)}, model has {tuple(p.shape)}")
            if copy_fn is not None:
                copy_fn(p, t.to(device=p.device))
            else:
                p.data.copy_(t.to(dtype=p.dtype, device=p.device))
        unmapped = sorted(n for n in set(params) - covered if not is_adapter_name(n))  # adapters: engine/lora.py
        if unmapped:
            raise KeyError(f"model parameters with no HF mapping: {unmapped}")


def hf_shapes(hf_config, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Shapes of every HF tensor the engine exports, in export order."""
    return {n: _hf_shape(n, hf_config) for e in _global_entries(hf_config, value_head) for n in e.hf_names}


def _hf_shape(name: str, hf_config) -> tuple[int, ...]:
    h = _get(hf_config, "hidden_size")
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (_get(hf_config, "vocab_size"), h)
    if name == "score.weight" or name.endswith("mlp.shared_expert_gate.weight"):
        return (1, h)
    if name.endswith("mlp.gate.weight"):  # the router
        return (num_experts(hf_config), h)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (qkv_heads(hf_config)[2],)
    if name.endswith("norm.weight"):
        return (h,)
    *_, proj, kind = name.split(".")
    ffn = (int(_get(hf_config, "moe_intermediate_size")) if ".mlp.experts." in name else
           int(_get(hf_config, "shared_expert_intermediate_size")) if ".mlp.shared_expert." in name else None)
    shape = projection_shapes(hf_config, ffn)[proj]
    return shape if kind == "weight" else shape[:1]


def _expert_index(hf_name: str) -> int:
    """``model.layers.{i}.mlp.experts.{e}.*`` -> e."""
    return int(hf_name.split(".")[5])


def _every_expert(owners: dict, hf_config) -> dict:
    """For each local expert tensor name, the same name for every expert of that layer (same owner)."""
    out = {}
    for k, v in owners.items():
        if ".mlp.experts." in k:
            parts = k.split(".")
            for e in range(num_experts(hf_config)):
                out[".".join(parts[:5] + [str(e)] + parts[6:])] = v
    return out


def _export_expert(entry: _Entry, name: str, local: dict, read, shapes: dict, dtype, device, hf_config) -> list[torch.Tensor]:
    """Full HF tensors of one expert, broadcast over the EP group from the rank that holds it."""
    from megatron.core import parallel_state as ps

    ep, _ = _ep()
    owner = _expert_index(name) // (num_experts(hf_config) // ep)
    if name in local:
        shard = read(local[name][1]).contiguous()
    elif entry.kind == "expert_fc1":
        rows, cols = shapes[entry.hf_names[0]]
        shard = torch.empty(2 * rows, cols, dtype=dtype, device=device)
    else:
        shard = torch.empty(shapes[name], dtype=dtype, device=device)
    if ep > 1:
        group = ps.get_expert_model_parallel_group()
        dist.broadcast(shard, src=dist.get_global_rank(group, owner), group=group)
    return _unshard(entry, [shard], None)


EXPORT_ATTRS = ("param", "main_grad", "grad")


def _grad(p: torch.Tensor, attr: str) -> torch.Tensor | None:
    """``attr="main_grad"``: megatron DDP's ``main_grad``, falling back to ``.grad``; ``"grad"``: ``.grad``."""
    g = getattr(p, "main_grad", None) if attr == "main_grad" else None
    return g if g is not None else p.grad


def _dtype_of(p: torch.Tensor, attr: str) -> torch.dtype:
    g = None if attr == "param" else _grad(p, attr)
    return g.dtype if g is not None else p.dtype


def reader(attr: str):
    """``read(param)`` for one of ``EXPORT_ATTRS``: the parameter, or its gradient (zeros where it has none)."""
    if attr not in EXPORT_ATTRS:
        raise ValueError(f"attr={attr!r}: use 'param', 'main_grad' or 'grad'")

    def read(p: torch.Tensor) -> torch.Tensor:
        g = p if attr == "param" else _grad(p, attr)
        return g.detach() if g is not None else torch.zeros_like(p)

    return read


def export_hf(chunks, hf_config, attr: str = "param", main_params=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for every HF tensor, one at a time, the same on every rank; ``attr``: one of
    ``EXPORT_ATTRS``; ``main_params(param)``, with ``attr="param"``, is exported instead of the parameter (a bf16
    engine's fp32 main copy). Collective: every rank must iterate to the end."""
    from megatron.core import parallel_state as ps

    tp, _, tp_group = _tp()
    models = [unwrap_model(c) for c in chunks]
    value_head = _chunks_value_head(models)
    pp = ps.get_pipeline_model_parallel_world_size()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_rank = ps.get_pipeline_model_parallel_rank()

    use_main = main_params is not None and attr == "param"
    read = main_params if use_main else reader(attr)
    # What this rank holds: first HF name of an entry -> (entry, parameter)
    local: dict[str, tuple[_Entry, torch.Tensor]] = {}
    for model in models:
        params = dict(model.named_parameters())
        for e in _chunk_entries(model, hf_config, value_head):
            if e.export:
                local[e.hf_names[0]] = (e, params[e.mcore_name])
    owners: dict[str, tuple[int, str]] = {
        k: (pp_rank, "torch.float32" if use_main else str(_dtype_of(p, attr))) for k, (_, p) in local.items()}
    owners.update(_every_expert(owners, hf_config))  # this stage owns all experts of its layers (over EP)
    owners = merged_over(pp_group, owners)
    shapes = hf_shapes(hf_config, value_head)
    device = next(iter(local.values()))[1].device if local else torch.device("cpu")

    for entry in _global_entries(hf_config, value_head):
        name = entry.hf_names[0]
        if name not in owners:
            raise KeyError(f"no pipeline stage holds {name!r}; model and HF config disagree")
        owner, dtype_str = owners[name]
        dtype = getattr(torch, dtype_str.replace("torch.", ""))
        if owner == pp_rank and entry.kind in EXPERT_KINDS:  # experts: split over EP, whole per expert
            full = _export_expert(entry, name, local, read, shapes, dtype, device, hf_config)
        elif owner == pp_rank:
            shard = read(local[name][1]).contiguous()
            if tp > 1 and entry.kind not in ("replicated", "head"):
                shards = [torch.empty_like(shard) for _ in range(tp)]
                dist.all_gather(shards, shard, group=tp_group)
            else:
                shards = [shard]
            full = _unshard(entry, shards, hf_config)
        else:
            full = [torch.empty(shapes[n], dtype=dtype, device=device) for n in entry.hf_names]
        if pp > 1:
            src = dist.get_global_rank(pp_group, owner)
            for t in full:
                dist.broadcast(t, src=src, group=pp_group)
        yield from zip(entry.hf_names, full)


def fused_expert_view(targets: Mapping[str, torch.Tensor], hf_name: str) -> tuple[str, torch.Tensor] | None:
    """Where an exported expert tensor (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``) lives in a
    transformers-5 model's fused ``gate_up_proj [E, 2I, h]`` / ``down_proj [E, h, I]``: (fused parameter name, a
    view of its data to copy into), or None when it is not such a tensor or ``targets`` has no fused parameter."""
    parts = hf_name.split(".")
    if len(parts) != 8 or parts[3:5] != ["mlp", "experts"] or parts[7] != "weight":
        return None
    prefix, e, proj = ".".join(parts[:5]), int(parts[5]), parts[6]
    if proj in ("gate_proj", "up_proj"):
        fused = targets.get(prefix + ".gate_up_proj")
        if fused is None:
            return None
        half = fused.shape[1] // 2
        rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
        return prefix + ".gate_up_proj", fused.data[e, rows]
    if proj == "down_proj":
        fused = targets.get(prefix + ".down_proj")
        return None if fused is None else (prefix + ".down_proj", fused.data[e])
    return None
