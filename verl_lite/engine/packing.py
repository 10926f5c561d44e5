"""THD packing of variable-length sequences, the zig-zag split for context parallelism, and the
way back from packed per-token outputs to right-padded response tensors.

Each sequence is padded with id 0 to P_i = ceil(L_i / m) * m (m = :func:`pad_multiple`); labels (0 where never
read) are shifted on the full padded sequence before the split; CP rank r holds chunks r and 2*CP-1-r of each.
``unpack_response`` reads response token t at position L_i - R_i - 1 + t: ``[b, W]`` right-padded with 0.
Shared prompts (``share_prompts=True``, CP = 1) pack a prompt's first S = L_i - R_i - 1 tokens once; each
sequence is then a virtual sequence (:class:`SharedPrompts`) with the unshared pack's outputs and gradients.
(docs/parallelism.md, "Packing (THD) and the zig-zag split (`engine/packing.py`)", "Shared prompts")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verl_lite.engine.regather import gather_rows, invert_index, pad_rows


def pad_multiple(cp_size: int, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Multiple each sequence is padded to: 2*CP (x TP with SP) under CP; TP with SP; else 1."""
    sp = tp_size if sequence_parallel else 1
    return 2 * cp_size * sp if cp_size > 1 else sp


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass
class PackedMicroBatch:
    """One micro-batch packed THD, as seen by one CP rank (T_local = sum_i P_i / CP)."""

    input_ids: torch.Tensor  # [1, T_local], the local zig-zag shard
    labels: torch.Tensor  # [1, T_local]
    real_mask: torch.Tensor  # [1, T_local] bool: the real (non-padding) positions
    cu_seqlens: torch.Tensor  # [b+1] int32, global, padded (with ``shared``: the segments' bounds)
    max_seqlen: int
    lengths: list[int]  # L_i
    padded_lengths: list[int]  # P_i (with ``shared``: as if unshared; read only by the CP and MoE paths)
    response_lengths: list[int]  # R_i
    cp_size: int
    cp_rank: int
    shared: SharedPrompts | None = None  # a pack with shared prompts: its sequences are virtual sequences

    @property
    def num_local_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_real_local_tokens(self) -> int:
        """The tokens of the sequences this rank holds (real, non-padding positions of its chunks); sums
        over the CP group to sum_i L_i. A shared prompt counts once per sequence, as unshared."""
        if self.shared is not None:
            return sum(self.lengths)
        return int(self.real_mask.sum())


@dataclass
class SharedPrompts:
    """How the sequences of a pack with shared prompt prefixes read it (see the module docstring). A slot is
    an index into ``virtual_rows``: position p of sequence i is slot ``virtual_bounds[i] + p``."""

    virtual_rows: torch.Tensor  # [sum_i L_i] long: the pack row each slot reads
    virtual_bounds: list[int]  # [b+1]: the cumulative L_i
    slot_of_row: torch.Tensor  # [T] long: the slot whose output each row takes (a prefix row: the first member's)
    row_of_slot: torch.Tensor  # [sum_i L_i] long: the inverse, the row that takes each slot's output, or -1
    positions: torch.Tensor  # [T] long: each row's position in its virtual sequence(s) (0 for padding)

    def to(self, device) -> SharedPrompts:
        return SharedPrompts(self.virtual_rows.to(device), self.virtual_bounds, self.slot_of_row.to(device),
                             self.row_of_slot.to(device), self.positions.to(device))


