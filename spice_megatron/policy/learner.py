"""The learner: a megatron-core GPTModel under TP x PP x DP, its optimizer and its DrGRPO step.

Every rank runs the same calls (SPMD). Sequences come in as token ids with their advantages;
log-probabilities come from vocab-parallel logits (each TP rank holds V/TP of the vocabulary;
megatron's vocab-parallel cross entropy reduces across TP, never gathering the full vocabulary).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from spice_megatron.config import ConfigError, OptimConfig, ParallelConfig, PolicyTrainConfig
from spice_megatron.families import ModelSpec
from spice_megatron.policy import cpu_compat
from spice_megatron.policy.batching import MicroBatch, TrainSequence, make_microbatches, split_data_parallel
from spice_megatron.policy.context_parallel import rank_micro_batch, whole_sequence
from spice_megatron.policy.logprobs import gather_scored
from spice_megatron.policy.mismatch import mismatch_by_role, mismatch_metrics, mismatch_rows
from spice_megatron.policy.model import build_policy_model, have_transformer_engine, layer_offset, resolve_shared_prefix
from spice_megatron.policy.optimizer import data_parallel_chunks, lr_scheduler, megatron_optimizer
from spice_megatron.policy.packing import minibatch_split, packed_microbatches, split_units_data_parallel
from spice_megatron.policy.parallel import Layout, current_layout, init_distributed, layout_matches
from spice_megatron.policy.routing_replay import RoutingReplay, check_routing
from spice_megatron.policy.shared_prefix import PackedForward, scored_logprobs
from spice_megatron.selfplay.loss import drgrpo_token_loss

log = logging.getLogger(__name__)
# tools/bench/bench_checkpoint.py measures the distributed optimizer's saves on CPU, where its restore is
# broken (below): it alone turns the refusal off
ALLOW_TORCH_DISTRIBUTED_OPTIMIZER = False
ZERO_ADVANTAGE = 1e-12  # |advantage| at or below it: a group's rewards were equal (rounding aside)


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


@dataclass
class StepMetrics:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    tokens_run: int  # real tokens through the forward (shared prompts once), fillers and padding aside
    sequences: int  # the step's mini-batch (DrGRPO's normaliser)
    trained_sequences: int  # of them, those with a non-zero advantage: the others add no gradient
    clip_fraction: float
    approx_kl: float
    logprob_gap: float | None  # mean |train - rollout| log-prob on sampled tokens
    seconds: float
    # per role: learner vs engine on the sampled tokens (logprob_gap_mean / _max, k3_kl, tis_capped)
    mismatch: dict[str, float] | None = None
    # mixture-of-experts: share of (token, MoE layer) pairs where the learner's own top-k differs
    # from the engine's routing (with replay on, the experts actually used are the engine's)
    routing_differs: float | None = None
    router: dict[str, float] | None = None  # per MoE layer: router/max_load/{l}, router/entropy/{l}

    def as_dict(self) -> dict[str, float]:
        out = {k: v for k, v in self.__dict__.items() if v is not None and k not in ("mismatch", "router")}
        return {**out, **(self.mismatch or {}), **(self.router or {})}


class Learner:
    def __init__(self, spec: ModelSpec, parallel: ParallelConfig, optim: OptimConfig, train: PolicyTrainConfig,
                 pad_id: int = 0, load_weights: Callable[["Learner"], None] | None = None):
        """`load_weights(learner)` fills `learner.model` before the optimizer exists: megatron's
        bf16 optimizers copy fp32 main weights from the model when they are built and write them
        back after every step, so weights loaded later would be replaced by the random init."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

        for c in (parallel, optim, train):
            c.validate()
        if optim.use_distributed_optimizer and USING_PYTORCH_OPTIMIZER and not ALLOW_TORCH_DISTRIBUTED_OPTIMIZER:
            # megatron-core 0.16.1's torch fallback restores one shared Adam `step` tensor for all
            # parameters on load, silently corrupting resumed runs (docs/architecture.md, "bf16").
            raise ConfigError("optim.use_distributed_optimizer: needs Transformer Engine or apex; the torch "
                              "fallback's checkpoint restore is broken in megatron-core 0.16.1")
        if "moe_act" in train.recompute_modules and train.recompute == "selective" and not have_transformer_engine():
            raise ConfigError("train.recompute_modules: moe_act recomputes the grouped experts' activation "
                              "(Transformer Engine's grouped GEMM); without it use moe")
        train = resolve_shared_prefix(spec, train, parallel.context_parallel)
        self.spec, self.parallel, self.optim_cfg, self.train_cfg, self.pad_id = spec, parallel, optim, train, pad_id
        if not dist.is_initialized() or not layout_matches(parallel):
            init_distributed(parallel, seed=train.seed)
        self.layout: Layout = current_layout()
        self.dtype = resolve_dtype(train.dtype)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.routing_replay = spec.moe is not None and train.routing_replay != "off"
        if spec.moe is None and train.routing_replay == "on":
            raise ConfigError(f"train.routing_replay: on, but {spec.architecture} has no experts to route")
        # megatron's RouterReplay hooks exist in every MoE model: with replay off they still measure
        # how often the learner's routing differs from the engine's
        # with virtual pipeline stages a rank holds several non-adjacent chunks of layers
        stages = list(range(self.layout.vpp)) if self.layout.vpp > 1 else [None]
        built = [build_policy_model(spec, parallel, train, self.layout, self.dtype, self.device, vp_stage=v)
                 for v in stages]
        self.chunks = [model for model, _, _ in built]
        self.model = self.chunks[0]  # the rank's model unless parallel.virtual_pipeline > 1
        _, self.tconfig, self.activation_flags = built[0]
        # micro-batches are padded to a multiple of TP under sequence parallelism; on GPU of 128 too,
        # the alignment Transformer Engine's kernels want (on CPU the padding would cost the tests)
        self.seq_multiple = 1
        if self.tconfig.sequence_parallel:
            self.seq_multiple = math.lcm(self.layout.tp, 128) if torch.cuda.is_available() else self.layout.tp
        if self.layout.cp > 1:  # 2 x CP equal chunks, each rank's two still a multiple of the above
            self.seq_multiple = math.lcm(2 * self.layout.cp, self.layout.cp * self.seq_multiple)
        # An expert-parallel group wider than the TP group holds several DP replicas, and every MoE
        # layer's all-to-all needs each of them in each forward: they run equal micro-batch counts.
        self.ep_spans_dp = spec.moe is not None and self.layout.ep * self.layout.etp > self.layout.tp
        self.num_experts = spec.moe.num_experts if spec.moe is not None else 0
        self.shared_prefix = train.use_shared_prefix
        self.packed: PackedForward | None = None
        if self.shared_prefix:
            from megatron.core import parallel_state as ps

            self.packed = PackedForward(self.chunks, ps.get_tensor_model_parallel_group())
        self.replay: RoutingReplay | None = None
        self.moe_recomputed = train.recompute == "full" or (train.recompute == "selective"
                                                            and "moe" in train.recompute_modules)
        if spec.moe is not None:
            self.replay = RoutingReplay(self.model, layer_offset(self.model), self.routing_replay, self.layout.tp_rank,
                                        self.layout.tp, bool(self.tconfig.sequence_parallel), self.device)
            for chunk in self.chunks[1:]:
                self.replay.add_chunk(chunk, layer_offset(chunk))
        if load_weights is not None:
            load_weights(self)
        self.ddp_chunks = data_parallel_chunks(self.chunks, optim, self.layout.dp)
        self.ddp = self.ddp_chunks[0]
        self.optimizer = megatron_optimizer(self.ddp_chunks, optim, self.dtype)
        self.scheduler = lr_scheduler(self.optimizer, optim)
        self.tconfig.no_sync_func = ([d.no_sync for d in self.ddp_chunks] if len(self.ddp_chunks) > 1
                                     else self.ddp.no_sync)
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.steps = 0

    # ------------------------------------------------------------------------- forward/backward

    def _run(self, microbatches: list[MicroBatch], loss_fn: Callable, forward_only: bool) -> list[dict]:
        """One pass of megatron's pipeline schedule; returns the last stage's per-micro-batch outputs."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if self.replay is not None:
            self.replay.start_pass(keep_for_backward=not forward_only and self.moe_recomputed)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if self.layout.cp > 1:
                mb = rank_micro_batch(mb, self.layout.cp, self.layout.cp_rank)
            if self.replay is not None:
                self.replay.set(mb.routing, mb.routing_valid, mb.token_mask)
            if self.packed is not None:
                self.packed.set(mb, self.device)
            try:
                # a packed row's structure stays on the host: each core attention reads its segments
                out = model(mb.tokens.to(self.device), mb.position_ids.to(self.device),
                            attention_mask=mb.attention_mask)
            finally:
                if self.packed is not None:
                    self.packed.clear()
            return out, lambda output: loss_fn(mb, output)

        # the interleaved schedule (virtual pipeline stages) reads each chunk's micro-batches from its own iterator
        data = [iter(microbatches) for _ in self.ddp_chunks] if len(self.ddp_chunks) > 1 else iter(microbatches)
        with cpu_compat.cuda_to_cpu():
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=self.ddp_chunks,
                num_microbatches=len(microbatches), seq_length=microbatches[0].tokens.shape[1],
                micro_batch_size=microbatches[0].tokens.shape[0], forward_only=forward_only) or []

    def _gather(self, local: list) -> list:
        """Concatenate per-rank lists from the last pipeline stage's TP rank 0 onto every rank (of each
        context-parallel rank: each holds a part of every sequence's tokens)."""
        mine = local if (self.layout.is_last_stage and self.layout.tp_rank == 0) else []
        everything: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(everything, mine)
        return [x for part in everything for x in part]

    @torch.no_grad()
    def compute_logprobs(self, seqs: list[TrainSequence]) -> list[list[float]]:
        """Log-probs of each sequence's completion tokens under the current weights (every rank
        gets the full result)."""
        self._check_routing(seqs)
        for chunk in self.chunks:
            chunk.eval()
        mbs = self._microbatches(seqs)

        def loss_fn(mb: MicroBatch, logits: torch.Tensor):
            lp = scored_logprobs(mb, logits, self.train_cfg.temperature)
            if self.layout.cp > 1:  # this rank's positions: the whole sequences onto every CP rank
                from megatron.core import parallel_state as ps

                group = ps.get_context_parallel_group()
                lp, loss_mask = (whole_sequence(x, self.layout.cp, group) for x in (lp, mb.loss_mask.to(lp.device)))
                mb = dataclasses.replace(mb, loss_mask=loss_mask)
            keep = torch.tensor([i >= 0 for i in mb.index])
            mask = (mb.loss_mask > 0) & keep.unsqueeze(-1)
            # this micro-batch's sequences, their completion lengths and log-probs, kept on the device
            index = torch.tensor([i for i in mb.index if i >= 0], dtype=torch.long)
            return torch.zeros((), device=logits.device), {"index": index, "counts": mask.sum(-1)[keep],
                                                           "values": lp[mask.to(lp.device)].float()}

        outs = self._run(mbs, loss_fn, forward_only=True)
        result: list[list[float]] = [[] for _ in seqs]
        index, counts, values = gather_scored(outs, self.layout, self.device)
        for i, part in zip(index.tolist(), values.split(counts.tolist())):
            result[i] = part.tolist()
        return result

    def _microbatches(self, seqs: list[TrainSequence], old: list[list[float]] | None = None) -> list[MicroBatch]:
        """This DP rank's micro-batches: shared-prefix packed rows, or one padded row per sequence."""
        make = packed_microbatches if self.shared_prefix else make_microbatches
        # the interleaved schedule runs micro-batches in groups of PP: a multiple of it (masked fillers)
        return make(seqs, self.layout.dp, self.layout.dp_rank, self.train_cfg.micro_batch_tokens, self.pad_id, old,
                    pad_to=self.seq_multiple, equal_counts=self.ep_spans_dp, num_experts=self.num_experts,
                    count_multiple=self.layout.pp if self.layout.vpp > 1 else 1)

    def data_parallel_split(self, seqs: list[TrainSequence]) -> list[list[int]]:
        """Sequence indices per DP rank, as _microbatches splits them (a prompt's group on one rank)."""
        if self.shared_prefix:
            return split_units_data_parallel(seqs, self.layout.dp)
        return split_data_parallel([len(x) for x in seqs], self.layout.dp)

    def steps_for(self, num_sequences: int) -> int:
        """Optimiser steps for a batch: ceil(n / trajectories_per_update) (the paper's updates of
        128 trajectories), else train.steps_per_batch."""
        per_update = self.train_cfg.trajectories_per_update
        if per_update:
            return max(1, -(-num_sequences // per_update))
        return self.train_cfg.steps_per_batch

    def check_staleness(self, seqs: list[TrainSequence], version: int) -> None:
        """Refuses a sequence any of whose tokens was sampled more than train.max_staleness weight
        versions before `version` (the learner's, before this step)."""
        bound = self.train_cfg.max_staleness
        for i, x in enumerate(seqs):
            oldest = min((v for v, _, _ in x.versions or ()), default=version)
            if version - oldest > bound:
                raise ValueError(f"sequence {i} ({x.role or 'no role'}): sampled by weights version {oldest}, the "
                                 f"learner is at {version}; train.max_staleness={bound}")

    def _check_routing(self, seqs: list[TrainSequence]) -> None:
        """The routing of the sequences this DP rank runs (the driver sends each replica only its own)."""
        if self.routing_replay:
            moe = self.spec.moe
            mine = self.data_parallel_split(seqs)[self.layout.dp_rank]
            check_routing([seqs[i] for i in sorted(mine)], self.spec.num_layers, moe.top_k, moe.num_experts)

    def trained_mask(self, seqs: list[TrainSequence]) -> list[bool]:
        """Which sequences the learner runs. DrGRPO's gradient is a sum of advantage-weighted terms
        over a fixed normaliser (the step's sequences x max_gen_len): a zero-advantage sequence (a
        group everyone solved or nobody did) adds exactly nothing, so its forward and backward are
        skipped; a role with nothing to learn keeps one sequence, so its learner-vs-engine metrics
        stay logged."""
        trains = [abs(s.advantage) > ZERO_ADVANTAGE or not self.train_cfg.skip_zero_advantage for s in seqs]
        for role in dict.fromkeys(s.role for s in seqs):
            mine = [i for i, s in enumerate(seqs) if s.role == role]
            if not any(trains[i] for i in mine):
                trains[mine[0]] = True
        return trains

    def routing_destinations(self, seqs: list[TrainSequence]) -> list[set[int]]:
        """For each sequence, the DP ranks whose micro-batches hold it in train_on_batch (the
        old-log-prob pass and the steps split the batch apart); empty: not trained."""
        trains, k = self.trained_mask(seqs), self.steps_for(len(seqs))
        passes = [[i for i in part if trains[i]] for part in minibatch_split(seqs, k)]
        if k > 1 and self.train_cfg.old_logprobs == "forward":  # train_on_batch's old-log-prob pass
            passes.append([i for i, t in enumerate(trains) if t])
        return self._destinations(seqs, passes)

    def forward_destinations(self, seqs: list[TrainSequence]) -> list[set[int]]:
        """The DP rank whose share of compute_logprobs(seqs) holds each sequence (all of them run)."""
        return self._destinations(seqs, [list(range(len(seqs)))])

    def _destinations(self, seqs: list[TrainSequence], passes: list[list[int]]) -> list[set[int]]:
        dest: list[set[int]] = [set() for _ in seqs]
        for idx in passes:
            for rank, part in enumerate(self.data_parallel_split([seqs[i] for i in idx])):
                for m in part:
                    dest[idx[m]].add(rank)
        return dest

    def train_on_batch(self, seqs: list[TrainSequence], version: int | None = None,
                       old_logprobs: dict[tuple, list[float]] | None = None) -> list[StepMetrics]:
        """Several optimiser steps on one rollout batch (k = steps_for(n) mini-batches, minibatch_split);
        from the second on, the PPO ratio is clipped against the log-probs before the first.
        `version`: the learner's weights version, checked against the sequences' (check_staleness).
        `old_logprobs`: those already run under these weights, by (prompt ids, completion ids) (the
        streamed iteration's, streamed_forward.py); the others are run here."""
        if version is not None:
            self.check_staleness(seqs, version)
        k = self.steps_for(len(seqs))
        trains = self.trained_mask(seqs)
        old_all: dict[int, list[float]] | None = None
        if k > 1 or self.train_cfg.old_logprobs == "rollout":
            kept = [i for i, t in enumerate(trains) if t]
            if self.train_cfg.old_logprobs == "forward":
                known = old_logprobs or {}
                keys = {i: seqs[i].key() for i in kept}
                missing = [i for i in kept if keys[i] not in known]  # the same on every rank: one batch, one dict
                old_all = {i: known[keys[i]] for i in kept if keys[i] in known}
                if missing:
                    old_all.update(zip(missing, self.compute_logprobs([seqs[i] for i in missing])))
            else:
                missing = [i for i in kept if seqs[i].rollout_logprobs is None]
                if missing:
                    raise ValueError(f"train.old_logprobs=rollout but sequences {missing[:5]} have no rollout "
                                     "log-probs")
                old_all = {i: seqs[i].rollout_logprobs for i in kept}
        # With one step and recomputed old log-probs the ratio is exactly 1: skip the extra pass.
        metrics = []
        for part in minibatch_split(seqs, k):
            idx = [i for i in part if trains[i]]
            old = [old_all[i] for i in idx] if old_all is not None else None
            metrics.append(self._optimizer_step([seqs[i] for i in idx], old, len(part)))
        return metrics

    def _optimizer_step(self, seqs: list[TrainSequence], old: list[list[float]] | None, n_global: int) -> StepMetrics:
        """One optimiser step on `seqs`, the trained part of a mini-batch of `n_global` sequences
        (none left: every rank steps on a masked filler, so that Adam's momentum still moves)."""
        t0 = time.perf_counter()
        self._check_routing(seqs)
        for chunk in self.chunks:
            chunk.train()
        cfg = self.train_cfg
        mbs = self._microbatches(seqs, old)
        # megatron divides each micro-batch loss by the rank's micro-batch count and DDP averages
        # gradients over DP; undo both so that gradients are those of the global DrGRPO objective.
        scale = len(mbs) * self.layout.dp

        tis_cap = cfg.tis_cap if cfg.use_tis else None

        def loss_fn(mb: MicroBatch, logits: torch.Tensor):
            dev = logits.device
            lp = scored_logprobs(mb, logits, cfg.temperature)
            mask = mb.loss_mask.to(dev)
            old_lp = mb.old_logprobs.to(dev) if mb.old_logprobs is not None else None
            engine_lp = mb.rollout_logprobs.to(dev)
            rollout_mask = mask * mb.has_rollout.to(dev).unsqueeze(-1).to(mask.dtype)
            if tis_cap is not None:  # a sequence without engine log-probs keeps weight 1
                engine_lp = torch.where(rollout_mask > 0, engine_lp, (lp if old_lp is None else old_lp).detach())
            loss, m = drgrpo_token_loss(lp, mb.advantages.to(dev), mask, cfg.max_gen_len, old_logprobs=old_lp,
                                        num_sequences=n_global, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                        engine_logprobs=engine_lp if tis_cap is not None else None, tis_cap=tis_cap)
            gap = ((lp.detach() - mb.rollout_logprobs.to(dev)).abs() * rollout_mask).sum()
            run = mb.token_mask.sum().to(dev)
            scalars = torch.stack([loss.detach(), m["tokens"], m["clip_fraction"] * m["tokens"],
                                   m["approx_kl"] * m["tokens"], gap, rollout_mask.sum(), run]).float()
            rows = mismatch_rows(lp.detach(), old_lp, mb.rollout_logprobs.to(dev), rollout_mask, cfg.tis_cap)
            # one device-to-host copy per micro-batch for all of its metrics
            host = torch.cat([scalars, rows.reshape(-1).float()]).tolist()
            stats = dict(zip(("loss", "tokens", "clipped", "kl", "gap", "gap_tokens", "run"), host[:7]))
            stats["mismatch"] = mismatch_by_role([host[7 + 5 * i:12 + 5 * i] for i in range(len(mb.roles))], mb.roles)
            return loss * scale, stats

        # optim.lr=0 (a control run): Adam's update and its decoupled weight decay are both scaled by
        # the learning rate, so the weights cannot move; the forward pass alone gives the metrics.
        frozen = self.optim_cfg.lr == 0
        if frozen:
            with torch.no_grad():
                outs = self._run(mbs, loss_fn, forward_only=True)
            ok, grad_norm = True, 0.0
        else:
            for ddp in self.ddp_chunks:
                ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            outs = self._run(mbs, loss_fn, forward_only=False)
            with cpu_compat.cuda_to_cpu():
                ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.steps += 1
        parts = self._gather(outs)
        tokens = sum(p["tokens"] for p in parts)
        gap_tokens = sum(p["gap_tokens"] for p in parts)
        if not ok:
            log.warning("optimizer step %d skipped (non-finite gradients)", self.steps)
        differs, router = None, None
        if self.replay is not None:
            differs, router = self.replay.metrics(self.spec.num_layers, self.spec.moe.num_experts, self.device)
        return StepMetrics(
            loss=sum(p["loss"] for p in parts), grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=self.optimizer.param_groups[0]["lr"], tokens=int(tokens), sequences=n_global,
            tokens_run=int(sum(p["run"] for p in parts)),
            trained_sequences=len(seqs),
            clip_fraction=sum(p["clipped"] for p in parts) / max(tokens, 1),
            approx_kl=sum(p["kl"] for p in parts) / max(tokens, 1),
            logprob_gap=sum(p["gap"] for p in parts) / gap_tokens if gap_tokens else None,
            seconds=time.perf_counter() - t0, mismatch=mismatch_metrics([p["mismatch"] for p in parts]),
            routing_differs=differs, router=router)
