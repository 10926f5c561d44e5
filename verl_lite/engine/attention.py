"""Core attention for megatron's ``SelfAttention`` (its local one rejects THD and CP): packed THD and bshd,
GQA, zig-zag context parallelism. RoPE is already applied to q, k (megatron-core 0.16.1).

- THD: q ``[t, np, hn]``, k/v ``[t, ng, hn]`` -> ``[t, np*hn]``, causal within each padded sequence
  ``cu[i]:cu[i+1]`` (``cu`` GLOBAL under CP too); rows past ``cu[-1]`` produce zeros. bshd: ``[s, b, np, hn]``
  -> ``[s, b, np*hn]``, causal or the explicit ``attention_mask`` (True = masked out), always on SDPA.
- Per sequence ``softmax(q k^T * scale + mask) v``, ``scale = softmax_scale`` or ``1/sqrt(hn)``; K/V never
  repeated. CP: K and V all-gathered (backward: reduce-scatter), key p_k visible to query p_q iff p_k <= p_q.
- Kernels (:func:`select_attention_backend`): flash-attn varlen (under CP too), else SDPA, or two matmuls for
  short sequences on the CPU speed paths.
(docs/parallelism_attention.md; shared prompts: docs/parallelism.md, "Shared prompts")
"""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_lite.engine import speed_paths
from verl_lite.engine.packing import zigzag_positions
from verl_lite.engine.regather import gather_rows, invert_index, pad_rows


