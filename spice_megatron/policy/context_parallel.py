"""Context parallelism (parallel.context_parallel) for the learner's padded micro-batches.

Each of the CP ranks that share a sequence holds two of its 2 x CP equal chunks, chunk r and chunk
2CP-1-r: megatron's load-balanced layout, in which every rank has as many early (cheap) as late
(expensive) causal queries. megatron's rotary embedding already selects those two chunks of its
table (`get_pos_emb_on_this_cp_rank`), its DDP averages gradients over the data x context-parallel
ranks, and on GPU Transformer Engine's attention exchanges the K/V chunks itself. Without
Transformer Engine megatron's core attention refuses CP > 1: `ContextParallelAttention` stands in
for it, all-gathering K and V over the CP group (the backward reduce-scatters their gradients) and
masking each local query to the keys at or before its position in the sequence; that is
attention over the whole sequence, so the step equals CP = 1's. The loss is DrGRPO's token sum over
a fixed normaliser: each rank's sum over its own tokens is a part of it, and the parts add up.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from spice_megatron.policy.batching import MicroBatch
from spice_megatron.policy.shared_prefix import LocalCoreAttention


def rank_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The sequence positions CP rank `cp_rank` holds, in its order: chunks cp_rank and 2CP-1-cp_rank."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism over {cp} ranks needs a sequence length divisible by {2 * cp}, "
                         f"got {seq_len}")
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)])


def rank_micro_batch(mb: MicroBatch, cp: int, cp_rank: int) -> MicroBatch:
    """This CP rank's part of a padded micro-batch: every per-position tensor at rank_positions."""
    if mb.attention_mask is not None or mb.score_index is not None:
        raise ValueError("context parallelism splits padded micro-batches only (train.shared_prefix off)")
    s = mb.tokens.shape[1]
    keep = rank_positions(s, cp, cp_rank)
    sliced = {f.name: getattr(mb, f.name).index_select(1, keep) for f in dataclasses.fields(mb)
              if isinstance(getattr(mb, f.name), torch.Tensor) and getattr(mb, f.name).dim() >= 2
              and getattr(mb, f.name).shape[1] == s}
    return dataclasses.replace(mb, **sliced)


def whole_sequence(local: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[b, s/CP, ...] per-position values of every CP rank, back in sequence order [b, s, ...]
    (forward only: the log-probs the old-log-prob pass returns)."""
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    s = local.shape[1] * cp
    out = local.new_empty((local.shape[0], s, *local.shape[2:]))
    for r, part in enumerate(parts):
        out[:, rank_positions(s, cp, r).to(local.device)] = part
    return out


def causal_attention_over_gathered_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, cp_rank: int,
                                        scale: float | None, dropout: float, gqa: bool) -> torch.Tensor:
    """A CP rank's causal attention: q [b, heads, s/CP, d] at rank_positions(s, cp, cp_rank), k and v
    [b, groups, s, d] in all-gather order. The keys sorted by position, each of the rank's two
    chunks (starting at position `first`) attends to keys [0, first + chunk) lower-right causal:
    torch sends that to the flash kernel on CUDA, which takes grouped K/V heads as they are. A
    boolean [s/CP, s] mask would not: flash refuses masks and the efficient kernel grouped heads, so
    the math kernel ran and kept the probabilities (72 GiB for Qwen3-8B at CP=2 and 8k tokens,
    measured on an H100). Exact against the mask (tested)."""
    from torch.nn.attention.bias import causal_lower_right

    seq, chunk = k.shape[2], q.shape[2] // 2
    key_pos = torch.cat([rank_positions(seq, cp, r) for r in range(cp)]).to(q.device)
    order = torch.argsort(key_pos)
    k, v = k[:, :, order], v[:, :, order]
    outs = []
    for j, first in enumerate((cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk)):
        end = first + chunk
        outs.append(F.scaled_dot_product_attention(q[:, :, j * chunk:(j + 1) * chunk], k[:, :, :end], v[:, :, :end],
                                                   attn_mask=causal_lower_right(chunk, end), scale=scale,
                                                   dropout_p=dropout, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


class ContextParallelAttention(LocalCoreAttention):
    """megatron's core-attention interface (q, k, v [s/CP, b, heads, head dim] -> [s/CP, b, heads x
    value dim]) over the whole sequence's keys; no parameters. Causal: a query sees the keys at or
    before its position."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None):
        super().__init__(config, layer_number, attention_dropout, softmax_scale, pg_collection, k_channels, v_channels)
        from megatron.core import parallel_state as ps

        self.cp_group = ps.get_context_parallel_group()
        self.cp, self.cp_rank = self.cp_group.size(), self.cp_group.rank()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("context-parallel attention is causal over padded rows: no mask, bias or packed "
                             "sequences")
        local, b = query.shape[:2]
        # all-gather along the sequence (dim 0) over the CP ranks; backward: the gradients every rank's
        # queries gave each chunk's K and V, summed and scattered back to the chunk's rank
        key, value = (gather_from_sequence_parallel_region(x.contiguous(), True, self.cp_group) for x in (key, value))
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads (k, v: groups), s, d]
        out = causal_attention_over_gathered_keys(q, k, v, self.cp, self.cp_rank, self.scale,
                                                  self.dropout if self.training else 0.0, self.groups != self.heads)
        return out.permute(2, 0, 1, 3).reshape(local, b, self.heads * self.v_dim)


def with_context_parallel_attention(layer_spec):
    """A copy of a GPT layer spec (or a decoder block spec's layers) with this core attention."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(layer_spec)
    for layer in (spec.layer_specs if hasattr(spec, "layer_specs") else [spec]):
        layer.submodules.self_attention.submodules.core_attention = ModuleSpec(module=ContextParallelAttention)
    return spec
