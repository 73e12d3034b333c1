"""A megatron-core GPTModel from a Hugging Face config.json (the families of FAMILIES: Qwen3, Qwen3-MoE,
Qwen2/2.5, Llama 3, DeepSeek-V3 and GLM-4.5)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from spice_megatron.entry import UserError, read_json
from spice_megatron.config import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    qkv_bias: bool  # biases on q/k/v projections (Qwen2)
    examples: str = ""  # checkpoints of the architecture (docs/checkpoints.md's table)
    experts: bool = False  # mixture-of-experts layers
    mla: bool = False  # multi-head latent attention (DeepSeek-V2/V3)


# HF architecture name -> family (docs/checkpoints.md's supported-families table is generated from it).
FAMILIES: dict[str, Family] = {
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True, qkv_bias=False, examples="Qwen3-4B/8B/14B-Base, Qwen3-32B"),
    "LlamaForCausalLM": Family("llama", qk_norm=False, qkv_bias=False,
                               examples="Llama 3.x, OctoThinker, SmolLM2 (llama3 rope scaling or none)"),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", qk_norm=True, qkv_bias=False, experts=True,
                                  examples="Qwen3-30B-A3B-Base, Qwen3-235B-A22B (no shared experts)"),
    # q/k/v biases (attention_bias), q/k norms where use_qk_norm, rotary on part of each head
    # (partial_rotary_factor), DeepSeek-V3's routing and shared experts
    "Glm4MoeForCausalLM": Family("glm4_moe", qk_norm=False, qkv_bias=True, experts=True,
                                 examples="GLM-4.5, GLM-4.5-Air (multi-token-prediction layers skipped)"),
    # latent attention, sigmoid routing with a correction bias over expert groups, shared experts
    "DeepseekV3ForCausalLM": Family("deepseek_v3", qk_norm=False, qkv_bias=False, experts=True, mla=True,
                                    examples="DeepSeek-V3(-Base), DeepSeek-R1, Kimi-K2, Moonlight (bf16 or FP8 "
                                             "block-scaled; multi-token-prediction layers skipped)"),
    # biases on q/k/v (not on o_proj)
    "Qwen2ForCausalLM": Family("qwen2", qk_norm=False, qkv_bias=True,
                               examples="Qwen2, Qwen2.5, Qwen2.5-Math, DeepSeek-R1-Distill-Qwen (no sliding window)"),
}
MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts facts of an HF config (Qwen3-MoE: no shared experts)."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int  # moe_intermediate_size
    # True: the top-k probabilities are renormalised to sum to 1 (softmax over the k chosen logits);
    # False: they keep their share of the softmax over all experts
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP of intermediate_size
    score_function: str = "softmax"  # DeepSeek-V3: "sigmoid"
    expert_bias: bool = False  # DeepSeek-V3's e_score_correction_bias: added to the scores that choose experts
    num_groups: int | None = None  # n_group: experts in groups, tokens routed within topk_group of them
    group_topk: int | None = None
    scaling_factor: float | None = None  # routed_scaling_factor
    shared_expert_ffn_hidden_size: int = 0  # n_shared_experts x moe_intermediate_size

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)


def _deepseek_moe_spec(config: dict, num_layers: int) -> MoESpec:
    """DeepSeek-V3's router: sigmoid scores, plus a correction bias where experts are chosen, the
    chosen scores normalised and scaled by routed_scaling_factor; group-limited top-k. megatron
    scores a group by its top num_experts_per_tok / topk_group experts, DeepSeek-V3 by its top 2:
    the same for every published config, and checked."""
    top_k, groups, group_topk = int(config["num_experts_per_tok"]), int(config.get("n_group") or 1), \
        int(config.get("topk_group") or 1)
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedModelError(f"scoring_func={config['scoring_func']!r} is not supported (sigmoid)")
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedModelError(f"topk_method={config['topk_method']!r} is not supported (noaux_tc)")
    if not config.get("norm_topk_prob", True):
        raise UnsupportedModelError("norm_topk_prob=false is not supported with sigmoid routing (megatron normalises)")
    if groups > 1 and top_k // group_topk != 2:
        raise UnsupportedModelError(f"num_experts_per_tok={top_k} over topk_group={group_topk}: megatron scores a "
                                    f"group by its top {top_k // group_topk} experts, DeepSeek-V3 by its top 2")
    first_dense, freq = int(config.get("first_k_dense_replace", 0)), int(config.get("moe_layer_freq", 1) or 1)
    ffn = int(config["moe_intermediate_size"])
    return MoESpec(num_experts=int(config["n_routed_experts"]), top_k=top_k, expert_ffn_hidden_size=ffn,
                   norm_topk_prob=True, moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
                   score_function="sigmoid", expert_bias=True, num_groups=groups if groups > 1 else None,
                   group_topk=group_topk if groups > 1 else None,
                   scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
                   shared_expert_ffn_hidden_size=int(config.get("n_shared_experts") or 0) * ffn)


def _moe_spec(config: dict, num_layers: int) -> MoESpec:
    # transformers 5 writes num_local_experts; the hub's Qwen3-MoE configs say num_experts
    experts = config.get("num_experts", config.get("num_local_experts"))
    if not experts:
        raise UnsupportedModelError("Qwen3MoeForCausalLM: config.json names no num_experts")
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("shared experts (shared_expert_intermediate_size) are not supported")
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1) or 1)
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return MoESpec(num_experts=int(experts), top_k=int(config["num_experts_per_tok"]),
                   expert_ffn_hidden_size=int(config["moe_intermediate_size"]),
                   norm_topk_prob=bool(config.get("norm_topk_prob", True)), moe_layers=layers)


class UnsupportedModelError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V3): q and k/v through low-rank latents; each head's
    query and key are a no-position part and a rotary part, its value v_head_dim wide."""

    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite, Moonlight)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool


