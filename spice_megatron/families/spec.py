"""The architecture facts of a model as the learner, the bridge and the planner read them
(`ModelSpec`), what declares a family (`Family`), and the parsing every family shares: the dense
transformer's fields, rotary scaling and FP8 block scales. A family's own module
(`families/<name>.py`) adds what is its own and registers itself."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from spice_megatron.entry import UserError


class UnsupportedModelError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Family:
    """One model family: the HF architecture it reads, how its config.json becomes a ModelSpec
    (`parse`), and a small random-weight config of it for tests and the CPU demo (`tiny`)."""

    name: str
    architecture: str  # config.json's architectures[0]
    model_type: str  # config.json's model_type (read when architectures is absent)
    parse: Callable[[dict, "Family"], "ModelSpec"]
    tiny: Callable[..., dict]  # (common fields, engine=..., sizes...) -> a config.json
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    qkv_bias: bool = False  # biases on q/k/v projections (Qwen2)
    examples: str = ""  # checkpoints of the architecture (docs/checkpoints.md's table)
    experts: bool = False  # mixture-of-experts layers
    mla: bool = False  # multi-head latent attention (DeepSeek-V2/V3)


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


def rope(cfg: dict, yarn_ok: bool = False) -> tuple[float, float | None, YarnSpec | None]:
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


def dense_spec(config: dict, family: Family, **features) -> ModelSpec:
    """The fields every family reads the same way, refusing what none of them supports; `features`
    (moe, mla, yarn, qk_norm, qkv_bias, num_kv_heads, head_dim) are the family's own."""
    arch = family.architecture
    if config.get("attention_bias", False) and not family.qkv_bias:
        raise UnsupportedModelError(f"{arch} with attention_bias=true is not supported")
    if config.get("mlp_bias", False):
        raise UnsupportedModelError(f"{arch} with mlp_bias=true is not supported")
    if config.get("use_sliding_window", False):  # Qwen2's configs carry the switch, off in every published one
        raise UnsupportedModelError(f"{arch} with use_sliding_window=true is not supported (full attention only: "
                                    "set it to false, as Qwen2.5's published configs do)")
    heads = config["num_attention_heads"]
    theta, scaling, yarn = rope(config, yarn_ok=family.mla)
    fields = dict(
        architecture=arch, family=family, num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        ffn_hidden_size=config["intermediate_size"], vocab_size=config["vocab_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), rms_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling_factor=scaling,
        max_position_embeddings=config.get("max_position_embeddings", 4096), hf_config=config, yarn=yarn,
        qk_norm=family.qk_norm, qkv_bias=family.qkv_bias,
        rotary_percent=float(config.get("partial_rotary_factor",
                                        (config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))))
    return ModelSpec(**{**fields, **features})


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
