"""Hugging Face <-> Megatron-Core names and tensor-parallel layouts (Qwen3, Qwen3-MoE, Qwen2, Llama,
DeepSeek-V3).

Megatron fuses q/k/v into `linear_qkv` with rows interleaved per KV group
([q heads of group 0, k_0, v_0, q heads of group 1, ...]; Qwen2's q/k/v biases the same way, into
`linear_qkv.bias`) and gate/up into `linear_fc1`
([gate; up]). A tensor-parallel rank holds whole KV groups of `linear_qkv` and
[gate_r; up_r] of `linear_fc1`, so each rank can be built from row/column slices of the HF
tensors without materialising the full model anywhere.

Experts (Qwen3-MoE): expert-parallel rank r holds experts [r * E/EP, (r + 1) * E/EP) as local
experts 0..E/EP-1 (`mlp.experts.local_experts.{i}.linear_fc1/2.weight` without Transformer
Engine, `mlp.experts.linear_fc1/2.weight{i}` with its grouped GEMM), each split over the
expert-tensor-parallel ranks like a dense MLP; the router `mlp.router.weight` is HF's
`mlp.gate.weight`, replicated.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from spice_megatron.entry import UserError
from spice_megatron.families import ModelSpec

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")

# read(hf_name, dim, start, stop) -> tensor; dim None reads the whole tensor.
Reader = Callable[[str, "int | None", "int | None", "int | None"], torch.Tensor]


class MappingError(UserError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


# Per-layer names: megatron suffix -> HF suffix, for the one-to-one tensors.
_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",  # local spec
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE spec (fused)
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_ROW_PARALLEL = {  # split along the input dimension (dim 1)
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
# Multi-head latent attention (DeepSeek-V3). The up-projections (and q_proj without a q latent) are
# column-parallel by whole heads; the down-projections are split by rows without Transformer Engine
# (megatron gathers their output before the latent norms) and whole on every rank with it.
_MLA_NORMS = {
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",  # local spec
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",  # TE spec (fused)
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
}
_MLA_HEADS = {  # column-parallel by heads
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
}
_MLA_DOWN = {
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
}
# the router's correction bias (a buffer in megatron, fixed during RL: policy/model.py moe_kwargs)
_EXPERT_BIAS = ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias")


def hf_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters, and the buffers an HF checkpoint holds too (the routers' correction
    biases): what import fills, export writes and the weight sync sends."""
    yield from model.named_parameters()
    for name, buf in model.named_buffers():
        if name.endswith(_EXPERT_BIAS[0]):
            yield name, buf


def mla_down_split() -> bool:
    """Whether megatron splits the latent down-projections over TP ranks (its local spec does)."""
    from spice_megatron.policy.model import have_transformer_engine

    return not have_transformer_engine()


def _one_to_one(rest: str, spec: ModelSpec) -> str | None:
    """The HF suffix of a per-layer tensor every rank holds whole."""
    if spec.mla is not None and rest in _MLA_NORMS:
        return _MLA_NORMS[rest]
    if rest in _NORMS:
        return _NORMS[rest]
    if rest == "mlp.router.weight":
        return "mlp.gate.weight"
    if rest == _EXPERT_BIAS[0]:
        return _EXPERT_BIAS[1]
    if rest in _MLA_DOWN and not mla_down_split():
        return _MLA_DOWN[rest]
    return None


@dataclass(frozen=True)
class ShardRanks:
    """Which slice of the model a rank holds: its tensor-parallel rank, and for experts its
    expert-parallel and expert-tensor-parallel ranks."""

    tp_rank: int = 0
    tp: int = 1
    ep_rank: int = 0
    ep: int = 1
    etp_rank: int = 0
    etp: int = 1

    @classmethod
    def of(cls, layout) -> "ShardRanks":
        return cls(layout.tp_rank, layout.tp, layout.ep_rank, layout.ep, layout.etp_rank, layout.etp)


def expert_param(rest: str) -> tuple[int, str] | None:
    """(local expert index, linear_fc1 or linear_fc2) of a layer's expert parameter, else None."""
    m = _EXPERT.match(rest)
    if not m:
        return None
    return (int(m.group(1)), m.group(2)) if m.group(1) is not None else (int(m.group(4)), m.group(3))


def is_expert(name: str) -> bool:
    m = LAYER.match(name)
    return bool(m) and expert_param(m.group(2)) is not None


