"""What trains the learner's model chunks: megatron's data-parallel wrapper with its gradient
buckets, its optimizer (Adam; distributed, and the CPU-offloaded share, as optim.* says) and the
learning-rate schedule. Learner builds them once, after the HF weights are in (its docstring says why)."""
from __future__ import annotations

import torch

from spice_megatron.config import OptimConfig
from spice_megatron.policy import cpu_compat


def data_parallel_chunks(chunks: list, optim: OptimConfig, dp: int) -> list:
    """Each model chunk under megatron's DistributedDataParallel. The data-parallel gradient reduce
    runs bucket by bucket during the backward pass (finalize_model_grads waits for the last buckets);
    a later chunk's buckets are not split (megatron's rule: the interleaved schedule reduces them
    chunk by chunk)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    with cpu_compat.cuda_to_cpu():
        return [DistributedDataParallel(
            config=chunk.config, module=chunk,
            ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=optim.use_distributed_optimizer,
                                                     overlap_grad_reduce=dp > 1, grad_reduce_in_fp32=True),
            disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]


def megatron_optimizer(ddp_chunks: list, optim: OptimConfig, dtype: torch.dtype):
    """megatron's Adam over every chunk. optim.cpu_offload_fraction: megatron's HybridDeviceOptimizer
    (CPU Adam for that share of the state; it requires the precision-aware distributed optimizer);
    GPU only, never run here."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    offload = ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": optim.cpu_offload_fraction,
                "use_precision_aware_optimizer": True} if optim.cpu_offload_fraction else {})
    with cpu_compat.cuda_to_cpu():
        return get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                            adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                            clip_grad=optim.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                            use_distributed_optimizer=optim.use_distributed_optimizer, **offload),
            ddp_chunks)


def lr_scheduler(optimizer, optim: OptimConfig):
    """megatron's schedule: linear warm-up, then optim.decay_style down to min_lr; constant weight decay."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = optim.decay_steps if optim.decay_style != "constant" else optim.warmup_steps + 1
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim.warmup_steps else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps, lr_decay_steps=max(decay_steps, optim.warmup_steps + 1),
        lr_decay_style=optim.decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant")