@dataclass(frozen=True)
class YarnSpec:
    """YaRN rope scaling (DeepSeek-V3's rope_scaling)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the learner and the bridge need, read from an HF config."""

    architecture: str
    family: Family
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    rms_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # llama3-style scaling, None when absent
    max_position_embeddings: int
    hf_config: dict
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    yarn: YarnSpec | None = None
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3; GLM-4.5 where use_qk_norm)
    qkv_bias: bool = False  # biases on q/k/v (Qwen2; GLM-4.5 where attention_bias)
    rotary_percent: float = 1.0  # the share of each head's dims that rotates (GLM-4.5: 0.5)

    def _attention_count(self) -> int:
        h = self.hidden_size
        if self.mla is None:
            return h * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads) \
                + (self.head_dim * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0) \
                + (2 * self.head_dim if self.qk_norm else 0)
        m, n = self.mla, self.num_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = h * n * qk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank \
            + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + n * m.v_head_dim * h

    def _count(self, experts_per_layer: int) -> int:
        attn = self._attention_count()
        emb = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        norms = 2 * self.hidden_size
        dense_mlp = 3 * self.hidden_size * self.ffn_hidden_size
        total = self.num_layers * (attn + norms) + emb + self.hidden_size
        if self.moe is None:
            return total + self.num_layers * dense_mlp
        moe_mlp = (experts_per_layer * self.moe.expert_ffn_hidden_size + self.moe.shared_expert_ffn_hidden_size) \
            * 3 * self.hidden_size + self.moe.num_experts * self.hidden_size  # + the router
        return total + self.moe.num_moe_layers * moe_mlp + (self.num_layers - self.moe.num_moe_layers) * dense_mlp

    @property
    def num_parameters(self) -> int:
        return self._count(self.moe.num_experts if self.moe else 0)

    @property
    def active_parameters(self) -> int:
        """Parameters one token goes through: the top-k experts of each MoE layer, not all."""
        return self._count(self.moe.top_k if self.moe else 0)


