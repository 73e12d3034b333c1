"""The planner's memory model: GiB per GPU of a Megatron-Core learner (weights, gradients, optimizer
state, activations at the longest sequence, MoE terms) and of a vLLM engine (weights, paged KV cache),
with what each keeps on the GPU while the other runs (colocation). Back-of-envelope figures for
mixed precision: bf16 weights, fp32 gradient buffer, fp32 master weights and two Adam moments."""
from __future__ import annotations

import math
from dataclasses import dataclass

from spice_megatron.config import ParallelConfig, PolicyTrainConfig
from spice_megatron.families import ModelSpec
from spice_megatron.plan.costs import GiB
from spice_megatron.policy.activation_memory import ActivationFlags, activation_flags, activation_terms


@dataclass
class LearnerMemory:
    """GiB per GPU on the fullest pipeline stage."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    overhead: float
    # mixture-of-experts: the share of weights + gradients + optimizer that are experts (included
    # in the three terms above), and the all-to-all bytes one GPU sends per micro-batch
    experts: float = 0.0
    all_to_all_gib: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.overhead


def learner_memory(spec: ModelSpec, tp: int, pp: int, dp: int, micro_batch_tokens: int,
                   distributed_optimizer: bool = True, overhead_gib: float = 4.0, ep: int = 1,
                   etp: int = 1, flags: ActivationFlags | None = None, optimizer_offload: float = 0.0,
                   stage_layers: int | None = None, vpp: int = 1) -> LearnerMemory:
    """Per-GPU memory of the learner. Activations: the saved tensors of each layer for the flags
    the learner sets (`policy/activation_memory.py`; default: a GPU with Transformer Engine and
    the default train config, sequence parallel when TP > 1); 1F1B keeps up to PP micro-batches in
    flight on the first stage. The last stage holds fp32 logits (and their gradient) for one
    micro-batch.

    Mixture-of-experts: the experts are split over EP x ETP ranks instead of TP, and their
    optimizer state over the expert-data-parallel ranks (TP x DP / (EP x ETP)); a MoE layer's
    activations have expert terms for its MLP's. All-to-all: each routed copy crosses once to its
    expert and once back, h bf16 values each way, in the forward and twice in the backward;
    (EP-1)/EP of them leave the GPU."""
    if flags is None:
        flags = activation_flags(ParallelConfig(tensor_parallel=tp), PolicyTrainConfig(), tp, on_gpu=True,
                                 transformer_engine=True)
    # the fullest stage (parallel.first/last_stage_layers can make them uneven)
    h, layers_per_stage = spec.hidden_size, stage_layers or math.ceil(spec.num_layers / pp)
    embedding = spec.vocab_size * h  # the first stage's input embedding or the last stage's output layer
    moe = spec.moe
    expert_params = 0.0
    # optim.cpu_offload_fraction: that share of the optimizer's state (and its update) lives on the host
    if moe is None:
        per_layer = spec.num_parameters - spec.vocab_size * h * (1 if spec.tied_embeddings else 2) - h
        per_layer //= spec.num_layers
        dense = layers_per_stage * per_layer + embedding * (2 if pp == 1 and not spec.tied_embeddings else 1)
    else:
        experts_total = moe.num_moe_layers * moe.num_experts * 3 * h * moe.expert_ffn_hidden_size
        non_expert = spec.num_parameters - experts_total - spec.vocab_size * h * (1 if spec.tied_embeddings else 2) - h
        dense = non_expert / spec.num_layers * layers_per_stage + embedding * (
            2 if pp == 1 and not spec.tied_embeddings else 1)
        expert_params = experts_total * layers_per_stage / spec.num_layers / (ep * etp)
    # under TE, latent attention's down-projections (TELinear "duplicated") and the routers are whole
    # on every TP rank (megatron's multi_latent_attention.py; bridge/mapping.py maps them so)
    whole = 0.0
    if flags.transformer_engine and spec.mla is not None:
        whole += spec.num_layers * h * ((spec.mla.q_lora_rank or 0) + spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim)
    if flags.transformer_engine and moe is not None:
        whole += moe.num_moe_layers * moe.num_experts * h
    whole *= layers_per_stage / spec.num_layers
    dense = (dense - whole) / tp + whole
    edp = max(1, tp * dp // (ep * etp))
    shard, expert_shard = (dp, edp) if distributed_optimizer else (1, 1)
    weights, grads = 2 * (dense + expert_params), 4 * (dense + expert_params)
    optimizer = (12 * dense / shard + 12 * expert_params / expert_shard) * (1 - optimizer_offload)
    per_token_layer = sum(activation_terms(spec, tp, flags).values())
    a2a = 0.0
    if moe is not None:
        routed = micro_batch_tokens / tp * moe.top_k  # this GPU's tokens (sequence parallel) times k
        share = moe.num_moe_layers / spec.num_layers
        per_token_layer = (1 - share) * per_token_layer + share * sum(
            activation_terms(spec, tp, flags, moe_layer=True, etp=etp).values())
        a2a = routed * h * 2 * 2 * 3 * (ep - 1) / ep * moe.num_moe_layers * layers_per_stage / spec.num_layers
    # in flight on the first stage: PP micro-batches through its layers under 1F1B; interleaved (VPP
    # chunks of layers_per_stage / VPP layers each), megatron's warm-up of 2 (PP-1) + (VPP-1) PP chunks
    # and the one running
    in_flight = pp if vpp == 1 else (2 * (pp - 1) + (vpp - 1) * pp + 1) / vpp
    activations = per_token_layer * micro_batch_tokens * layers_per_stage * in_flight
    logits = 2 * 4 * micro_batch_tokens * spec.vocab_size / tp
    return LearnerMemory(weights=weights / GiB, gradients=grads / GiB, optimizer=optimizer / GiB,
                         activations=activations / GiB, logits=logits / GiB, overhead=overhead_gib,
                         experts=expert_params * (6 + 12 / expert_shard) / GiB, all_to_all_gib=a2a / GiB)


@dataclass
class EngineMemory:
    """GiB per GPU of one vLLM engine, and how many full-length sequences its KV cache holds."""

    weights: float
    kv_cache: float
    kv_bytes_per_token: int
    max_sequences: int  # of max_model_len tokens each

    @property
    def kv_tokens(self) -> int:
        return int(self.kv_cache * GiB // self.kv_bytes_per_token) if self.kv_cache > 0 else 0


# An engine's KV cache must hold 32 requests of 8,192 tokens. vLLM pages the cache, and a request is
# its document plus its output (most far below max_model_len), so tokens, not full-length sequences,
# are what bound the concurrency.
MIN_ENGINE_KV_TOKENS = 32 * 8192

# Colocation: what a sleeping vLLM engine keeps on its GPU. Level-1 sleep frees weights and KV cache
# but not the CUDA context, the CUDA-graph pools or the NCCL buffers: 6,962-7,121 MiB per GPU asleep
# was measured for a TP8 engine (vllm-project/vllm issue #47654, 2026-07; CUDA graphs 1.5 GB of it,
# NCCL ~0.9 GiB per vllm PR #46234). And what an offloaded learner keeps besides its bf16 weights
# (CUDA context, NCCL buffers, the allocator's cache; an estimate until tools/gpu_check.sh measures it)
ENGINE_ASLEEP_GIB = 7.0
LEARNER_RESIDENT_GIB = 2.5


def engine_memory(spec: ModelSpec, engine_tp: int, gpu_memory_gib: float, utilization: float,
                  max_model_len: int, overhead_gib: float = 3.0) -> EngineMemory:
    weights = 2 * spec.num_parameters / engine_tp / GiB
    kv_heads = max(1, spec.num_kv_heads // engine_tp)  # replicated when TP exceeds the KV heads
    kv_per_token = 2 * spec.num_layers * kv_heads * spec.head_dim * 2  # K and V, bf16
    if spec.mla is not None:  # vLLM caches the latent (and the rotary key) once per token, on every TP rank
        kv_per_token = spec.num_layers * (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) * 2
    kv_cache = gpu_memory_gib * utilization - weights - overhead_gib
    seqs = int(kv_cache * GiB // (kv_per_token * max_model_len)) if kv_cache > 0 else 0
    return EngineMemory(weights, kv_cache, kv_per_token, seqs)
