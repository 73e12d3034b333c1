"""Rank 0's training batch on every learner rank, with mixture-of-experts routing only where it is
used. The routing is most of a MoE batch's bytes ([tokens, decoder layers, top-k] per sequence: at
Qwen3-30B-A3B, 48 x 8 uint8 per token, ~3.8 GB an iteration at the paper's batch), and a
data-parallel replica runs only its share of the sequences: each replica gets the routing of the
sequences its micro-batches hold (Learner.routing_destinations), none for the sequences no replica
trains. A streamed chunk of complete documents goes to the old-log-prob forward, which runs every
sequence of it (advantages are not known yet): its routing goes by that forward's split
(`forward_only`). A dense batch is broadcast as it is.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch.distributed as dist

from spice_megatron.policy.batching import TrainSequence
from spice_megatron.policy.parallel import broadcast_from_driver


def _routing_bytes(seqs: list[TrainSequence]) -> int:
    return sum(np.asarray(x.routed_experts).nbytes for x in seqs if x.routed_experts is not None)


class BatchDelivery:
    """Collective over the learner ranks (`group`: the gloo control group)."""

    def __init__(self, learner, group) -> None:
        self.learner, self.group = learner, group
        self.dp_of_rank: list[int] = [0] * dist.get_world_size(group)
        dist.all_gather_object(self.dp_of_rank, learner.layout.dp_rank, group=group)

    def __call__(self, seqs: list[TrainSequence] | None, forward_only: bool = False
                 ) -> tuple[list[TrainSequence] | None, dict[str, float]]:
        """(this rank's copy of the batch, the routing volume on rank 0: bytes from the engines, bytes
        sent to the learner ranks, sequences whose routing no rank needed). `forward_only`: the
        sequences go to Learner.compute_logprobs (every one runs), not to train_on_batch."""
        routed = dist.get_rank() == 0 and bool(seqs) and any(x.routed_experts is not None for x in seqs)
        if not broadcast_from_driver(routed, self.group):
            return broadcast_from_driver(seqs, self.group), {}
        payloads, stats = None, {}
        if dist.get_rank() == 0:
            dest = (self.learner.forward_destinations(seqs) if forward_only
                    else self.learner.routing_destinations(seqs))
            per_dp = {dp: [x if dp in dest[i] or x.routed_experts is None
                           else dataclasses.replace(x, routed_experts=None) for i, x in enumerate(seqs)]
                      for dp in set(self.dp_of_rank)}
            payloads = [per_dp[dp] for dp in self.dp_of_rank]
            stats = {"routing/bytes_from_engines": float(_routing_bytes(seqs)),
                     "routing/bytes_to_learners": float(sum(_routing_bytes(p) for p in payloads)),
                     "routing/untrained_dropped": float(sum(1 for x, d in zip(seqs, dest)
                                                            if x.routed_experts is not None and not d))}
        mine: list = [None]
        dist.scatter_object_list(mine, payloads, src=0, group=self.group)
        return mine[0], stats
