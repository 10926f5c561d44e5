"""Multi-process launcher for engine tests: ranks from the preloaded fork server (tests/fork_ranks.py) + gloo on
127.0.0.1.

``spawn_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size``
processes after ``torch.distributed`` is initialised (gloo, short timeout, 1 thread each) and returns
the per-rank return values. ``fn`` must be a module-level function. An exception in any rank fails
the launch (spawn terminates the others). Megatron's model-parallel groups are NOT created here:
call ``use_layout(parallel, world_size)`` inside ``fn``, as often as needed, to (re)build them for a
layout without relaunching processes.
"""

from __future__ import annotations

import os
import tempfile

import torch

from tests.fork_ranks import start_ranks
from verl_lite.utils.net import free_port

DEFAULT_TIMEOUT_S = 120.0


def _entry(rank, world_size, port, out_dir, timeout_s, fn, args):
    torch.set_num_threads(1)
    from verl_lite.engine.distributed import destroy_distributed, init_distributed
    from verl_lite.engine.config import MegatronConfig

    init_distributed(rank, world_size, "127.0.0.1", port, MegatronConfig.layout(timeout_s=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_distributed()


def spawn_ranks(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out_dir:
        start_ranks(_entry, (world_size, free_port(), out_dir, timeout_s, fn, args), nprocs=world_size)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def use_layout(rank: int, world_size: int, parallel) -> None:
    """(Re)create megatron's model-parallel groups for ``parallel`` inside a launched process."""
    from verl_lite.engine.distributed import init_distributed

    init_distributed(rank, world_size, "127.0.0.1", 0, parallel)


# ------------------------------------------------------------------------------------------
# Shared helpers for the model tests (plain torch; no engine code under test is reused here)
# ------------------------------------------------------------------------------------------


def zigzag_split(tokens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s share of one padded sequence: chunks rank and 2cp-1-rank of 2cp equal chunks."""
    chunks = tokens.chunk(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def pad_to(x: torch.Tensor, multiple: int, value=0) -> torch.Tensor:
    n = (-x.shape[0]) % multiple
    return torch.cat([x, x.new_full((n, *x.shape[1:]), value)]) if n else x


def pack(seqs: list[torch.Tensor], cp: int = 1, cp_rank: int = 0, multiple: int = 1):
    """THD pack of ``seqs`` for one CP rank: every sequence padded to a multiple of 2cp (and of
    ``multiple``), zig-zag split, concatenated. Returns (local tokens [t], PackedSeqParams with
    GLOBAL cu_seqlens (real and padded), local index of every real token, or -1 per (seq, pos))."""
    from megatron.core.packed_seq_params import PackedSeqParams

    step = (2 * cp if cp > 1 else 1) * multiple
    real, padded, local, where = [0], [0], [], []
    offset = 0
    for s in seqs:
        p = pad_to(s, step)
        pos = zigzag_split(torch.arange(p.shape[0]), cp, cp_rank) if cp > 1 else torch.arange(p.shape[0])
        local.append(p[pos])
        w = torch.full((s.shape[0],), -1, dtype=torch.long)
        for j, g in enumerate(pos.tolist()):
            if g < s.shape[0]:
                w[g] = offset + j
        where.append(w)
        offset += pos.shape[0]
        real.append(real[-1] + s.shape[0])
        padded.append(padded[-1] + p.shape[0])
    cu = torch.tensor(real, dtype=torch.int32)
    cu_p = torch.tensor(padded, dtype=torch.int32)
    mx = int((cu_p[1:] - cu_p[:-1]).max())
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p, cu_seqlens_kv_padded=cu_p,
        max_seqlen_q=mx, max_seqlen_kv=mx,
    )
    return torch.cat(local), psp, where


def pipeline_forward(chunks, input_ids: torch.Tensor, psp, hidden_size: int):
    """Forward through every virtual stage in order, passing activations with blocking p2p over the
    PP group (virtual stage v of PP rank p is global stage v*pp + p). Returns the last stage's
    output on the last PP rank, else None. ``input_ids``: [1, t_local]."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1 and len(chunks) == 1:
        return chunks[0](input_ids, None, None, packed_seq_params=psp)
    prev, nxt = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    tp = ps.get_tensor_model_parallel_world_size()
    sp = chunks[0].config.sequence_parallel
    t = input_ids.shape[1] // (tp if sp else 1)
    out = None
    for v, chunk in enumerate(chunks):
        if not (v == 0 and first):
            h = torch.empty(t, 1, hidden_size)
            dist.recv(h, src=prev)
            chunk.set_input_tensor(h)
        out = chunk(input_ids, None, None, packed_seq_params=psp)
        if not (v == len(chunks) - 1 and last):
            dist.send(out.detach().contiguous(), dst=nxt)
    return out if last else None


def dense_causal_attention(q, k, v, bounds, scale):
    """Reference: per sequence ``bounds[i]:bounds[i+1]`` and per query head h (KV group
    h // (np/ng)), softmax(q k^T * scale, keys j <= i) v, with explicit loops. Rows past
    ``bounds[-1]`` are 0. q [t, np, hn], k/v [t, ng, hn] -> [t, np*hn]."""
    t, n_heads, hn = q.shape
    group = n_heads // k.shape[1]
    rows = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        heads = []
        for h in range(n_heads):
            g = h // group
            s = q[a:b, h] @ k[a:b, g].T * scale
            future = torch.triu(torch.ones(b - a, b - a, dtype=torch.bool), diagonal=1)
            s = s.masked_fill(future, float("-inf"))
            heads.append(torch.softmax(s, dim=-1) @ v[a:b, g])
        rows.append(torch.stack(heads, dim=1).reshape(b - a, n_heads * hn))
    if bounds[-1] < t:
        rows.append(q.new_zeros(t - bounds[-1], n_heads * hn))
    return torch.cat(rows)


def attention_module(kv_channels: int, cp_group=None):
    """A PackedCoreAttention without megatron's TransformerConfig (it reads two fields)."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from verl_lite.engine.attention import PackedCoreAttention

    cfg = SimpleNamespace(attention_dropout=0.0, kv_channels=kv_channels)
    pg = SimpleNamespace(cp=cp_group) if cp_group is not None else None
    return PackedCoreAttention(cfg, 1, AttnMaskType.causal, pg_collection=pg)
