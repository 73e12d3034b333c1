"""The learner's config sections: its layout (`parallel`), optimizer (`optim`) and training step
(`train`). Each validates itself and names the offending field; spice_megatron/config/__init__.py composes
them with the rest into a SpiceConfig."""
from __future__ import annotations

from dataclasses import dataclass, field

from spice_megatron.entry import require as _require


@dataclass
class ParallelConfig:
    """Learner layout. Data parallelism is what remains: world_size / (tp * pp * cp)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # Mixture-of-experts only: experts are split over expert_parallel ranks taken from the
    # tensor x data-parallel ranks of a stage (megatron's EP), and each expert's matrices over
    # expert_tensor_parallel of them (ETP; 1, whole experts, is what megatron recommends with EP).
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    # Megatron's sequence parallelism: with TP > 1 the norms, dropouts and residuals (and the
    # activations they save) are split over the sequence across the TP ranks instead of being
    # replicated. auto: on when tensor_parallel > 1 (megatron requires it for MoE with TP).
    sequence_parallel: str = "auto"
    backend: str = "auto"  # nccl on GPU, gloo on CPU
    # Uneven pipeline stages (megatron's num_layers_in_first/last_pipeline_stage): the first and/or
    # last stage hold this many layers, the others split the rest evenly (0: an even split). For
    # layer counts PP does not divide (Qwen3-235B's 94, DeepSeek-V3's 61), or a lighter stage beside
    # the embedding or the output layer.
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    # Context parallelism (megatron's CP): each sequence split over this many ranks, two of its
    # 2 x CP chunks each (policy/context_parallel.py); taken from the data-parallel ranks. For
    # sequences whose activations do not fit one TP group; padded micro-batches only.
    context_parallel: int = 1
    # Virtual pipeline stages (megatron's interleaved 1F1B): each pipeline rank holds this many
    # non-adjacent chunks of layers, which divides the pipeline bubble by it for one more
    # point-to-point transfer per chunk; pipeline_parallel x virtual_pipeline must divide the layers.
    virtual_pipeline: int = 1

    @property
    def use_sequence_parallel(self) -> bool:
        return self.sequence_parallel == "on" or (self.sequence_parallel == "auto" and self.tensor_parallel > 1)

    def validate(self, prefix: str = "parallel") -> None:
        _require(self.tensor_parallel >= 1, f"{prefix}.tensor_parallel", "must be >= 1")
        _require(self.pipeline_parallel >= 1, f"{prefix}.pipeline_parallel", "must be >= 1")
        _require(self.expert_parallel >= 1, f"{prefix}.expert_parallel", "must be >= 1")
        _require(self.expert_tensor_parallel >= 1, f"{prefix}.expert_tensor_parallel", "must be >= 1")
        _require(self.context_parallel >= 1, f"{prefix}.context_parallel", "must be >= 1")
        _require(self.virtual_pipeline >= 1, f"{prefix}.virtual_pipeline", "must be >= 1")
        _require(self.virtual_pipeline == 1 or self.pipeline_parallel > 1, f"{prefix}.virtual_pipeline",
                 "needs pipeline_parallel > 1")
        _require(self.virtual_pipeline == 1 or not (self.first_stage_layers or self.last_stage_layers),
                 f"{prefix}.virtual_pipeline", "with uneven stages (first_stage_layers / last_stage_layers) is not "
                 "supported yet")
        _require(self.sequence_parallel in ("auto", "on", "off"), f"{prefix}.sequence_parallel",
                 "must be auto, on or off")
        _require(self.backend in ("auto", "nccl", "gloo"), f"{prefix}.backend", "must be auto, nccl or gloo")
        for name in ("first_stage_layers", "last_stage_layers"):
            _require(getattr(self, name) >= 0, f"{prefix}.{name}", "must be >= 0 (0: an even split)")
            _require(not getattr(self, name) or self.pipeline_parallel > 1, f"{prefix}.{name}",
                     "needs pipeline_parallel > 1")


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay_steps: int | None = None  # None: constant after warmup
    decay_style: str = "constant"  # constant | linear | cosine
    use_distributed_optimizer: bool = False
    # How the distributed optimizer's state is checkpointed: dp_reshardable, each data-parallel rank
    # writes its own shard (no exchange; resumes at the same TP x PP x EP, any DP); fully_reshardable,
    # gathered per model-parallel group first (resumes at any layout: set it for the save before one)
    checkpoint_sharding: str = "dp_reshardable"
    # megatron-core's CPU optimizer (HybridDeviceOptimizer): this share of the Adam state and update
    # lives on the host; for a model whose state does not fit beside its engines (the planner says
    # when). GPU only: it needs the distributed optimizer and Transformer Engine.
    cpu_offload_fraction: float = 0.0

    def validate(self, prefix: str = "optim") -> None:
        _require(self.lr >= 0, f"{prefix}.lr",
                 f"must be >= 0 (0 freezes the weights: a negative control), got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, f"{prefix}.min_lr", "must be in [0, lr]")
        _require(self.weight_decay >= 0, f"{prefix}.weight_decay", "must be >= 0")
        _require(self.clip_grad >= 0, f"{prefix}.clip_grad", "must be >= 0 (0 disables clipping)")
        _require(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0")
        _require(self.decay_style in ("constant", "linear", "cosine"), f"{prefix}.decay_style",
                 "must be constant, linear or cosine")
        _require(self.checkpoint_sharding in ("dp_reshardable", "fully_reshardable"), f"{prefix}.checkpoint_sharding",
                 "must be dp_reshardable or fully_reshardable")
        _require(self.decay_style == "constant" or (self.decay_steps or 0) > self.warmup_steps,
                 f"{prefix}.decay_steps", "must exceed warmup_steps for a decaying schedule")
        _require(0 <= self.cpu_offload_fraction <= 1, f"{prefix}.cpu_offload_fraction", "must be in [0, 1]")
        _require(not self.cpu_offload_fraction or self.use_distributed_optimizer, f"{prefix}.cpu_offload_fraction",
                 "megatron-core's CPU optimizer needs optim.use_distributed_optimizer=true")


@dataclass
class PolicyTrainConfig:
    """How one batch of samples becomes optimiser steps on the learner."""

    max_gen_len: int = 2048  # DrGRPO's constant normaliser (the generation budget)
    micro_batch_tokens: int = 8192  # token budget of one micro-batch (a packed row; unshared: padded length x rows)
    steps_per_batch: int = 1  # optimiser steps per rollout batch; > 1 turns on the PPO clip
    # The paper's "128 trajectories per gradient update": an iteration's trajectories are consumed in
    # ceil(n / trajectories_per_update) optimiser steps (PPO clip after the first). 0: steps_per_batch.
    trajectories_per_update: int = 0
    clip_low: float = 0.2
    clip_high: float = 0.2
    # leave sequences whose advantage is zero out of the forward and backward: their DrGRPO gradient
    # is exactly zero (the loss's normaliser counts them all the same); off: train them anyway
    skip_zero_advantage: bool = True
    old_logprobs: str = "forward"  # forward: recompute before the update | rollout: the engine's
    temperature: float = 1.0  # logits are divided by the sampling temperature before log-softmax
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    seed: int = 1234
    # 0: on-policy (rollouts, step, sync one after another); 1: one step off: the rollouts of
    # iteration t+1 run while the learner takes step t, and are trained one version later
    max_staleness: int = 0
    # token-level truncated importance sampling against the engine's sampled-token log-probs:
    # auto: on when max_staleness > 0; on; off
    importance_sampling: str = "auto"
    tis_cap: float = 2.0  # the weights min(pi_learner / mu_engine, tis_cap)
    # Mixture-of-experts only. The load-balancing loss is off by default: RL updates are small and
    # few, and an auxiliary term pulls the router away from the routing the engines sampled with
    # (what routing replay keeps equal); pretraining's 1e-3 is the usual value to turn it on.
    moe_aux_loss_coeff: float = 0.0
    # DeepSeek-V3 / GLM-4.5: how far megatron's auxiliary-loss-free balancing moves each router's
    # correction bias (e_score_correction_bias) after a step, by the batch's expert loads. 0: the
    # checkpoint's bias stays (the engines route with it; the RL loss has no gradient to it);
    # pretraining used 1e-3
    moe_expert_bias_update_rate: float = 0.0
    # Replay in every learner forward the experts the engine chose for each prompt and sampled
    # token (megatron's RouterReplay), so the gradient flows through the experts that produced the
    # samples. "auto": on for mixture-of-experts models.
    routing_replay: str = "auto"
    # Activation memory (policy/activation_memory.py; the planner counts the same): megatron's fused
    # SwiGLU (auto: on GPU), and recomputing in the backward what the forward would keep: off,
    # selective (the recompute_modules of each layer: mlp, core_attn, and for mixture-of-experts
    # layers moe (the whole MoE layer, router replayed) or moe_act (the experts' activation; needs
    # Transformer Engine's grouped GEMM)) or full (each layer from its input, about a third more compute)
    fused_swiglu: str = "auto"
    recompute: str = "off"
    recompute_modules: list[str] = field(default_factory=lambda: ["mlp"])
    # Each group's prompt runs once, its completions packed after it, and logits only where a token
    # is scored (policy/packing.py): the same log-probs and gradients, a fraction of the tokens.
    # auto: on wherever it is exact, i.e. unless moe_aux_loss_coeff > 0 (the load-balancing loss
    # counts tokens, and a shared prompt is counted once); on; off: one padded row per sequence
    shared_prefix: str = "auto"
    # its core attention: sdpa (torch's scaled_dot_product_attention per segment, flash on GPU) or
    # flex (FlexAttention: one compiled call per layer, its block mask built once per micro-batch;
    # GPU only: torch has no FlexAttention backward on CPU). sdpa until a GPU measures the two
    # (tools/gpu_check.sh: long_prefix_row_pad_to_128 prints both)
    shared_prefix_kernel: str = "sdpa"

    @property
    def use_shared_prefix(self) -> bool:
        return self.shared_prefix == "on" or (self.shared_prefix == "auto" and self.moe_aux_loss_coeff == 0)

    @property
    def use_tis(self) -> bool:
        return self.importance_sampling == "on" or (self.importance_sampling == "auto" and self.max_staleness > 0)

    def validate(self, prefix: str = "train") -> None:
        _require(self.max_staleness in (0, 1), f"{prefix}.max_staleness", "must be 0 (on-policy) or 1 (one step off)")
        _require(self.importance_sampling in ("auto", "on", "off"), f"{prefix}.importance_sampling",
                 "must be auto, on or off")
        _require(self.fused_swiglu in ("auto", "on", "off"), f"{prefix}.fused_swiglu", "must be auto, on or off")
        _require(self.recompute in ("off", "selective", "full"), f"{prefix}.recompute",
                 "must be off, selective or full")
        # megatron's "layernorm" recompute needs TE, whose layers fuse the norms into the linears: moot
        allowed = ("mlp", "core_attn", "moe", "moe_act")
        bad = [m for m in self.recompute_modules if m not in allowed]
        _require(not bad and (self.recompute != "selective" or bool(self.recompute_modules)),
                 f"{prefix}.recompute_modules", f"{bad or 'none given'}: choose from {', '.join(allowed)}")
        _require(self.tis_cap >= 1.0, f"{prefix}.tis_cap", "must be >= 1 (a cap below 1 down-weights on-policy tokens)")
        _require(not (self.use_tis and self.old_logprobs == "rollout"), f"{prefix}.importance_sampling",
                 "with train.old_logprobs=rollout the learner's old policy is the engine's: the weights would all be 1")
        _require(self.max_gen_len > 0, f"{prefix}.max_gen_len", "must be > 0")
        _require(self.micro_batch_tokens > 0, f"{prefix}.micro_batch_tokens", "must be > 0")
        _require(self.steps_per_batch >= 1, f"{prefix}.steps_per_batch", "must be >= 1")
        _require(self.trajectories_per_update >= 0, f"{prefix}.trajectories_per_update", "must be >= 0")
        _require(not (self.trajectories_per_update and self.steps_per_batch > 1), f"{prefix}.trajectories_per_update",
                 "set either trajectories_per_update or steps_per_batch > 1, not both")
        _require(self.clip_low > 0 and self.clip_high > 0, f"{prefix}.clip_low", "clip ranges must be > 0")
        _require(self.old_logprobs in ("forward", "rollout"), f"{prefix}.old_logprobs", "must be forward or rollout")
        _require(self.temperature > 0, f"{prefix}.temperature", "must be > 0")
        _require(self.dtype in ("auto", "fp32", "bf16"), f"{prefix}.dtype", "must be auto, fp32 or bf16")
        _require(self.moe_aux_loss_coeff >= 0, f"{prefix}.moe_aux_loss_coeff", "must be >= 0 (0: off)")
        _require(self.moe_expert_bias_update_rate >= 0, f"{prefix}.moe_expert_bias_update_rate",
                 "must be >= 0 (0: fixed)")
        _require(self.routing_replay in ("auto", "on", "off"), f"{prefix}.routing_replay", "must be auto, on or off")
        _require(self.shared_prefix in ("auto", "on", "off"), f"{prefix}.shared_prefix", "must be auto, on or off")
        _require(self.shared_prefix_kernel in ("sdpa", "flex"), f"{prefix}.shared_prefix_kernel",
                 "must be sdpa or flex")