def all_gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-gather along dim 0 over ``group`` (backward: reduce-scatter to the owners); ``x`` itself
    when ``group`` is None or of size 1 (where megatron's would fall back to the TP group)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)


# Causal attention over short sequences runs as matmuls (``causal_matmul_attention``) on the CPU in float32/float64:
# sequences of at most SHORT_CAUSAL_MAX_LEN positions, and a score tensor [b, heads, L, L] of at most
# MATMUL_ATTENTION_MAX_SCORES elements (16 MiB in float32). There torch's SDPA costs more than the arithmetic;
# beyond, SDPA skips the masked blocks the matmuls compute. The limits are where docs/performance.md's
# measurements put the crossing.
SHORT_CAUSAL_MAX_LEN = 64
MATMUL_ATTENTION_MAX_SCORES = 1 << 22
MATMUL_ATTENTION_DTYPES = (torch.float32, torch.float64)


def grouped_matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale + bias) v`` as two batched matmuls: q ``[b, h, Lq, d]``, k/v ``[b, g, Lk, d]`` ->
    ``[b, h, Lq, d]``. A group's h/g query heads are stacked as the rows of one matmul against its keys (row r:
    head r // Lq, position r % Lq), so K and V are never repeated. ``bias``: additive (its backward needs no mask),
    broadcastable to ``[b, g, (h/g) * Lq, Lk]``, -inf where a key is not attended; None = every key."""
    b, h, length, d = q.shape
    groups = k.shape[1]
    scores = torch.matmul(q.reshape(b, groups, (h // groups) * length, d), k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    return torch.matmul(torch.softmax(scores, dim=-1), v).reshape(b, h, length, d)


def causal_matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal :func:`grouped_matmul_attention` of ``[b, h, L, d]`` queries over ``[b, g, L, d]`` keys/values: query
    position i sees keys 0..i (upper-left, as SDPA's ``is_causal``)."""
    length = q.shape[2]
    future = torch.full((length, length), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
    return grouped_matmul_attention(q, k, v, scale, future.repeat(q.shape[1] // k.shape[1], 1))


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      matmul: bool = False) -> torch.Tensor:
    """Causal attention of ``[b, h, L, d]`` queries over ``[b, g, L, d]`` keys/values: ``causal_matmul_attention``
    when asked (``matmul``) or on the CPU speed paths where it is the faster, else SDPA."""
    b, heads, length, _ = q.shape
    if matmul or (speed_paths.cpu_speed_paths() and q.dtype in MATMUL_ATTENTION_DTYPES
                  and length <= SHORT_CAUSAL_MAX_LEN and b * heads * length * length <= MATMUL_ATTENTION_MAX_SCORES):
        return causal_matmul_attention(q, k, v, scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _flash_attn_varlen():
    """flash-attn's varlen kernel when installed and on GPU, else None (imported lazily)."""
    if not torch.cuda.is_available():
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


# megatron's ``AttnBackend`` names -> ours (config.MEGATRON_ATTENTION_NAMES; config imports this module)
_OUR_NAMES = {"auto": "auto", "flash": "flash", "unfused": "sdpa", "local": "sdpa", "sdpa": "sdpa"}
ATTENTION_BACKEND_ENV = "VERL_LITE_ATTENTION_BACKEND"
FLASH_DTYPES = (torch.float16, torch.bfloat16)
logger = logging.getLogger(__name__)


def select_attention_backend(requested: str, dtype: torch.dtype, *, cuda: bool | None = None,
                             flash_kernel=None, env: dict | None = None) -> tuple[str, str]:
    """The THD kernel for a module: ``("flash" | "sdpa", why)``. "auto": flash-attn varlen where CUDA, ``flash_attn``
    and a 16-bit ``dtype`` are present, else SDPA; "flash": flash-attn or ``ValueError`` saying what is missing.
    ``VERL_LITE_ATTENTION_BACKEND`` in ``env`` overrides "auto"; ``cuda`` / ``flash_kernel``: this process's."""
    env = os.environ if env is None else env
    if requested not in ("auto", "flash", "sdpa"):
        raise ValueError(f"attention backend {requested!r}: choose auto, flash or sdpa")
    forced = str(env.get(ATTENTION_BACKEND_ENV, "")).lower()
    if forced not in ("", "auto", "sdpa", "flash"):
        raise ValueError(f"{ATTENTION_BACKEND_ENV}={forced!r}: choose auto, sdpa or flash")
    if requested == "auto" and forced in ("sdpa", "flash"):
        requested, via = forced, f"{ATTENTION_BACKEND_ENV}={forced}"
    else:
        via = f"attention_backend={requested}"
    if requested == "sdpa":
        return "sdpa", f"{via} forces torch SDPA"
    cuda = torch.cuda.is_available() if cuda is None else cuda
    missing = None
    if not cuda:
        missing = "no CUDA device (flash-attn runs on NVIDIA GPUs only)"
    elif (flash_kernel if flash_kernel is not None else _flash_attn_varlen()) is None:
        missing = "the flash_attn package is not installed (pip install flash-attn)"
    elif dtype not in FLASH_DTYPES:
        missing = f"params dtype {dtype} (flash-attn takes float16/bfloat16; train with megatron.dtype=bfloat16)"
    if missing is None:
        return "flash", f"{via}: CUDA, flash_attn and {dtype} present"
    if requested == "flash":
        raise ValueError(f"{via} needs flash-attn, which cannot run here: {missing}; use auto or sdpa")
    return "sdpa", f"torch SDPA: flash-attn not used because of {missing}"


class PackedCoreAttention(torch.nn.Module):
    """megatron ``core_attention`` for THD/bshd, GQA and zig-zag CP (see the module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 cp_comm_type: str | None = None, softmax_scale: float | None = None, pg_collection=None):
        super().__init__()
        if config.attention_dropout and config.attention_dropout > 0:
            raise ValueError(f"attention_dropout={config.attention_dropout} is not supported by PackedCoreAttention; "
                             "set it to 0 (RL fine-tuning runs without dropout)")
        if attention_type != "self":
            raise ValueError(f"PackedCoreAttention supports self-attention only, got attention_type={attention_type!r}")
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
            self.cp_group = pg_collection.cp
        else:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_size = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        self.cp_rank = dist.get_rank(self.cp_group) if self.cp_group is not None else 0
        dtype = getattr(config, "params_dtype", torch.float32)
        backend = getattr(config, "attention_backend", None)
        requested = str(getattr(backend, "name", backend) or "auto")
        requested = _OUR_NAMES.get(requested, requested)
        self.backend, self.backend_reason = select_attention_backend(requested, dtype)
        self._flash = _flash_attn_varlen() if self.backend == "flash" else None
        # > 0: batch-invariant (engine/batch_invariant.py): every sequence's keys padded to this many positions,
        # attention as matmuls of that one shape (set by the engine)
        self.invariant_length = 0
        if layer_number == 1:
            logger.info("THD core attention: %s (%s)", self.backend, self.backend_reason)

    # megatron calls forward(query, key, value, attention_mask, /, *, attn_mask_type, attention_bias, packed_seq_params)
    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("PackedCoreAttention does not support attention_bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if attention_mask is not None:
                raise ValueError("THD attention is causal per sequence; an explicit attention_mask is not supported")
            return self._forward_thd(query, key, value, packed_seq_params)
        return self._forward_bshd(query, key, value, attention_mask)

    # -- THD ---------------------------------------------------------------------------------
    def _forward_thd(self, q, k, v, psp):
        cu = psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else psp.cu_seqlens_q
        cu_kv = psp.cu_seqlens_kv_padded if psp.cu_seqlens_kv_padded is not None else psp.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu.cpu(), cu_kv.cpu()):
            raise ValueError("self-attention needs identical q and kv cu_seqlens")
        cp = self.cp_size
        shared = getattr(cu, "shared_prompts", None)
        if self.invariant_length:
            if cp > 1 or shared is not None:
                raise ValueError("batch-invariant attention runs at CP = 1 without shared prompts")
            return self._thd_batched(q, k, v, cu.tolist())
        if shared is not None:
            if cp > 1:
                raise ValueError("a pack with shared prompts runs at CP=1 only")
            return self._thd_shared(q, k, v, shared)
        bounds = cu.tolist()
        t_local = q.shape[0]
        if bounds[-1] % cp or bounds[-1] // cp > t_local:
            raise ValueError(f"cu_seqlens[-1]={bounds[-1]} does not fit the local pack of {t_local} tokens at cp={cp}; "
                             "pass GLOBAL (padded) cu_seqlens and the zig-zag split local tokens")
        if self.backend == "flash" and q.dtype in FLASH_DTYPES:
            if cp == 1:
                return self._thd_flash(self._flash, q, k, v, cu)
            return self._thd_flash_cp(self._flash, q, k, v, bounds)
        if cp == 1:
            return self._thd_batched(q, k, v, bounds)
        np_, hn = q.shape[1], q.shape[2]
        kv = torch.stack([k, v], dim=1)  # [t, 2, ng, hn]: one collective for both
        kv_all = all_gather_first_dim(kv, self.cp_group).view(cp, t_local, *kv.shape[1:])
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b == a:
                continue
            lo, hi = a // cp, b // cp
            kvi = kv_all[:, lo:hi].reshape(cp * (hi - lo), *kv.shape[1:])  # keys in gathered order
            oi = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1), kvi[:, 0].transpose(0, 1),
                                                kvi[:, 1].transpose(0, 1), attn_mask=self._zigzag_mask(b - a, q.device),
                                                scale=self.scale, enable_gqa=np_ != kvi.shape[2])
            outs.append(oi.transpose(0, 1).reshape(hi - lo, np_ * hn))
        return pad_rows(torch.cat(outs), t_local) if outs else q.new_zeros(t_local, np_ * hn)

    def _zigzag_mask(self, seq_len: int, device) -> torch.Tensor:
        """``[L/cp, L]`` bool: which gathered keys (in gathered order) this rank's queries of a sequence of
        padded length ``seq_len`` see (key position <= query position)."""
        q_pos = zigzag_positions(seq_len, self.cp_size, self.cp_rank, device=device)
        k_pos = torch.cat([zigzag_positions(seq_len, self.cp_size, j, device=device) for j in range(self.cp_size)])
        return k_pos[None, :] <= q_pos[:, None]

    def _thd_shared(self, q, k, v, shared):
        """CP = 1 with shared prompts (module docstring): attention on the virtual sequences."""
        if not (self.backend == "flash" and q.dtype in FLASH_DTYPES):
            return self._thd_batched(q, k, v, shared.virtual_bounds, shared)
        rows = shared.virtual_rows  # flash-attn: the pack of virtual sequences, then back
        qv = gather_rows(q, rows, shared.slot_of_row)  # a query's gradient: from its owning slot only
        kv, vv = k.index_select(0, rows), v.index_select(0, rows)  # a key's: summed over its readers
        cu = torch.tensor(shared.virtual_bounds, dtype=torch.int32, device=q.device)
        out = self._thd_flash(self._flash, qv, kv, vv, cu)
        out = gather_rows(out, shared.slot_of_row.clamp(min=0), shared.row_of_slot)
        return torch.where((shared.slot_of_row >= 0)[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))

    def _thd_batched(self, q, k, v, bounds: list[int], shared=None):
        """cp == 1: every sequence of the pack in ONE causal call on ``[b, max_len]``.

        The slots past a sequence's end read an arbitrary row, hidden by causality from that sequence's
        real queries; the real rows are read back in pack order, rows past ``cu[-1]`` are zeros. Both
        gathers have gather backwards (``regather.gather_rows``): the pad slots get no gradient, as they
        influence no real output. With ``shared`` the sequences are its virtual sequences (``bounds`` =
        ``shared.virtual_bounds``), a row is read back from the slot that owns it, and k and v are gathered
        with an adding backward (a shared key's gradient sums over its readers; pad slots add exact zeros)."""
        t_local, np_, hn = q.shape
        used = bounds[-1]
        starts = torch.tensor(bounds[:-1], dtype=torch.long)
        lengths = torch.tensor(bounds[1:], dtype=torch.long) - starts
        max_len = int(lengths.max()) if lengths.numel() else 0
        if max_len == 0:
            return q.new_zeros(t_local, np_ * hn)
        if self.invariant_length:
            if max_len > self.invariant_length:
                raise ValueError(f"a sequence of {max_len} positions is longer than the batch-invariant attention's "
                                 f"{self.invariant_length}")
            max_len = self.invariant_length
        b = lengths.numel()
        offsets = torch.arange(max_len, dtype=torch.long)
        valid = (offsets[None, :] < lengths[:, None]).reshape(-1)
        index = torch.where(valid, (starts[:, None] + offsets[None, :]).reshape(-1), 0).to(q.device)
        valid = valid.to(q.device)
        if shared is None:
            inverse = invert_index(index, valid, t_local)  # token -> its slot (-1 past cu[-1])
            readers = torch.where(valid, index, -1)  # slot -> the token it outputs to
            read = inverse[:used]
            key_gather = lambda x: gather_rows(x, index, inverse)  # noqa: E731
        else:
            slot_of_virtual = valid.nonzero().squeeze(-1)  # virtual slots are the valid slots, in order
            index = torch.where(valid, shared.virtual_rows[index], 0)  # slot -> the pack row it reads
            inverse = torch.where(shared.slot_of_row >= 0, slot_of_virtual[shared.slot_of_row.clamp(min=0)], -1)
            readers = torch.full_like(index, -1).index_copy_(0, slot_of_virtual, shared.row_of_slot)
            read = inverse
            key_gather = lambda x: x.index_select(0, index)  # noqa: E731

        def gather(x, rows):  # [t, heads, hn] -> [b, heads, max_len, hn]
            return rows(x).view(b, max_len, *x.shape[1:]).permute(0, 2, 1, 3)

        qb = gather(q, lambda x: gather_rows(x, index, inverse))
        kb, vb = gather(k, key_gather), gather(v, key_gather)
        out = _causal_attention(qb, kb, vb, self.scale, matmul=bool(self.invariant_length))
        out = out.permute(0, 2, 1, 3).reshape(b * max_len, np_ * hn)
        out = gather_rows(out, read.clamp(min=0), readers)
        if shared is not None:
            return torch.where((read >= 0)[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        return pad_rows(out, t_local)

    def _thd_flash(self, flash, q, k, v, cu):
        lengths = cu[1:] - cu[:-1]
        max_len = int(lengths.max().item()) if lengths.numel() else 0
        cu32 = cu.to(device=q.device, dtype=torch.int32)
        used = int(cu[-1].item())
        out = flash(q[:used], k[:used], v[:used], cu32, cu32, max_len, max_len, 0.0, softmax_scale=self.scale, causal=True)
        return pad_rows(out.reshape(used, -1), q.shape[0])

    def _thd_flash_cp(self, flash, q, k, v, bounds: list[int]):
        """Zig-zag CP on flash-attn varlen (module docstring), one kernel call per pack: each of this rank's
        query chunks (r and 2cp-1-r of c = L / (2cp) positions) is one varlen query sequence whose keys are
        the gathered K/V of positions [0, end of the chunk), in position order."""
        cp, r = self.cp_size, self.cp_rank
        t_local, np_, hn = q.shape
        kv = torch.stack([k, v], dim=1)  # [t, 2, ng, hn]
        kv_all = all_gather_first_dim(kv, self.cp_group)  # [cp * t, 2, ng, hn]; rank j's rows at j * t
        cu_q, cu_k, key_rows = [0], [0], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b == a:
                continue
            c = (b - a) // (2 * cp)
            lo = a // cp
            pos = torch.arange(b - a)
            chunk = pos // c
            owner = torch.where(chunk < cp, chunk, 2 * cp - 1 - chunk)
            offset = torch.where(chunk < cp, pos % c, c + pos % c)
            rows = owner * t_local + lo + offset  # gathered row of each position, position order
            for end in ((r + 1) * c, (2 * cp - r) * c):
                key_rows.append(rows[:end])
                cu_q.append(cu_q[-1] + c)
                cu_k.append(cu_k[-1] + end)
        used = bounds[-1] // cp
        if not key_rows:
            return q.new_zeros(t_local, np_ * hn)
        index = torch.cat(key_rows).to(q.device)
        kv_sel = kv_all.index_select(0, index)
        lq = [y - x for x, y in zip(cu_q[:-1], cu_q[1:])]
        lk = [y - x for x, y in zip(cu_k[:-1], cu_k[1:])]
        cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=q.device)
        cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=q.device)
        out = flash(q[:used], kv_sel[:, 0], kv_sel[:, 1], cu_q_t, cu_k_t, max(lq), max(lk), 0.0,
                    softmax_scale=self.scale, causal=True)
        return pad_rows(out.reshape(used, np_ * hn), t_local)

    # -- bshd --------------------------------------------------------------------------------
    def _forward_bshd(self, q, k, v, attention_mask):
        s, b, np_, hn = q.shape
        cp = self.cp_size
        qb = q.permute(1, 2, 0, 3)  # [b, np, s, hn]
        if cp == 1:
            kb, vb = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
            if attention_mask is not None:
                allowed = ~attention_mask.bool()
                out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=self.scale,
                                                     enable_gqa=np_ != kb.shape[1])
            else:
                out = _causal_attention(qb, kb, vb, self.scale, matmul=bool(self.invariant_length))
        else:
            if attention_mask is not None:
                raise NotImplementedError("an explicit attention_mask under context parallelism is not supported; use THD packing")
            kv = torch.stack([k, v], dim=1)  # [s, 2, b, ng, hn]
            kv_all = all_gather_first_dim(kv, self.cp_group)  # [cp*s, 2, b, ng, hn], keys in gathered order
            kb = kv_all[:, 0].permute(1, 2, 0, 3)
            vb = kv_all[:, 1].permute(1, 2, 0, 3)
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=self._zigzag_mask(cp * s, q.device),
                                                 scale=self.scale, enable_gqa=np_ != kb.shape[1])
        return out.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)
