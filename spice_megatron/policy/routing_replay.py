"""Rollout routing replay ("R3") for mixture-of-experts learners, on megatron's RouterReplay.

An MoE engine samples a token through the experts its router picked; the learner, in a different
numeric setting (other kernels, dtype, batch), can pick other experts for the same token and then
trains experts that never produced the sample. With replay on, each learner forward takes the
engine's top-k expert indices for every prompt and sampled token (megatron's REPLAY_FORWARD
action: the router's probabilities are its own scores gathered at the replayed experts, so the
router still gets a gradient).

The engine's routing of a sequence is [tokens, decoder layers, top-k], vLLM's `routed_experts`
layout: every decoder layer has a row, dense layers (`mlp_only_layers`, `decoder_sparse_step`) too,
which nothing reads. The last sampled token is never fed back through the engine, and padding never
was: those positions get filler experts spread over all experts by position (so that no EP rank
receives more than its share of them), harmless because causal attention keeps a position's hidden
state out of every earlier one and the loss masks them. Expert loads are counted over real tokens
only.

Metrics: the share of tokens with engine routing whose learner routing (its own top-k on the same
scores) picks other experts, with or without replay; per MoE layer the load of its busiest expert
against the mean (1.0: balanced) and the router's entropy (nats; ln E when uniform) over the tokens
of the step. Tokens dropped: none, the layers are dropless (no moe_expert_capacity_factor).
"""
from __future__ import annotations

import re
from collections import deque

import torch

_ROUTER = re.compile(r"^(?:.*\.)?decoder\.layers\.(\d+)\.mlp\.router$")


