"""Log-probabilities of sampled tokens from vocab-parallel logits: the one piece of arithmetic the
learner, the shared-prefix attention's scoring and the benchmarks share (below all of them, so that
none imports another for it)."""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels) from vocab-parallel logits [b, s, V/TP] -> [b, s], in fp32."""
    from megatron.core import tensor_parallel

    # The cross entropy flattens the leading dimensions, so [b, s] works as well as megatron's
    # [s, b]; every avoided copy is one [tokens x V/TP] tensor less at the peak.
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled.contiguous(), labels.contiguous())
