"""The learner's forward on shared-prefix packed rows (policy/packing.py): core attention, rotary
positions and logits only where a token is scored.

Core attention: Prefix Grouper's decomposition (arXiv 2506.05433): each prefix attends to itself
causally, each completion attends over [its prefix; itself], causally in its own part; nothing else
is computed, so a completion can never see another completion. q, k and v are split once into the
row's segments (the pads at the row's end are one segment); each piece is one call of torch's
`scaled_dot_product_attention` with its own grouped-query attention (K/V at their KV heads): a
prefix causal over itself (`is_causal`), a completion over [prefix; own keys] with the causal
bias aligned to the lower right (`causal_lower_right`: every prefix key, its own keys causally).
On GPU both go to the flash kernel, with no mask in memory; on CPU to the fused CPU kernel. A
completion's piece is recomputed in the backward (torch's checkpoint, its inputs are views), so
the [prefix; own] K/V it concatenates is never kept: what a row saves is q, k, v, the prefixes'
outputs and the log-sum-exps, within the planner's attention terms; the recompute is the
completions' attention forward again (a few % of a step). It replaces megatron's core attention
(local DotProductAttention or TEDotProductAttention) in the layer spec; the q/k/v projections,
rotary embedding and output projection stay megatron's, Transformer Engine's on GPU. A forward without a row structure
(attention_mask None) is plain causal attention.

Rotary embedding: megatron's GPTModel applies RoPE at positions 0..S-1 of the row and ignores
position_ids; `PackedForward` makes the model's RotaryEmbedding return its table at the row's
position ids instead. Output layer: the final hidden states are gathered at the scored positions
before the vocabulary projection (under sequence parallelism after gathering the sequence, as
megatron's own last-token inference path does), so the vocab-parallel log-softmax runs on n
scored tokens, not on S positions.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

from spice_megatron.policy.batching import MicroBatch
from spice_megatron.policy.logprobs import token_logprobs

# a row structure tensor carries its parsed segments as an attribute: built by the first layer that
# reads it, read by every other (and gone with the tensor)
_PARSED = "_spice_segments"


def row_segments(structure: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(prefix start, prefix end, segment start, segment end) of each run of positions that share
    a prefix and a segment; a prefix (or the row's pads) has segment start == prefix start."""
    cached = getattr(structure, _PARSED, None)
    if cached is not None:
        return cached
    prefix_start, prefix_end, own = structure.tolist()
    segments: list[tuple[int, int, int, int]] = []
    t = 0
    while t < len(own):
        end = t + 1
        while end < len(own) and own[end] == own[t] and prefix_start[end] == prefix_start[t]:
            end += 1
        segments.append((prefix_start[t], prefix_end[t], t, end))
        t = end
    setattr(structure, _PARSED, segments)
    return segments


class LocalCoreAttention(MegatronModule):
    """What the project's core attentions (this one, context_parallel.py's) take from megatron's
    core-attention interface: this TP rank's heads and KV groups, key and value head sizes, softmax
    scale and dropout; no parameters."""

    def __init__(self, config, layer_number: int, attention_dropout: float | None, softmax_scale: float | None,
                 pg_collection, k_channels: int | None, v_channels: int | None):
        super().__init__(config=config)
        from megatron.core import parallel_state as ps

        tp = pg_collection.tp.size() if pg_collection is not None else ps.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        # multi-latent attention's keys (nope + rope dims) are wider than its values
        self.head_dim = k_channels or config.kv_channels
        self.v_dim = v_channels or config.kv_channels
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        if config.apply_query_key_layer_scaling:
            scale /= max(1, layer_number)
        self.scale = scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout


