"""Log-probabilities of sampled tokens from vocab-parallel logits: the one piece of arithmetic the
learner, the shared-prefix attention's scoring and the benchmarks share (below all of them, so that
none imports another for it); and the learner's scored log-probs gathered onto every rank."""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels) from vocab-parallel logits [b, s, V/TP] -> [b, s], in fp32."""
    from megatron.core import tensor_parallel

    # The cross entropy flattens the leading dimensions, so [b, s] works as well as megatron's
    # [s, b]; every avoided copy is one [tokens x V/TP] tensor less at the peak.
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled.contiguous(), labels.contiguous())


def gather_scored(outs: list[dict], layout, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (sequence index, count, log-probs) that the last stages' TP rank 0 hold in `outs` (the
    learner's forward-only pass), on every rank, as tensors: two all-gathers of sizes and padded
    tensors on the device (NCCL on GPU) instead of pickled lists, then one copy to the host."""
    import torch.distributed as dist

    dev = device
    # context-parallel ranks all hold the whole sequences' log-probs (Learner.compute_logprobs)
    mine = outs if (layout.is_last_stage and layout.tp_rank == 0 and layout.cp_rank == 0) else []
    index = torch.cat([o["index"] for o in mine]).to(dev) if mine else torch.zeros(0, dtype=torch.long, device=dev)
    counts = torch.cat([o["counts"].long().to(dev) for o in mine]) if mine else torch.zeros_like(index)
    values = torch.cat([o["values"].to(dev) for o in mine]) if mine else torch.zeros(0, device=dev)
    world = layout.world_size
    sizes = [torch.zeros(2, dtype=torch.long, device=dev) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([index.numel(), values.numel()], device=dev))
    rows, vals = (max(int(sz[k]) for sz in sizes) for k in (0, 1))
    packed = torch.zeros(world, 2 * rows, dtype=torch.long, device=dev)
    flat = torch.zeros(world, vals, dtype=torch.float32, device=dev)
    mine_packed = torch.zeros(2 * rows, dtype=torch.long, device=dev)
    mine_packed[:index.numel()], mine_packed[rows:rows + counts.numel()] = index, counts
    mine_flat = torch.zeros(vals, dtype=torch.float32, device=dev)
    mine_flat[:values.numel()] = values
    dist.all_gather(list(packed.unbind(0)), mine_packed)
    dist.all_gather(list(flat.unbind(0)), mine_flat)
    packed, flat = packed.cpu(), flat.cpu()
    parts = [(packed[r, :int(sz[0])], packed[r, rows:rows + int(sz[0])], flat[r, :int(sz[1])])
             for r, sz in enumerate(s.cpu() for s in sizes)]
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]))