def _rope(cfg: dict, yarn_ok: bool = False) -> tuple[float, float | None, YarnSpec | None]:
    params = cfg.get("rope_parameters") or {}  # transformers >= 5
    scaling = cfg.get("rope_scaling") or params
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None, None
    if rope_type == "yarn" and yarn_ok:  # megatron has YaRN in its latent attention only
        return float(theta), None, YarnSpec(
            factor=float(scaling["factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            beta_fast=float(scaling.get("beta_fast", 32)), beta_slow=float(scaling.get("beta_slow", 1)),
            mscale=float(scaling.get("mscale", 1.0)), mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)))
    if rope_type != "llama3":
        supported = "default, llama3" + (", yarn" if yarn_ok else "")
        raise UnsupportedModelError(f"rope_scaling.rope_type={rope_type!r} is not supported ({supported})")
    # megatron-core implements llama3 scaling with these constants only.
    expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for key, value in expected.items():
        if float(scaling.get(key, value)) != value:
            raise UnsupportedModelError(f"rope_scaling.{key}={scaling[key]} differs from megatron-core's fixed {value}")
    return float(theta), float(scaling["factor"]), None


def model_spec_from_hf(config: dict | str) -> ModelSpec:
    """From a config dict, a config.json path or an HF model directory."""
    where = "config"
    if isinstance(config, str):
        where = os.path.join(config, "config.json") if os.path.isdir(config) else config
        config = read_json(where, " (an HF model directory has a config.json)")
    try:
        return _spec(config)
    except KeyError as e:
        arch = (config.get("architectures") or [config.get("model_type")])[0]
        raise UnsupportedModelError(f"{where}: field {e.args[0]!r} is missing ({arch} needs it)") from None
    except UnsupportedModelError as e:
        if where == "config":
            raise
        raise UnsupportedModelError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise UnsupportedModelError(f"{where}: a field has the wrong type ({e})") from None


