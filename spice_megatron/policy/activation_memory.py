"""What a learner layer saves for its backward pass: the flags that decide it and the bytes they give.

The Learner sets megatron's flags from `activation_flags` and the planner sums `activation_terms`
for the same flags, so the two cannot disagree. Each term is one tensor (or a few of the same
shape) that autograd keeps, in bytes per token per layer, bf16 unless said. The local layer spec's
terms (the torch layers the CPU path runs) are measured by `tools/checks/measure_activations.py`, which a
test holds within 15% of this sum; Transformer Engine's (GPU) follow its modules' saved tensors
(`layernorm_linear.py`: input and ln_out; flash attention: q, k, v and its output; the fused SwiGLU:
its input only) and are measured by `tools/checks/gpu_check.py` where a GPU is lent.

Attention scores are not here: flash attention keeps none, and the local spec's s x s softmax
(CPU, short sequences) is measured apart as the s^2 coefficient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spice_megatron.config import ParallelConfig, PolicyTrainConfig


@dataclass(frozen=True)
class ActivationFlags:
    sequence_parallel: bool  # norms and residuals split over the TP ranks' sequence
    fused_swiglu: bool  # megatron's bias_swiglu: saves its input, not its intermediate products
    recompute: str  # off | selective (recompute_modules) | full (every layer from its input)
    recompute_modules: tuple[str, ...]
    transformer_engine: bool  # TE's fused layers (GPU) or the local torch spec
    shared_prefix: bool = False  # the core attention of shared-prefix packed rows (policy/shared_prefix.py)
    context_parallel: int = 1  # without TE, each CP rank keeps the whole sequence's K and V (context_parallel.py)

    def megatron_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(sequence_parallel=self.sequence_parallel,
                                      bias_activation_fusion=self.fused_swiglu)
        if self.recompute == "selective":
            kwargs.update(recompute_granularity="selective", recompute_modules=list(self.recompute_modules))
        elif self.recompute == "full":
            kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        return kwargs


def activation_flags(parallel: ParallelConfig, train: PolicyTrainConfig, tp: int, on_gpu: bool,
                     transformer_engine: bool) -> ActivationFlags:
    """The learner's flags for a layout. The fused SwiGLU is torch.compile'd by megatron: on by
    default on GPU only (on CPU each new micro-batch length would compile for ~20 s)."""
    fused = train.fused_swiglu == "on" or (train.fused_swiglu == "auto" and on_gpu)
    return ActivationFlags(sequence_parallel=parallel.use_sequence_parallel and tp > 1, fused_swiglu=fused,
                           recompute=train.recompute, recompute_modules=tuple(train.recompute_modules),
                           transformer_engine=transformer_engine, shared_prefix=train.use_shared_prefix,
                           context_parallel=parallel.context_parallel)


def activation_terms(spec, tp: int, flags: ActivationFlags, moe_layer: bool = False, etp: int = 1) -> dict[str, float]:
    """Bytes per token per layer (bf16) that one layer saves, term by term, on one TP rank. A
    mixture-of-experts layer's MLP terms are its experts': per routed copy of a token (top-k of
    them, split over the TP ranks with the sequence) the dispatcher's permuted input and combine
    buffer, the expert's SwiGLU and fc2 input (not measured on CPU against its saved tensors)."""
    h, hd = spec.hidden_size, spec.head_dim
    q, kv, f = spec.num_heads * hd / tp, spec.num_kv_heads * hd / tp, spec.ffn_hidden_size / tp
    seq = h / tp if flags.sequence_parallel else h  # what a norm or residual holds of a token
    if flags.recompute == "full":  # megatron keeps each layer's input and runs the layer again
        return {"layer input (full recompute)": 2 * seq}
    selective = set(flags.recompute_modules) if flags.recompute == "selective" else set()
    terms: dict[str, float] = {}
    if flags.transformer_engine:
        # LayerNormLinear saves its input and the normalised copy (the local shard under SP)
        terms["attention norm input + output"] = 4 * seq
        terms["q/k norm inputs"] = 2 * (q + kv) if spec.qk_norm else 0.0  # Qwen3's; Llama has none
        terms["flash attention q, k, v"] = 2 * (q + 2 * kv)
        terms["attention output (= projection input)"] = 2 * q
        if flags.shared_prefix and "core_attn" not in selective:
            # SDPA's own output pieces (a prefix's; a completion's piece is recomputed) beside the
            # projection's input, which is their concatenation, and the fp32 log-sum-exps
            terms["shared-prefix attention pieces + log-sum-exps"] = 2 * q + 4 * spec.num_heads / tp
        norm_key = "mlp norm input + output"
        mlp = {norm_key: 4 * seq}
    else:
        # torch RMSNorm computes in fp32: it keeps the fp32 input and normalised output
        terms["attention norm (fp32 input + output)"] = 8 * seq
        terms["qkv input"] = 2 * seq
        terms["q/k norms (fp32 input + output)"] = 8 * (q + kv) if spec.qk_norm else 0.0
        # the dot-product attention repeats k and v to every query head before its two matmuls;
        # checkpointed, it keeps q, k and v as they come in
        terms["attention q, k, v (k, v per query head)"] = 2 * (q + 2 * kv) if "core_attn" in selective else 6 * q
        terms["projection input"] = 2 * q
        if flags.context_parallel > 1:  # the all-gathered K/V of the whole sequence, per local token
            terms["context-parallel gathered k, v"] = 2 * 2 * kv * flags.context_parallel
        norm_key = "mlp norm (fp32 input + output)"
        mlp = {norm_key: 8 * seq, "fc1 input": 2 * seq}
    terms["rope cos/sin"] = 8 * hd
    mlp["swiglu (fc1 output" + (")" if flags.fused_swiglu else ", silu output, product)")] = (
        4 * f if flags.fused_swiglu else 8 * f)
    mlp["fc2 input"] = 2 * f
    if moe_layer:
        copies, ffn = spec.moe.top_k / tp, spec.moe.expert_ffn_hidden_size / etp
        if "moe" in selective:  # checkpointed: the whole MoE layer keeps its input
            mlp = {norm_key: mlp[norm_key], "moe input (recomputed moe)": 2 * seq}
        elif "moe_act" in selective:  # output-discarding: the fc1 output stays, the activation's goes
            mlp = {norm_key: mlp[norm_key], "expert dispatch input + combine buffer": copies * 4 * h,
                   "expert fc1 output (recomputed activation)": copies * 4 * ffn}
        else:
            mlp = {norm_key: mlp[norm_key], "expert dispatch input + combine buffer": copies * 4 * h,
                   "expert swiglu": copies * (4 if flags.fused_swiglu else 8) * ffn,
                   "expert fc2 input": copies * 2 * ffn}
    elif "mlp" in selective:  # checkpointed: the MLP keeps its input (the norm's when it is the MLP's own)
        mlp = {norm_key: mlp[norm_key] if not flags.transformer_engine else 0.0, "mlp input (recomputed mlp)": 2 * seq}
    terms.update(mlp)
    return terms