def routing_tensor(seqs, length: int, num_layers: int, top_k: int,
                   num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([b, length, layers, k] int16 expert indices, [b, length] bool: given by the engine) for a
    micro-batch. A position without engine routing (padding, each sequence's last token) holds
    k distinct filler experts (j * E // k + position) mod E: spread evenly over the experts."""
    position = torch.arange(len(seqs) * length).view(len(seqs), length, 1, 1)
    slot = torch.arange(top_k).view(1, 1, 1, top_k) * (num_experts // top_k)
    routing = ((position + slot) % num_experts).to(torch.int16).expand(len(seqs), length, num_layers, top_k).clone()
    valid = torch.zeros(len(seqs), length, dtype=torch.bool)
    for row, seq in enumerate(seqs):
        if seq.routed_experts is None:
            continue
        r = torch.as_tensor(seq.routed_experts).to(torch.int16)
        n = r.shape[0]
        routing[row, :n] = r
        valid[row, :n] = True
    return routing, valid


def check_routing(seqs, num_layers: int, top_k: int, num_experts: int) -> None:
    """Every sequence carries the engine's routing of its tokens (all but the last sampled one,
    which the engine never ran) for every decoder layer, in range; the error names the sequence."""
    for i, seq in enumerate(seqs):
        where = f"sequence {i} ({seq.role or 'unnamed role'})"
        if seq.routed_experts is None:
            raise ValueError(f"train.routing_replay is on but {where} came from an engine that returned no "
                             "routing (vLLM needs enable_return_routed_experts; turn replay off to train "
                             "without it)")
        r = torch.as_tensor(seq.routed_experts)
        expected = (len(seq) - 1, num_layers, top_k)
        if tuple(r.shape) != expected and tuple(r.shape) != (len(seq), num_layers, top_k):
            raise ValueError(f"{where}: routed_experts has shape {tuple(r.shape)}, expected {expected} "
                             "(tokens but the last, decoder layers, top-k)")
        if r.numel() and (int(r.min()) < 0 or int(r.max()) >= num_experts):
            raise ValueError(f"{where}: routed_experts names an expert outside 0..{num_experts - 1}")


class RoutingReplay:
    """The learner's routers with their global decoder-layer index; sets each micro-batch's engine
    routing before its forward and counts where the learner's own choice differs."""

    def __init__(self, model, layer_offset: int, replay: bool, tp_rank: int, tp: int, sequence_parallel: bool,
                 device: torch.device):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.replay, self.tp_rank, self.tp, self.sp, self.device = replay, tp_rank, tp, sequence_parallel, device
        self._action = RouterReplayAction.REPLAY_FORWARD
        self.routers = []  # (router's RouterReplay, decoder-layer index in the whole model)
        # A recomputed MoE layer (train.recompute full, or selective moe) runs its router again in
        # the backward, after later micro-batches' forwards set their routing (1F1B with PP > 1):
        # each training forward queues the experts it used, and the recompute takes them back in
        # the same order (the schedule's backwards run in forward order). Not counted twice either.
        self.keep_for_backward = False  # set by the learner for a training pass with recomputed MoE layers
        self._for_backward: list[deque] = []
        self._valid: torch.Tensor | None = None
        self._real: torch.Tensor | None = None
        # summed over the step's forwards on the router's device, copied to the host once per step
        # (take_counts): [differing, engine-routed] (token, layer) pairs, and per router
        # [expert counts..., entropy sum, tokens]
        self._differ: torch.Tensor | None = None
        self.load: dict[int, torch.Tensor] = {}
        self.add_chunk(model, layer_offset)

    def add_chunk(self, model, layer_offset: int) -> None:
        """The routers of one model chunk (virtual pipeline stages: a rank holds several), numbered from
        its first layer's index in the whole model."""
        start = len(self.routers)
        for name, module in model.named_modules():
            m = _ROUTER.match(name)
            if m and getattr(module, "router_replay", None) is not None:
                self.routers.append((module.router_replay, int(m.group(1)) + layer_offset))
                self._wrap(module.router_replay)
        # megatron appends every RouterReplay to a class-level list (for its static set/record
        # helpers, which address routers by instantiation order across the whole process); these are
        # addressed by module name, so they leave it: a process that builds several learners would
        # otherwise keep every one of their routers alive
        mine = {id(rr) for rr, _ in self.routers[start:]}
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.global_router_replay_instances[:] = [
            rr for rr in RouterReplay.global_router_replay_instances if id(rr) not in mine]

    def start_pass(self, keep_for_backward: bool) -> None:
        """Before a pass of the pipeline schedule: whether its MoE layers run again in its backward."""
        self.keep_for_backward = keep_for_backward
        for queued in self._for_backward:
            queued.clear()

    def _wrap(self, rr) -> None:
        """Around megatron's get_replay_topk: also the learner's own top-k, for the metric."""
        original = rr.get_replay_topk
        layer = len(self.routers) - 1
        self._for_backward.append(deque())

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if torch._C._current_graph_task_id() != -1:  # inside autograd's backward: a recompute
                if not self.replay:  # the router's own choice again, from the same input
                    return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                indices = self._for_backward[layer].popleft()
                return scores.gather(1, indices), indices
            probs, indices = original(scores, topk, num_groups, group_topk, default_compute_topk)
            if self.keep_for_backward and self.replay:
                self._for_backward[layer].append(indices)
            self._count(layer, scores, indices)
            target = rr.target_topk_idx
            if target is not None and self._valid is not None:
                own = indices if not self.replay else default_compute_topk(scores, topk, num_groups=num_groups,
                                                                          group_topk=group_topk)[1]
                valid = self._valid
                changed = (own.sort(-1).values != target.long().sort(-1).values).any(-1)
                pair = torch.stack([(changed & valid).sum(), valid.sum()]).float()
                self._differ = pair if self._differ is None else self._differ + pair
            return probs, indices

        rr.get_replay_topk = get_replay_topk

    def _count(self, layer: int, scores: torch.Tensor, indices: torch.Tensor) -> None:
        with torch.no_grad():
            if self._real is not None:  # padding is not load: filler routing or the router's own
                scores, indices = scores[self._real], indices[self._real]
            n = scores.shape[-1]
            p = torch.softmax(scores.detach().float(), dim=-1)
            entropy = -(p * torch.log(p.clamp_min(1e-30))).sum()
            row = torch.cat([torch.bincount(indices.reshape(-1), minlength=n).float(), entropy.reshape(1),
                             torch.tensor([float(scores.shape[0])], device=scores.device)])
        self.load[layer] = self.load[layer] + row if layer in self.load else row

    def take_counts(self, num_layers: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Since the last call, this rank's ([differing, engine-routed] (token, layer) pairs,
        [decoder layers, experts + 2] expert counts, entropy sum and tokens by global layer index;
        dense layers' rows stay 0), on the host; resets them."""
        differ = self._differ.cpu() if self._differ is not None else torch.zeros(2)
        load = torch.zeros(num_layers, num_experts + 2)
        for i, row in self.load.items():
            load[self.routers[i][1]] = row.cpu()
        self._differ, self.load = None, {}
        return differ, load

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] -> the router's token order: sequence-first, this rank's sequence chunk under SP."""
        x = x.transpose(0, 1)
        if self.sp and self.tp > 1:
            chunk = x.shape[0] // self.tp
            x = x[self.tp_rank * chunk:(self.tp_rank + 1) * chunk]
        return x.reshape(-1, *x.shape[2:])

    def set(self, routing: torch.Tensor | None, valid: torch.Tensor | None, real: torch.Tensor | None = None) -> None:
        """Before a micro-batch's forward: its [b, s, layers, k] engine routing (None: none given),
        which positions the engine routed, and which are real tokens (not padding). Copied to the
        router's device once per micro-batch, not once per layer."""
        self._real = self._local(real).to(self.device) if real is not None else None
        if routing is None:
            self._valid = None
            for rr, _ in self.routers:
                rr.clear_indices()
                rr.clear_router_replay_action()
            return
        self._valid = self._local(valid).to(self.device)
        local = self._local(routing).to(self.device)  # [tokens, layers, k], int16
        for rr, layer in self.routers:
            rr.clear_indices()  # REPLAY_FORWARD reads the target only; its backward list would grow
            rr.set_target_indices(local[:, layer].long())
            if self.replay:
                rr.set_router_replay_action(self._action)
            else:  # measure only: the router picks its own experts
                rr.clear_router_replay_action()

    def metrics(self, num_layers: int, num_experts: int, device) -> tuple[float | None, dict[str, float] | None]:
        """Since the last call, over every rank (collective): the share of engine-routed (token,
        MoE layer) pairs whose learner routing differs from the engine's, and per MoE layer (keyed by
        its decoder-layer index) its busiest expert's load over the mean and its router's mean
        entropy, over real tokens. A token is counted by each TP rank that routes it; the shares are
        unchanged by that."""
        import torch.distributed as dist

        differ, load = self.take_counts(num_layers, num_experts)
        # on the device: the default group is NCCL on GPU
        counts = torch.cat([differ, load.reshape(-1)]).to(device)
        dist.all_reduce(counts)
        counts = counts.cpu()
        differs = float(counts[0] / counts[1]) if counts[1] > 0 else None
        load = counts[2:].view(num_layers, num_experts + 2)
        router = {}
        for layer, row in enumerate(load):
            experts, entropy, tokens = row[:-2], row[-2], row[-1]
            if tokens > 0:
                router[f"router/max_load/{layer}"] = float(experts.max() / experts.mean())
                router[f"router/entropy/{layer}"] = float(entropy / tokens)
        return differs, router or None