def zigzag_positions(padded_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions (within one padded sequence) held by ``cp_rank``: chunks r and 2*CP-1-r."""
    if cp_size == 1:
        return torch.arange(padded_length, device=device)
    if padded_length % (2 * cp_size):
        raise ValueError(f"sequence length {padded_length} is not divisible by 2*cp = {2 * cp_size}; the packer "
                         f"must pad every sequence to a multiple of 2*cp before the zig-zag split")
    h = padded_length // (2 * cp_size)
    first = torch.arange(cp_rank * h, (cp_rank + 1) * h, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * h, (2 * cp_size - cp_rank) * h, device=device)
    return torch.cat([first, second])


def _check_response_length(k: int, length: int, response: int) -> None:
    if response < 0 or response > length - 1:
        raise ValueError(
            f"sequence {k}: response length {response} must be in [0, L-1] with L={length} (the first token is "
            f"prompt: the response is scored from the token before it)")


def _cu_seqlens(padded: torch.Tensor) -> torch.Tensor:
    """[0, P_0, P_0+P_1, ...] as int32."""
    return torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(padded, 0).to(torch.int32)])


def pack_micro_batch(input_ids: list[torch.Tensor], response_lengths: list[int], *, multiple: int = 1,
                     cp_size: int = 1, cp_rank: int = 0, share_prompts: bool = False) -> PackedMicroBatch:
    """Pack sequences THD (see module docstring). ``multiple`` must divide by 2*CP when CP > 1.
    ``share_prompts`` (CP = 1 only) packs each prompt shared by two or more sequences once."""
    if share_prompts and cp_size == 1:
        sequences = [torch.as_tensor(ids, dtype=torch.long).reshape(-1) for ids in input_ids]
        groups = _prompt_groups(sequences, response_lengths)
        if groups:
            return _pack_shared(sequences, response_lengths, groups, multiple)
    if len(input_ids) == 0:
        raise ValueError("pack_micro_batch: a micro-batch needs at least one sequence (got an empty one)")
    if len(input_ids) != len(response_lengths):
        raise ValueError(f"{len(input_ids)} sequences but {len(response_lengths)} response lengths")
    if cp_size > 1 and multiple % (2 * cp_size):
        raise ValueError(f"pad multiple {multiple} must be a multiple of 2*CP={2 * cp_size}")
    ids_out, labels_out, real_out, lengths, padded = [], [], [], [], []
    for k, (ids, r) in enumerate(zip(input_ids, response_lengths)):
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        n, r = int(ids.numel()), int(r)
        _check_response_length(k, n, r)
        p = _ceil_to(n, multiple)
        full_ids = torch.zeros(p, dtype=torch.long)
        full_ids[:n] = ids
        full_labels = torch.zeros(p, dtype=torch.long)
        full_labels[: n - 1] = ids[1:]
        full_real = torch.zeros(p, dtype=torch.bool)
        full_real[:n] = True
        pos = zigzag_positions(p, cp_size, cp_rank)
        ids_out.append(full_ids[pos])
        labels_out.append(full_labels[pos])
        real_out.append(full_real[pos])
        lengths.append(n)
        padded.append(p)
    return PackedMicroBatch(
        input_ids=torch.cat(ids_out).unsqueeze(0), labels=torch.cat(labels_out).unsqueeze(0),
        real_mask=torch.cat(real_out).unsqueeze(0), cu_seqlens=_cu_seqlens(torch.tensor(padded, dtype=torch.int32)),
        max_seqlen=max(padded), lengths=lengths, padded_lengths=padded,
        response_lengths=[int(r) for r in response_lengths], cp_size=cp_size, cp_rank=cp_rank)


def shared_prefix_length(prompt_length: int) -> int:
    """The tokens of a prompt that a pack with shared prompts holds once: all but the last (0 for one token)."""
    return prompt_length - 1 if prompt_length >= 2 else 0


def prompt_groups(prompts: Sequence[Sequence[int]] | None) -> list[tuple[int, int]] | None:
    """Each sequence's ``(group, shared)`` from its prompt token ids: ``shared`` = :func:`shared_prefix_length`,
    ``group`` an id common to the sequences with equal shareable prompts (else an id of its own); the packer and
    the micro-batch planner group by it. None: no prompts."""
    if prompts is None:
        return None
    ids: dict[tuple, int] = {}
    groups = []
    for i, prompt in enumerate(prompts):
        shared = shared_prefix_length(len(prompt))
        key = tuple(prompt.tolist() if hasattr(prompt, "tolist") else prompt) if shared else None
        groups.append((ids.setdefault(key, len(ids)) if shared else -1 - i, shared))
    return groups


def _prompt_groups(sequences: list[torch.Tensor], response_lengths) -> dict[int, list[int]]:
    """{first member: members} of the sequences whose prompts (``ids[:L - R]``) are equal and shareable
    (:func:`prompt_groups`), for the prompts that two or more sequences share; members in batch order."""
    prompts = []
    for ids, r in zip(sequences, response_lengths):
        prompt_len = int(ids.numel()) - int(r)
        prompts.append(ids[:prompt_len] if 0 <= prompt_len <= ids.numel() else ids[:0])  # a bad R shares nothing
    by_group: dict[int, list[int]] = {}
    for k, (group, shared) in enumerate(prompt_groups(prompts)):
        if shared:
            by_group.setdefault(group, []).append(k)
    return {members[0]: members for members in by_group.values() if len(members) > 1}


def _pack_shared(sequences: list[torch.Tensor], response_lengths, groups: dict[int, list[int]],
                 multiple: int) -> PackedMicroBatch:
    """The pack with shared prompts: in batch order, each sequence's own segment, preceded by its group's
    prefix segment at the group's first member; every segment padded to ``multiple`` (whole-pack index math)."""
    lengths = [int(ids.numel()) for ids in sequences]
    for k, (n, r) in enumerate(zip(lengths, response_lengths)):
        _check_response_length(k, n, int(r))
    first_of = {k: first for first, members in groups.items() for k in members}
    shared_len = [shared_prefix_length(lengths[k] - int(response_lengths[k])) if k in first_of else 0
                  for k in range(len(lengths))]
    # segments in pack order as (sequence, its first position, real length); each group's prefix
    # segment and each sequence's own segment by index
    segments, prefix_seg, own_seg = [], {}, []
    for k, n in enumerate(lengths):
        if k in groups:
            prefix_seg[k] = len(segments)
            segments.append((k, 0, shared_len[k]))
        own_seg.append(len(segments))
        segments.append((k, shared_len[k], n - shared_len[k]))
    seg_seq, seg_from, seg_len = zip(*segments)
    seg_len_t = torch.tensor(seg_len, dtype=torch.long)
    seg_padded = -(-seg_len_t // multiple) * multiple
    seg_start = torch.cumsum(seg_padded, 0) - seg_padded
    rows = int(seg_padded.sum())

    # every pack row: its segment, its position in its sequence, whether it is real, its token and label
    row_seg = torch.repeat_interleave(torch.arange(len(seg_seq)), seg_padded, output_size=rows)
    row_offset = torch.arange(rows) - seg_start[row_seg]
    real = row_offset < seg_len_t[row_seg]
    row_seq = torch.tensor(seg_seq, dtype=torch.long)[row_seg]
    position = torch.tensor(seg_from, dtype=torch.long)[row_seg] + row_offset
    flat = torch.cat(sequences)
    length_t = torch.tensor(lengths, dtype=torch.long)
    seq_start = torch.cumsum(length_t, 0) - length_t
    source = (seq_start[row_seq] + position).clamp(max=flat.numel() - 1)
    has_label = real & (position < length_t[row_seq] - 1)
    input_ids = torch.where(real, flat[source], 0)
    labels = torch.where(has_label, flat[(source + 1).clamp(max=flat.numel() - 1)], 0)

    # every virtual slot (position j of sequence k): the pack row it reads, and whether it owns that row
    slot_seq = torch.repeat_interleave(torch.arange(len(lengths)), length_t, output_size=int(length_t.sum()))
    slot_pos = torch.arange(slot_seq.numel()) - seq_start[slot_seq]
    shared_t = torch.tensor(shared_len, dtype=torch.long)[slot_seq]
    first_t = torch.tensor([first_of.get(k, k) for k in range(len(lengths))], dtype=torch.long)
    prefix_start = seg_start[torch.tensor([prefix_seg.get(first_of.get(k, -1), 0) for k in range(len(lengths))])]
    own_start = seg_start[torch.tensor(own_seg)]
    in_prefix = slot_pos < shared_t
    virtual_rows = torch.where(in_prefix, prefix_start[slot_seq] + slot_pos, own_start[slot_seq] + slot_pos - shared_t)
    owns = ~in_prefix | (first_t[slot_seq] == slot_seq)  # a group's first member owns the prefix rows
    slot_of_row = torch.full((rows,), -1, dtype=torch.long)
    slot_of_row[virtual_rows[owns]] = torch.arange(slot_seq.numel())[owns]
    row_of_slot = torch.where(owns, virtual_rows, -1)
    return PackedMicroBatch(
        input_ids=input_ids.unsqueeze(0), labels=labels.unsqueeze(0), real_mask=real.unsqueeze(0),
        cu_seqlens=_cu_seqlens(seg_padded), max_seqlen=max(max(lengths), int(seg_padded.max())), lengths=lengths,
        padded_lengths=[_ceil_to(n, multiple) for n in lengths], response_lengths=[int(r) for r in response_lengths],
        cp_size=1, cp_rank=0,
        shared=SharedPrompts(virtual_rows, [0, *torch.cumsum(length_t, 0).tolist()], slot_of_row, row_of_slot,
                             torch.where(real, position, 0)))


def unpack_response(local: torch.Tensor, packed: PackedMicroBatch, width: int, cp_group=None) -> torch.Tensor:
    """Per-token tensor on the local pack, ``[T_local, ...]`` (K values per token: ``[T_local, K]``) -> the
    ``[b, width, ...]`` response tensor, right-padded with 0 (module docstring)."""
    import torch.distributed as dist

    if local.shape[0] != packed.num_local_tokens:
        raise ValueError(f"per-token tensor has {local.shape[0]} rows, pack has {packed.num_local_tokens}")
    if packed.cp_size == 1:
        return _gather_responses(local, packed, width)
    shards = [torch.empty_like(local) for _ in range(packed.cp_size)]
    dist.all_gather(shards, local.detach().contiguous(), group=cp_group)
    shards[packed.cp_rank] = local  # only this rank's entry keeps autograd
    return assemble_response(shards, packed, width)


def response_rows(packed: PackedMicroBatch, width: int) -> torch.Tensor:
    """``[b, width]`` long: the local pack row that scores each response token (:func:`unpack_response`'s way
    back, read backwards), -1 past each response and, under CP, where another rank holds that row."""
    n = packed.num_local_tokens
    if packed.cp_size == 1:
        return _gather_responses(torch.arange(1, n + 1), packed, width) - 1
    shards = [torch.arange(rank * n + 1, (rank + 1) * n + 1) for rank in range(packed.cp_size)]
    rows = assemble_response(shards, packed, width) - 1 - packed.cp_rank * n
    return torch.where((rows >= 0) & (rows < n), rows, -1)


def token_rows(packed: PackedMicroBatch) -> list[torch.Tensor]:
    """For each sequence i, ``[L_i]`` long: the local pack row that holds its token at each position, -1 where
    another CP rank holds it. With shared prompts a shared prefix position is the one row every member reads."""
    if packed.shared is not None:
        bounds = packed.shared.virtual_bounds
        return [packed.shared.virtual_rows[bounds[i]:bounds[i + 1]] for i in range(len(packed.lengths))]
    out, offset = [], 0
    for n, p in zip(packed.lengths, packed.padded_lengths):
        local = p // packed.cp_size
        rows = torch.full((p,), -1, dtype=torch.long)
        rows[zigzag_positions(p, packed.cp_size, packed.cp_rank)] = torch.arange(offset, offset + local)
        out.append(rows[:n])
        offset += local
    return out


def token_positions(packed: PackedMicroBatch) -> torch.Tensor:
    """``[T_local]`` long: each local row's position in its sequence (:func:`token_rows` read backwards), -1 on
    padding rows. A pack without shared prompts (a shared prefix row has several)."""
    out = torch.full((packed.num_local_tokens,), -1, dtype=torch.long)
    for rows in token_rows(packed):
        held = rows >= 0
        out[rows[held]] = torch.arange(rows.numel())[held]
    return out


def pack_tokens(values: torch.Tensor, packed: PackedMicroBatch, fill) -> torch.Tensor:
    """Per-token inputs ``[b, >= max L_i, ...]`` (sequence i's token at position p in ``values[i, p]``) -> ``[T_local,
    ...]`` on the local pack, each at the row that holds its token; ``fill`` on padding rows."""
    out = torch.empty(packed.num_local_tokens, *values.shape[2:], dtype=values.dtype)
    out[:] = fill
    for i, rows in enumerate(token_rows(packed)):
        held = rows >= 0
        out[rows[held]] = values[i, : rows.numel()][held]
    return out


def pack_response(values: torch.Tensor, packed: PackedMicroBatch, width: int) -> torch.Tensor:
    """The inverse of :func:`unpack_response` on this rank: ``[b, width, ...]`` response values -> ``[T_local, ...]``
    on the local pack, each at the row that scores its token (0 on the rows that score none)."""
    rows = response_rows(packed, width).reshape(-1).to(values.device)
    flat = values.reshape(rows.numel(), *values.shape[2:])
    out = flat.new_zeros(packed.num_local_tokens, *values.shape[2:])
    held = rows >= 0
    out[rows[held]] = flat[held]
    return out


def _gather_responses(local: torch.Tensor, packed: PackedMicroBatch, width: int) -> torch.Tensor:
    """CP = 1: ``assemble_response`` as one gather (with a gather backward). Response token t of
    sequence i is scored at pack position start_i + L_i - R_i - 1 + t; entries t >= R_i are 0."""
    responses = torch.tensor(packed.response_lengths, dtype=torch.long)
    if int(responses.max()) > width:
        raise ValueError(f"response length {int(responses.max())} exceeds the output width {width}")
    if packed.shared is not None:  # where each sequence starts: in the virtual rows, or in the pack
        starts = torch.tensor(packed.shared.virtual_bounds[:-1], dtype=torch.long)
    else:
        padded = torch.tensor(packed.padded_lengths, dtype=torch.long)
        starts = torch.cumsum(padded, 0) - padded
    first = starts + torch.tensor(packed.lengths, dtype=torch.long) - responses - 1
    offsets = torch.arange(width, dtype=torch.long)
    valid = (offsets[None, :] < responses[:, None]).reshape(-1)
    index = torch.where(valid, (first[:, None] + offsets[None, :]).reshape(-1), 0)
    if packed.shared is not None:  # scored positions are in each sequence's own segment: distinct rows
        index = packed.shared.virtual_rows[index]
    valid, index = valid.to(local.device), index.to(local.device)
    inverse = invert_index(index, valid, local.shape[0])
    rows = gather_rows(local, index, inverse)
    valid = valid.view(-1, *[1] * (local.ndim - 1))
    zero = torch.zeros((), dtype=local.dtype, device=local.device)
    return torch.where(valid, rows, zero).view(len(packed.lengths), width, *local.shape[1:])


def assemble_response(shards: list[torch.Tensor], packed: PackedMicroBatch, width: int) -> torch.Tensor:
    """Un-zig-zag the CP shards ([T_local, ...] each, in CP rank order), trim, slice the responses."""
    cp = packed.cp_size
    if len(shards) != cp:
        raise ValueError(f"got {len(shards)} shards for CP={cp}")
    rows = []
    offset = 0  # offset of the current sequence inside every rank's local pack
    for n, p, r in zip(packed.lengths, packed.padded_lengths, packed.response_lengths):
        local_len = p // cp
        h = p // (2 * cp)
        chunks: list[torch.Tensor | None] = [None] * (2 * cp)
        for rank, shard in enumerate(shards):
            piece = shard[offset : offset + local_len]
            chunks[rank] = piece[:h]
            chunks[2 * cp - 1 - rank] = piece[h:]
        full = torch.cat(chunks)
        offset += local_len
        resp = full[n - r - 1 : n - 1]
        if r > width:
            raise ValueError(f"response length {r} exceeds the output width {width}")
        rows.append(pad_rows(resp, width))
    return torch.stack(rows)