def _spec(config: dict) -> ModelSpec:
    archs = config.get("architectures") or [MODEL_TYPES.get(config.get("model_type", ""), "")]
    arch = archs[0]
    if arch not in FAMILIES:
        raise UnsupportedModelError(f"architecture {arch or config.get('model_type')!r} is not supported; "
                                    f"supported: {', '.join(sorted(FAMILIES))}")
    family = FAMILIES[arch]
    fp8_block_size(config)  # refuses what the import cannot dequantize
    glm = family.name == "glm4_moe"
    if config.get("attention_bias", False) and not family.qkv_bias:
        raise UnsupportedModelError(f"{arch} with attention_bias=true is not supported")
    if config.get("mlp_bias", False):
        raise UnsupportedModelError(f"{arch} with mlp_bias=true is not supported")
    if config.get("use_sliding_window", False):  # Qwen2's configs carry the switch, off in every published one
        raise UnsupportedModelError(f"{arch} with use_sliding_window=true is not supported (full attention only: "
                                    "set it to false, as Qwen2.5's published configs do)")
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    theta, scaling, yarn = _rope(config, yarn_ok=family.mla)
    mla = None
    if family.mla:
        mla = MLASpec(q_lora_rank=config.get("q_lora_rank") or None, kv_lora_rank=int(config["kv_lora_rank"]),
                      qk_nope_head_dim=int(config["qk_nope_head_dim"]),
                      qk_rope_head_dim=int(config["qk_rope_head_dim"]),
                      v_head_dim=int(config["v_head_dim"]), rope_interleave=bool(config.get("rope_interleave", True)))
        if not mla.rope_interleave:  # megatron's latent attention de-interleaves the rotary dims, as HF's V3 does
            raise UnsupportedModelError(f"{arch} with rope_interleave=false is not supported")
    moe = None
    if family.experts:
        moe = _deepseek_moe_spec(config, layers) if family.mla or glm else _moe_spec(config, layers)
    return ModelSpec(
        architecture=arch, family=family, num_layers=layers, hidden_size=config["hidden_size"],
        # latent attention expands its keys and values to every head
        num_heads=heads, num_kv_heads=heads if mla else config.get("num_key_value_heads") or heads,
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla else
        config.get("head_dim") or config["hidden_size"] // heads,
        ffn_hidden_size=config["intermediate_size"], vocab_size=config["vocab_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), rms_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling_factor=scaling,
        max_position_embeddings=config.get("max_position_embeddings", 4096), hf_config=config,
        moe=moe, mla=mla, yarn=yarn,
        qk_norm=bool(config.get("use_qk_norm", False)) if glm else family.qk_norm,
        qkv_bias=bool(config.get("attention_bias", False)) if glm else family.qkv_bias,
        rotary_percent=float(config.get("partial_rotary_factor",
                                        (config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))))


def fp8_block_size(config: dict) -> tuple[int, int] | None:
    """The block of an FP8 block-scaled checkpoint's weight_scale_inv (DeepSeek-V3's published
    format: e4m3 weights, one fp32 scale per 128x128 block), None when unquantized; any other
    quantization is refused."""
    q = config.get("quantization_config")
    if not q:
        return None
    method, block = q.get("quant_method"), q.get("weight_block_size")
    if method != "fp8" or q.get("fmt", "e4m3") != "e4m3" or not (isinstance(block, list) and len(block) == 2):
        raise UnsupportedModelError(f"quantization_config: quant_method={method!r}, fmt={q.get('fmt')!r}, "
                                    f"weight_block_size={block!r} is not supported (fp8 e4m3 with block scales, "
                                    "dequantized to bf16 on import; or an unquantized checkpoint)")
    return int(block[0]), int(block[1])


def pipeline_stage_layers(num_layers: int, pp: int, first: int = 0, last: int = 0) -> list[int]:
    """Layers per pipeline stage: `first` and `last` (0: not set) on the end stages, the rest split
    evenly over the others, as megatron builds them; a split that does not come out even is refused
    naming the field."""
    if not first and not last:
        if num_layers % pp:
            raise ConfigError(f"parallel.pipeline_parallel: {pp} does not divide num_hidden_layers={num_layers}; "
                              "an uneven split takes parallel.first_stage_layers / last_stage_layers")
        return [num_layers // pp] * pp
    middle, rest = pp - bool(first) - bool(last), num_layers - first - last
    if middle < 0 or rest < 0 or (middle == 0 and rest) or (middle and (rest <= 0 or rest % middle)):
        raise ConfigError(f"parallel.first_stage_layers / last_stage_layers: {first} and {last} of "
                          f"num_hidden_layers={num_layers} leave {rest} for {middle} middle stage(s) of "
                          f"pipeline_parallel={pp}: that must split evenly, at least one layer each")
    even = rest // middle if middle else 0
    return ([first] if first else []) + [even] * middle + ([last] if last else [])


def check_parallel_layout(spec: ModelSpec, tp: int, pp: int, ep: int = 1, etp: int = 1, first_stage_layers: int = 0,
                          last_stage_layers: int = 0, vpp: int = 1) -> None:
    """Divisibility the layout needs; the error names the config field at fault."""
    if spec.moe is None and (ep > 1 or etp > 1):
        raise ConfigError(f"parallel.expert_parallel: {spec.architecture} has no experts; expert_parallel and "
                          "expert_tensor_parallel must be 1")
    if spec.moe is not None:
        if spec.moe.num_experts % ep:
            raise ConfigError(f"parallel.expert_parallel: {ep} does not divide num_experts={spec.moe.num_experts}")
        if spec.moe.expert_ffn_hidden_size % etp:
            raise ConfigError(f"parallel.expert_tensor_parallel: {etp} does not divide "
                              f"moe_intermediate_size={spec.moe.expert_ffn_hidden_size}")
    if spec.num_heads % tp:
        raise ConfigError(f"parallel.tensor_parallel: {tp} does not divide num_attention_heads={spec.num_heads}")
    if spec.num_kv_heads % tp:
        raise ConfigError(f"parallel.tensor_parallel: {tp} does not divide num_key_value_heads={spec.num_kv_heads}")
    if spec.ffn_hidden_size % tp:
        raise ConfigError(f"parallel.tensor_parallel: {tp} does not divide intermediate_size={spec.ffn_hidden_size}")
    if spec.vocab_size % tp:
        raise ConfigError(f"parallel.tensor_parallel: {tp} does not divide vocab_size={spec.vocab_size}")
    pipeline_stage_layers(spec.num_layers, pp, first_stage_layers, last_stage_layers)
    if vpp > 1 and spec.num_layers % (pp * vpp):
        raise ConfigError(f"parallel.virtual_pipeline: pipeline_parallel x virtual_pipeline = {pp} x {vpp} does not "
                          f"divide num_hidden_layers={spec.num_layers}")
    if spec.moe is not None and spec.moe.shared_expert_ffn_hidden_size % tp:
        raise ConfigError(f"parallel.tensor_parallel: {tp} does not divide the shared experts' "
                          f"{spec.moe.shared_expert_ffn_hidden_size} (n_shared_experts x moe_intermediate_size)")
    if spec.mla is not None:  # without Transformer Engine megatron splits the latent down-projections over TP
        for field, n in (("q_lora_rank", spec.mla.q_lora_rank), ("kv_lora_rank + qk_rope_head_dim",
                                                                 spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim)):
            if n and n % tp:
                raise ConfigError(f"parallel.tensor_parallel: {tp} does not divide {field}={n}")


def have_transformer_engine() -> bool:
    """megatron-core's own verdict (it imports TE and checks it works), and a GPU to run it."""
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception:  # a broken TE build can fail megatron's import of it
        return False
    return bool(HAVE_TE) and torch.cuda.is_available()


def moe_kwargs(spec: ModelSpec, ep: int, etp: int, aux_loss_coeff: float = 0.0,
               routing_replay: bool = False, expert_bias_update_rate: float = 0.0) -> dict[str, Any]:
    """megatron's MoE settings for a Qwen3-MoE config. Qwen3's router: softmax over all experts in
    fp32, top-k, then (norm_topk_prob) renormalised; megatron's softmax router computes the same
    as top-k on the logits then a softmax over the k (moe_router_pre_softmax=False), and as
    softmax-then-top-k without renormalising when pre_softmax is True."""
    moe = spec.moe
    deepseek = dict(
        # the correction bias is the checkpoint's and stays fixed unless train.moe_expert_bias_update_rate
        # says otherwise: megatron's auxiliary-loss-free balancing moves it after a step by the batch's loads
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=expert_bias_update_rate,
        moe_router_num_groups=moe.num_groups, moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
    ) if moe.score_function == "sigmoid" else {}
    return dict(
        **deepseek,
        num_moe_experts=moe.num_experts, moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.score_function == "softmax" and not moe.norm_topk_prob,
        moe_router_dtype="fp32", moe_layer_freq=[int(x) for x in moe.moe_layers],
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none", moe_aux_loss_coeff=aux_loss_coeff,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        # grouped GEMMs come with Transformer Engine; without it each expert is its own MLP
        moe_grouped_gemm=have_transformer_engine(), moe_enable_routing_replay=routing_replay,
        # the fused top-k kernel (moe_utils.topk_routing_with_score_function, fused=True) never calls
        # RouterReplay.get_replay_topk: replay would be bypassed without a word
        moe_router_fusion=False,
    )


def transformer_config(spec: ModelSpec, tp: int, pp: int, dtype: torch.dtype, ep: int = 1, etp: int = 1,
                       aux_loss_coeff: float = 0.0, routing_replay: bool = False, expert_bias_update_rate: float = 0.0,
                       first_stage_layers: int = 0, last_stage_layers: int = 0, cp: int = 1, vpp: int = 1,
                       **overrides: Any):
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_parallel_layout(spec, tp, pp, ep, etp, first_stage_layers, last_stage_layers, vpp)
    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=spec.rms_eps,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        # The parallel sizes must be in the config too: with the default PP=1 each stage would
        # silently build every layer.
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        # interleaved: Megatron-LM's defaults, unbatched sends and receives that overlap compute; at
        # PP=2 they keep the two directions apart (each stage is the other's previous and next), which
        # one batch of them to the same peer does not
        **(dict(overlap_p2p_comm=True, batch_p2p_comm=False) if vpp > 1 else {}),
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        # micro-batches of different lengths (length-bucketed batching); this flag requires the
        # alltoall dispatcher even for dense models.
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        num_layers_in_first_pipeline_stage=first_stage_layers or None,
        num_layers_in_last_pipeline_stage=last_stage_layers or None,
    )
    if spec.moe is not None:
        kwargs.update(moe_kwargs(spec, ep, etp, aux_loss_coeff, routing_replay, expert_bias_update_rate))
    kwargs.update(overrides)
    if spec.mla is None:
        return TransformerConfig(**kwargs)
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    m, y = spec.mla, spec.yarn
    kwargs.update(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                  qk_head_dim=m.qk_nope_head_dim, qk_pos_emb_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                  qk_layernorm=True,  # the latents' RMSNorms (q_a_layernorm, kv_a_layernorm)
                  kv_channels=None, num_query_groups=None, rotary_base=spec.rope_theta,
                  rope_type="yarn" if y else "rope")
    if y:
        kwargs.update(rotary_scaling_factor=y.factor,
                      original_max_position_embeddings=y.original_max_position_embeddings,
                      beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim)
    return MLATransformerConfig(**kwargs)


def layer_spec(spec: ModelSpec, tconfig, shared_prefix: bool = False, kernel: str = "sdpa",
               vp_stage: int | None = None):
    """megatron's layer spec for the family (Transformer Engine's on GPU); `shared_prefix`: with
    the core attention of shared-prefix packed rows (policy/shared_prefix.py), through `kernel`."""
    from megatron.core.models.gpt import gpt_layer_specs

    if spec.moe is not None:  # per layer, experts or the dense MLP as tconfig.moe_layer_freq says
        out = gpt_layer_specs.get_gpt_decoder_block_spec(tconfig, use_transformer_engine=have_transformer_engine(),
                                                         normalization="RMSNorm", vp_stage=vp_stage)
    elif have_transformer_engine():
        out = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    else:
        out = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    if tconfig.context_parallel_size > 1 and not have_transformer_engine():  # TE's attention does CP itself
        from spice_megatron.policy.context_parallel import with_context_parallel_attention

        return with_context_parallel_attention(out)
    # megatron's local core attention cannot take latent attention's keys wider than its values: the
    # shared-prefix module (plain causal SDPA on unpacked rows) stands in for it without TE
    if shared_prefix or (spec.mla is not None and not have_transformer_engine()):
        from spice_megatron.policy.shared_prefix import with_shared_prefix_attention

        out = with_shared_prefix_attention(out, kernel)
    return out


def build_model(spec: ModelSpec, tconfig, pre_process: bool, post_process: bool, shared_prefix: bool = False,
                kernel: str = "sdpa", vp_stage: int | None = None):
    """This rank's GPTModel (with virtual pipeline stages: its chunk `vp_stage`)."""
    from megatron.core.models.gpt import GPTModel

    kwargs = dict(config=tconfig, transformer_layer_spec=layer_spec(spec, tconfig, shared_prefix, kernel, vp_stage),
                  vp_stage=vp_stage,
                  vocab_size=spec.vocab_size,
                  max_sequence_length=spec.max_position_embeddings, pre_process=pre_process,
                  post_process=post_process, share_embeddings_and_output_weights=spec.tied_embeddings,
                  position_embedding_type="rope", rotary_base=int(spec.rope_theta), rotary_percent=spec.rotary_percent)
    if spec.rope_scaling_factor is not None:
        kwargs.update(rope_scaling=True, rope_scaling_factor=spec.rope_scaling_factor)
    return GPTModel(**kwargs)


def resolve_shared_prefix(spec: ModelSpec, train, context_parallel: int = 1):
    """`train` with shared_prefix "auto" decided for this model and layout: off for latent attention
    (its per-layer rotary embedding cannot position packed rows yet) and under context parallelism
    (which splits padded rows), as the config says otherwise."""
    import dataclasses

    if (spec.mla is not None or context_parallel > 1) and train.shared_prefix == "auto":
        return dataclasses.replace(train, shared_prefix="off")
    return train


def build_policy_model(spec: ModelSpec, parallel, train, layout, dtype: torch.dtype, device: torch.device,
                       vp_stage: int | None = None, **overrides: Any):
    """The learner's model on this rank, as the Learner trains it: megatron's config for the layout
    and the activation flags of `train` (recompute, fused SwiGLU, sequence parallelism), in `dtype`
    on `device`. Returns (model, transformer config, activation flags). `overrides` go to the
    transformer config (tools/measure_activations.py: perform_initialization=False)."""
    from spice_megatron.policy import cpu_compat
    from spice_megatron.policy.activation_memory import activation_flags

    if train.use_shared_prefix and train.shared_prefix_kernel == "flex" and not torch.cuda.is_available():
        raise ConfigError("train.shared_prefix_kernel: flex needs a GPU (torch has no FlexAttention backward on "
                          "CPU); use sdpa")
    if train.use_shared_prefix and spec.mla is not None:
        raise ConfigError(f"train.shared_prefix: on, but {spec.architecture}'s latent attention keeps its own rotary "
                          "embedding, which shared-prefix rows cannot position yet; use off (auto is off here)")
    if train.use_shared_prefix and layout.cp > 1:
        raise ConfigError("parallel.context_parallel: shared-prefix packed rows cannot be split over context-parallel "
                          "ranks yet; set train.shared_prefix off")
    flags = activation_flags(parallel, train, layout.tp, torch.cuda.is_available(), have_transformer_engine())
    tconfig = transformer_config(spec, layout.tp, layout.pp, dtype, ep=layout.ep, etp=layout.etp,
                                 aux_loss_coeff=train.moe_aux_loss_coeff, routing_replay=spec.moe is not None,
                                 expert_bias_update_rate=train.moe_expert_bias_update_rate,
                                 first_stage_layers=parallel.first_stage_layers,
                                 last_stage_layers=parallel.last_stage_layers, cp=layout.cp, vpp=layout.vpp,
                                 **flags.megatron_kwargs(), **overrides)
    first, last = layout.is_first_stage, layout.is_last_stage
    if vp_stage is not None:  # the first chunk of the first stage has the embedding, the last of the last the output
        from megatron.core import parallel_state as ps

        first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    with cpu_compat.cuda_to_cpu():  # tied embeddings with PP > 1 move a copy with .cuda()
        model = build_model(spec, tconfig, first, last, train.use_shared_prefix, train.shared_prefix_kernel, vp_stage)
    # Uniformly in the training dtype, as megatron's Float16Module makes it: the local layer spec (no
    # Transformer Engine) builds its RMSNorms in fp32 next to bf16 linears, and the bf16 optimizer's
    # checkpoint mapping cannot handle the mix. (TE builds norms in bf16.)
    model = model.to(device=device, dtype=dtype)
    for name, buf in model.named_buffers():  # DeepSeek-V3's correction biases choose experts: fp32, as HF keeps them
        if name.endswith("mlp.router.expert_bias"):
            buf.data = buf.data.float()
    return model, tconfig, flags
