"""A megatron-core GPTModel from a model's `ModelSpec` (spice_megatron/families/: its HF config.json
parsed by its family), built from the spec's features: experts, latent attention, q/k norms, biases."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from spice_megatron.config import ConfigError
from spice_megatron.families import ModelSpec


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
    """megatron's MoE settings for a model's experts. A softmax router (Qwen3-MoE's): softmax over
    all experts in fp32, top-k, then (norm_topk_prob) renormalised; megatron's softmax router computes the same
    as top-k on the logits then a softmax over the k (moe_router_pre_softmax=False), and as
    softmax-then-top-k without renormalising when pre_softmax is True."""
    moe = spec.moe
    sigmoid_routing = dict(
        # the correction bias is the checkpoint's and stays fixed unless train.moe_expert_bias_update_rate
        # says otherwise: megatron's auxiliary-loss-free balancing moves it after a step by the batch's loads
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=expert_bias_update_rate,
        moe_router_num_groups=moe.num_groups, moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
    ) if moe.score_function == "sigmoid" else {}
    return dict(
        **sigmoid_routing,
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
    transformer config (tools/checks/measure_activations.py: perform_initialization=False)."""
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


def layer_offset(model) -> int:
    """Global index of this pipeline stage's (or model chunk's) first layer."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config, getattr(model, "vp_stage", None))