def renumber_expert(name: str, first_expert: int) -> str:
    """A local expert parameter's name with its global expert index (+ first_expert)."""
    m = LAYER.match(name)
    found = expert_param(m.group(2)) if m else None
    if found is None:
        return name
    i, fc = found
    return f"decoder.layers.{m.group(1)}.mlp.experts.local_experts.{i + first_expert}.{fc}.weight"


def _chunk(n: int, tp: int, rank: int) -> tuple[int, int]:
    size = n // tp
    return rank * size, (rank + 1) * size


def megatron_shard(name: str, spec: ModelSpec, ranks: ShardRanks, layer_offset: int, read: Reader) -> torch.Tensor:
    """The shard of megatron parameter `name` (local layer and expert numbering) that `ranks`
    holds, from HF tensors."""
    tp_rank, tp = ranks.tp_rank, ranks.tp
    if name == "embedding.word_embeddings.weight":
        return read("model.embed_tokens.weight", 0, *_chunk(spec.vocab_size, tp, tp_rank))
    if name == "output_layer.weight":
        # With tied embeddings and PP > 1 the last stage keeps its own copy of the embedding.
        src = "model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
        return read(src, 0, *_chunk(spec.vocab_size, tp, tp_rank))
    if name == "decoder.final_layernorm.weight":
        return read("model.norm.weight", None, None, None)
    m = LAYER.match(name)
    if not m:
        raise MappingError(f"megatron parameter {name!r} has no Hugging Face counterpart")
    layer, rest = int(m.group(1)) + layer_offset, m.group(2)
    h = f"model.layers.{layer}."
    whole = _one_to_one(rest, spec)
    if whole is not None:
        return read(h + whole, None, None, None)
    if rest in _MLA_DOWN:
        rows = spec.mla.q_lora_rank if "q_down" in rest else spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
        return read(h + _MLA_DOWN[rest], 0, *_chunk(rows, tp, tp_rank))
    if rest in _MLA_HEADS:
        m_ = spec.mla
        per_head = m_.qk_nope_head_dim + (m_.v_head_dim if "kv_up" in rest else m_.qk_rope_head_dim)
        return read(h + _MLA_HEADS[rest], 0, *_chunk(spec.num_heads * per_head, tp, tp_rank))
    if rest == "mlp.shared_experts.linear_fc1.weight":
        part, e = _chunk(spec.moe.shared_expert_ffn_hidden_size, tp, tp_rank), h + "mlp.shared_experts."
        return torch.cat([read(e + "gate_proj.weight", 0, *part), read(e + "up_proj.weight", 0, *part)], dim=0)
    expert = expert_param(rest)
    if expert is not None:
        i, fc = expert
        e = f"{h}mlp.experts.{ranks.ep_rank * (spec.moe.num_experts // ranks.ep) + i}."
        part = _chunk(spec.moe.expert_ffn_hidden_size, ranks.etp, ranks.etp_rank)
        if fc == "linear_fc2":
            return read(e + "down_proj.weight", 1, *part)
        return torch.cat([read(e + "gate_proj.weight", 0, *part), read(e + "up_proj.weight", 0, *part)], dim=0)
    if rest in _ROW_PARALLEL:
        if rest.startswith("self_attention"):
            cols = spec.num_heads * (spec.mla.v_head_dim if spec.mla else spec.head_dim)
        else:
            cols = spec.moe.shared_expert_ffn_hidden_size if "shared_experts" in rest else spec.ffn_hidden_size
        return read(h + _ROW_PARALLEL[rest], 1, *_chunk(cols, tp, tp_rank))
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        suffix = rest.rsplit(".", 1)[1]
        groups = spec.num_kv_heads // tp
        per = spec.num_heads // spec.num_kv_heads
        hd = spec.head_dim
        g0 = tp_rank * groups
        q = read(f"{h}self_attn.q_proj.{suffix}", 0, g0 * per * hd, (g0 + groups) * per * hd)
        k = read(f"{h}self_attn.k_proj.{suffix}", 0, g0 * hd, (g0 + groups) * hd)
        v = read(f"{h}self_attn.v_proj.{suffix}", 0, g0 * hd, (g0 + groups) * hd)
        return interleave_qkv(q, k, v, groups, per, hd)
    if rest == "mlp.linear_fc1.weight":
        rows = _chunk(spec.ffn_hidden_size, tp, tp_rank)
        return torch.cat([read(h + "mlp.gate_proj.weight", 0, *rows), read(h + "mlp.up_proj.weight", 0, *rows)], dim=0)
    raise MappingError(f"megatron parameter {name!r} has no Hugging Face counterpart")


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, per: int, hd: int) -> torch.Tensor:
    tail = q.shape[1:]  # (hidden,) for weights, () for biases
    parts = [q.reshape(groups, per, hd, *tail), k.reshape(groups, 1, hd, *tail), v.reshape(groups, 1, hd, *tail)]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def hf_outputs(name: str, shape: tuple[int, ...], spec: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """The HF tensors (name, shape) that one full megatron tensor of `shape` becomes, global
    layer numbering; [] for what an HF checkpoint does not store (a tied output layer, TE extra state)."""
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", shape)]
    if name == "output_layer.weight":
        return [] if spec.tied_embeddings else [("lm_head.weight", shape)]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shape)]
    m = LAYER.match(name)
    if not m:
        raise MappingError(f"megatron parameter {name!r} has no Hugging Face counterpart")
    h, rest = f"model.layers.{m.group(1)}.", m.group(2)
    whole = _one_to_one(rest, spec)
    if whole is not None:
        return [(h + whole, shape)]
    if rest in _MLA_DOWN:
        return [(h + _MLA_DOWN[rest], shape)]
    if rest in _MLA_HEADS:
        return [(h + _MLA_HEADS[rest], shape)]
    if rest == "mlp.shared_experts.linear_fc1.weight":
        half = (shape[0] // 2, *shape[1:])
        return [(h + "mlp.shared_experts.gate_proj.weight", half), (h + "mlp.shared_experts.up_proj.weight", half)]
    expert = expert_param(rest)
    if expert is not None:  # global expert numbering (renumber_expert)
        e = f"{h}mlp.experts.{expert[0]}."
        if expert[1] == "linear_fc2":
            return [(e + "down_proj.weight", shape)]
        half = (shape[0] // 2, *shape[1:])
        return [(e + "gate_proj.weight", half), (e + "up_proj.weight", half)]
    if rest in _ROW_PARALLEL:
        return [(h + _ROW_PARALLEL[rest], shape)]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        suffix, tail = rest.rsplit(".", 1)[1], tuple(shape[1:])
        q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return [(f"{h}self_attn.q_proj.{suffix}", (q_rows, *tail)), (f"{h}self_attn.k_proj.{suffix}", (kv_rows, *tail)),
                (f"{h}self_attn.v_proj.{suffix}", (kv_rows, *tail))]
    if rest == "mlp.linear_fc1.weight":
        half = (shape[0] // 2, *shape[1:])
        return [(h + "mlp.gate_proj.weight", half), (h + "mlp.up_proj.weight", half)]
    if rest.endswith("_extra_state"):
        return []
    raise MappingError(f"megatron parameter {name!r} has no Hugging Face counterpart")


def full_shape(name: str, local_shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape of megatron parameter `name` gathered over `tp` ranks (for an expert: its
    expert-tensor-parallel ranks)."""
    dim, _ = gather_layout(name)
    if dim is None or tp == 1:
        return tuple(local_shape)
    shape = list(local_shape)
    shape[dim] *= tp
    return tuple(shape)


def shard_destination(name: str, outputs: list[torch.Tensor], tp_rank: int, tp: int) -> torch.Tensor | None:
    """Where a shard lands when it is one contiguous block of one HF tensor (vocab-parallel
    embeddings and output layers, replicated tensors): it can be received straight into place."""
    dim, glu = gather_layout(name)
    if dim is None:
        return outputs[0]
    if dim == 0 and not glu and len(outputs) == 1:
        return outputs[0].view(tp, -1, *outputs[0].shape[1:])[tp_rank]
    return None


def place_shard(name: str, shard: torch.Tensor, tp_rank: int, tp: int, spec: ModelSpec,
                outputs: list[torch.Tensor]) -> None:
    """Copy TP shard `tp_rank` of megatron parameter `name` into the full HF tensors `outputs`
    (as listed by hf_outputs): one strided copy per output, no intermediate full tensor."""
    direct = shard_destination(name, outputs, tp_rank, tp)
    if direct is not None:
        if direct.data_ptr() != shard.data_ptr():
            direct.copy_(shard)
        return
    dim, glu = gather_layout(name)
    if dim == 1:  # [rows, tp * cols_r]: shard r is the r-th column block
        rows, cols = shard.shape
        outputs[0].view(rows, tp, cols)[:, tp_rank].copy_(shard)
    elif glu:  # shard r is [gate_r; up_r]
        gate, up = shard.chunk(2, dim=0)
        outputs[0].view(tp, *gate.shape)[tp_rank].copy_(gate)
        outputs[1].view(tp, *up.shape)[tp_rank].copy_(up)
    else:  # linear_qkv: shard r holds whole KV groups, rows [q heads of the group, k, v] per group
        q, k, v = outputs
        per, hd, tail = spec.num_heads // spec.num_kv_heads, spec.head_dim, tuple(shard.shape[1:])
        x = shard.view(-1, per + 2, hd, *tail)
        groups = x.shape[0]
        q.view(tp, groups, per, hd, *tail)[tp_rank].copy_(x[:, :per])
        k.view(tp, groups, hd, *tail)[tp_rank].copy_(x[:, per])
        v.view(tp, groups, hd, *tail)[tp_rank].copy_(x[:, per + 1])


def gather_layout(name: str) -> tuple[int | None, bool]:
    """(TP partition dim or None when replicated, whether shards are [gate_r; up_r] pairs)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0, False
    m = LAYER.match(name)
    rest = m.group(2) if m else ""
    expert = expert_param(rest)
    if expert is not None:
        return (1, False) if expert[1] == "linear_fc2" else (0, True)
    if rest in _ROW_PARALLEL:
        return 1, False
    if rest.startswith("self_attention.linear_qkv.") and not rest.endswith("layer_norm_weight"):
        return 0, False
    if rest in _MLA_HEADS or (rest in _MLA_DOWN and mla_down_split()):
        return 0, False
    if rest in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
        return 0, True
    return None, False


def expected_hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this architecture holds, with its shape."""
    h, hd, ffn, v = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size, spec.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not spec.tied_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if spec.mla is None:
            shapes.update({
                p + "self_attn.q_proj.weight": (spec.num_heads * hd, h),
                           p + "self_attn.k_proj.weight": (spec.num_kv_heads * hd, h),
                p + "self_attn.v_proj.weight": (spec.num_kv_heads * hd, h),
                           p + "self_attn.o_proj.weight": (h, spec.num_heads * hd),
            })
        else:
            shapes.update(_mla_shapes(spec, p))
        if spec.moe is not None and spec.moe.moe_layers[layer]:
            e_ffn = spec.moe.expert_ffn_hidden_size
            shapes[p + "mlp.gate.weight"] = (spec.moe.num_experts, h)
            if spec.moe.expert_bias:
                shapes[p + "mlp.gate.e_score_correction_bias"] = (spec.moe.num_experts,)
            if spec.moe.shared_expert_ffn_hidden_size:
                s_ffn, q = spec.moe.shared_expert_ffn_hidden_size, p + "mlp.shared_experts."
                shapes.update({q + "gate_proj.weight": (s_ffn, h), q + "up_proj.weight": (s_ffn, h),
                               q + "down_proj.weight": (h, s_ffn)})
            for e in range(spec.moe.num_experts):
                q = f"{p}mlp.experts.{e}."
                shapes.update({q + "gate_proj.weight": (e_ffn, h), q + "up_proj.weight": (e_ffn, h),
                               q + "down_proj.weight": (h, e_ffn)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                           p + "mlp.down_proj.weight": (h, ffn)})
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if spec.qkv_bias:
            for x, n in (("q", spec.num_heads), ("k", spec.num_kv_heads), ("v", spec.num_kv_heads)):
                shapes[p + f"self_attn.{x}_proj.bias"] = (n * hd,)
    return shapes


def _mla_shapes(spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    m, h, n = spec.mla, spec.hidden_size, spec.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    a = p + "self_attn."
    shapes = {a + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
              a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
              a + "kv_b_proj.weight": (n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
              a + "o_proj.weight": (h, n * m.v_head_dim)}
    if m.q_lora_rank is None:
        shapes[a + "q_proj.weight"] = (n * qk, h)
    else:
        shapes.update({a + "q_a_proj.weight": (m.q_lora_rank, h), a + "q_a_layernorm.weight": (m.q_lora_rank,),
                       a + "q_b_proj.weight": (n * qk, m.q_lora_rank)})
    return shapes