class SharedPrefixAttention(LocalCoreAttention):
    """megatron's core-attention interface (q, k, v [s, b, heads, head dim] -> [s, b, heads x head
    dim]) over a packed row's segments; no parameters."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, kernel: str = "sdpa",
                 k_channels: int | None = None, v_channels: int | None = None):
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("train.shared_prefix: context parallelism splits the row's sequence; not supported")
        super().__init__(config, layer_number, attention_dropout, softmax_scale, pg_collection, k_channels, v_channels)
        self.kernel = kernel  # train.shared_prefix_kernel
        if kernel == "flex" and self.dropout:
            raise ValueError("train.shared_prefix_kernel: flex has no attention dropout; use sdpa")
        # megatron recomputes this whole module (recompute_modules core_attn): nothing to save twice
        self.recomputed = (getattr(config, "recompute_granularity", None) == "selective"
                           and "core_attn" in (getattr(config, "recompute_modules", None) or []))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("shared-prefix attention takes neither an attention bias nor packed_seq_params")
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads (k, v: groups), s, d]
        gqa = self.groups != self.heads  # SDPA's own grouped-query attention: megatron's head order
        p = self.dropout if self.training else 0.0
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, dropout_p=p,
                                                 enable_gqa=gqa)
        else:
            if b != 1:
                raise ValueError(f"a shared-prefix packed micro-batch is one row, got {b}")
            if self.kernel == "flex":
                out = _flex()(q, k, v, block_mask=_block_mask(attention_mask, q.device), scale=self.scale,
                              enable_gqa=gqa)
                return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v_dim)
            segments = row_segments(attention_mask)
            # one split per tensor (its backward is one cat), not a slice per segment (a row-sized
            # gradient per slice); K/V stay at their KV heads, never expanded or copied per head
            sizes = [end - start for _, _, start, end in segments]
            qs, ks, vs = q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2)
            at = {start: i for i, (_, _, start, _) in enumerate(segments)}
            pieces = []
            for i, (prefix_start, prefix_end, start, end) in enumerate(segments):
                if start == prefix_start:  # a prefix (or the pads), causal over itself
                    pieces.append(F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=True,
                                                                 scale=self.scale, dropout_p=p, enable_gqa=gqa))
                    continue
                args = (qs[i], ks[at[prefix_start]], ks[i], vs[at[prefix_start]], vs[i], self.scale, p, gqa)
                if torch.is_grad_enabled() and not self.recomputed:  # saves its inputs (views) alone
                    pieces.append(checkpoint(_completion_attention, *args, use_reentrant=False))
                else:
                    pieces.append(_completion_attention(*args))
            out = torch.cat(pieces, dim=2)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v_dim)


_FLEX = {}


def _flex():
    """torch's flex_attention, compiled on a GPU (its eager form is a reference implementation that
    materialises the scores), as is on CPU (forward only there)."""
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["fn"] = torch.compile(flex_attention, dynamic=True) if torch.cuda.is_available() else flex_attention
    return _FLEX["fn"]


def _block_mask(structure: torch.Tensor, device: torch.device):
    """The row's FlexAttention block mask, built once per micro-batch and device: a query sees its
    prefix whole if it is a completion's, and its own segment up to itself (a prefix, or the pads,
    causally over itself). Fully masked blocks are skipped by the kernel."""
    from torch.nn.attention.flex_attention import create_block_mask

    cache = structure.__dict__.setdefault("_spice_block_mask", {})
    if str(device) not in cache:
        prefix_start, prefix_end, own = structure.to(device=device, dtype=torch.int64)
        completion = own != prefix_start

        def visible(b, h, q, kv):
            in_prefix = (kv >= prefix_start[q]) & (kv < prefix_end[q]) & completion[q]
            return in_prefix | ((kv >= own[q]) & (kv <= q))

        n = structure.shape[1]
        cache[str(device)] = create_block_mask(visible, None, None, n, n, device=device)
    return cache[str(device)]


def _completion_attention(q, prefix_k, own_k, prefix_v, own_v, scale: float, dropout: float, gqa: bool):
    """A completion's queries over [prefix; own] keys: every prefix key, the own keys causally, i.e.
    causal aligned to the lower right of the [n, prefix + n] scores (torch dispatches it to its
    flash kernel without a mask in memory)."""
    n, total = q.shape[2], prefix_k.shape[2] + own_k.shape[2]
    return F.scaled_dot_product_attention(q, torch.cat([prefix_k, own_k], dim=2), torch.cat([prefix_v, own_v], dim=2),
                                          attn_mask=causal_lower_right(n, total), scale=scale, dropout_p=dropout,
                                          enable_gqa=gqa)


def with_shared_prefix_attention(layer_spec, kernel: str = "sdpa"):
    """A copy of a GPT layer spec (or a decoder block spec's layers) with this core attention."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(layer_spec)
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = ModuleSpec(module=SharedPrefixAttention,
                                                                               params={"kernel": kernel})
    return spec


class PackedForward:
    """The micro-batch facts megatron's rotary embedding and output layer read during one model
    call (set before it, cleared after): the row's position ids and the scored positions. `models`:
    this rank's model chunks (one unless parallel.virtual_pipeline > 1)."""

    def __init__(self, models: list, tp_group):
        self.positions: torch.Tensor | None = None
        self.score_index: torch.Tensor | None = None
        self.max_positions = int(getattr(models[0], "max_sequence_length", 0) or 0)
        for model in models:
            rope = getattr(model, "rotary_pos_emb", None)
            if rope is not None:
                rope.forward = self._rope_forward(rope.forward)
            layer = getattr(model, "output_layer", None)
            if layer is not None:
                layer.forward = self._output_forward(layer, layer.forward, tp_group)

    def set(self, mb: MicroBatch, device: torch.device) -> None:
        packed = mb.score_index is not None
        self.positions = mb.position_ids[0].to(device) if packed else None
        self.score_index = mb.score_index.to(device) if packed else None

    def clear(self) -> None:
        self.positions = self.score_index = None

    def _rope_forward(self, original):
        def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
            if self.positions is None:
                return original(max_seq_len, offset, packed_seq, cp_group)
            if self.positions.numel() != max_seq_len:
                raise ValueError(f"rotary embedding for {max_seq_len} positions, the packed row has "
                                 f"{self.positions.numel()}")
            # one table (lru-cached by megatron) at every position the model can take
            table = original(max(self.max_positions, int(self.positions.max()) + 1), 0, False, cp_group)
            return table[self.positions.to(table.device)]
        return forward

    def _output_forward(self, layer, original, tp_group):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        def forward(hidden, *args, **kwargs):
            if self.score_index is None:
                return original(hidden, *args, **kwargs)
            sequence_parallel = layer.sequence_parallel
            if sequence_parallel:
                # backward: each rank keeps its chunk of the gradient; the layer's own input copy
                # (sequence parallelism off below) all-reduces it over the TP ranks first
                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                              group=tp_group)
            hidden = hidden[self.score_index.to(hidden.device)]
            layer.sequence_parallel = False
            try:
                return original(hidden, *args, **kwargs)
            finally:
                layer.sequence_parallel = sequence_parallel
        return forward


def scored_logprobs(mb: MicroBatch, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p of the scored tokens, laid out like mb.loss_mask: [b, s] for an unshared micro-batch,
    [b, longest completion] for a packed one (logits [1, n, V/TP] at its scored positions)."""
    lp = token_logprobs(logits, mb.labels.to(logits.device), temperature)
    if mb.score_index is None:
        return lp
    dev = lp.device
    out = lp.new_zeros(mb.loss_mask.shape)
    return out.index_put((mb.score_rows.to(dev), mb.score_cols.to(dev)), lp[0])
