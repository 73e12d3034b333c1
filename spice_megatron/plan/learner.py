"""The planner's learner layouts in three steps: the candidates a plan may take, in the order it
tries them (`learner_candidates`); what one of them needs per GPU, a pure function of the layout
(`evaluate_learner`); and the first that fits (`first_fitting`). `planner.plan_layout` adds the
engines and the placement around them; `plan_choice.rank_layouts` evaluates every layout."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from spice_megatron.config import ClusterConfig, ConfigError, SpiceConfig
from spice_megatron.entry import UserError
from spice_megatron.families import ModelSpec
from spice_megatron.plan.memory import LearnerMemory, learner_memory
from spice_megatron.policy.activation_memory import activation_flags
from spice_megatron.policy.model import check_parallel_layout, pipeline_stage_layers


class PlanError(UserError, ValueError):
    """No layout fits, or the requested one does not; the message carries the numbers."""


def gpu_split(cluster: ClusterConfig, colocate: bool) -> tuple[int, int]:
    """(learner GPUs, rollout GPUs): colocated, both are every GPU; one node is split in half;
    otherwise the learner and rollout nodes' GPUs (cluster.split)."""
    if colocate:
        return (cluster.nodes * cluster.gpus_per_node,) * 2
    if cluster.nodes == 1:
        learner = max(1, cluster.gpus_per_node // 2)
        return learner, cluster.gpus_per_node - learner
    learner_nodes, rollout_nodes = cluster.split()
    return learner_nodes * cluster.gpus_per_node, rollout_nodes * cluster.gpus_per_node


def powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(0, int(math.log2(limit)) + 1)]


def end_stage_layers(num_layers: int, pp: int) -> tuple[int, int] | None:
    """(first, last) stage layers for PP stages: (0, 0) when PP divides the layers; otherwise the
    middle stages take ceil(layers / PP) each and the first and last share the rest (NeMo-RL's
    Qwen3-235B: 11, 12 x 6, 11); None when that leaves either of them empty or above the middle's."""
    if num_layers % pp == 0:
        return 0, 0
    middle = -(-num_layers // pp)
    rest = num_layers - middle * (pp - 2)
    first, last = rest // 2, rest - rest // 2
    return (first, last) if pp >= 2 and 1 <= first and last <= middle else None


def tp_divides_model(spec: ModelSpec, tp: int) -> bool:
    return not (spec.num_heads % tp or spec.num_kv_heads % tp or spec.ffn_hidden_size % tp or spec.vocab_size % tp)


@dataclass(frozen=True)
class LearnerLayout:
    """One learner layout for `plan_layout(..., learner=)`: what rank_layouts tries one by one."""

    tp: int
    pp: int
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    cp: int = 1
    vpp: int = 1
    recompute: str = "off"


@dataclass(frozen=True)
class Candidate:
    """A learner layout with everything its memory depends on."""

    tp: int
    pp: int
    first: int
    last: int
    cp: int
    recompute: str
    offload: float  # optim.cpu_offload_fraction
    ep: int
    vpp: int

    def describe(self) -> str:
        return f"TP={self.tp} PP={self.pp}" + (f" CP={self.cp}" if self.cp > 1 else "")


def _refused(spec: ModelSpec, tp: int, pp: int, ep: int, etp: int, first: int, last: int, vpp: int) -> None:
    """What the learner would refuse is refused here, with its line."""
    try:
        check_parallel_layout(spec, tp, pp, ep, etp, first, last, vpp)
    except ConfigError as e:
        raise PlanError(f"{e}: the learner refuses this layout") from None


def learner_candidates(cfg: SpiceConfig, spec: ModelSpec, learner_gpus: int, choose: bool, colocate: bool,
                       learner: LearnerLayout | None = None, experts_across_nodes: bool = False) -> list[Candidate]:
    """Every layout to try, in order: the smallest optimizer offload first, recomputing every layer
    only after nothing fits without it, context parallelism only after that; within each, the
    smallest TP x PP (TP first, within a node: it needs the fastest links). Not choosing: the
    config's own layout, refused with the reason when the GPUs or the model cannot take it. With
    `learner`: that layout, everything else chosen."""
    gpus_per_node, fixed = cfg.cluster.gpus_per_node, not choose
    p = cfg.parallel
    moe = spec.moe
    ep = p.expert_parallel if moe is not None else 1
    if fixed:
        _refused(spec, p.tensor_parallel, p.pipeline_parallel, ep, p.expert_tensor_parallel if moe is not None else 1,
                 p.first_stage_layers, p.last_stage_layers, p.virtual_pipeline)
    shapes = ([(p.tensor_parallel, p.pipeline_parallel, p.first_stage_layers, p.last_stage_layers)] if fixed else
              sorted(((tp, pp, *end_stage_layers(spec.num_layers, pp))
                      for tp in powers_of_two(min(8, gpus_per_node)) for pp in range(1, spec.num_layers + 1)
                      if end_stage_layers(spec.num_layers, pp) is not None),
                     key=lambda x: (x[0] * x[1], x[1], x[2])))
    # context parallelism splits the activations, not the weights, exchanges K/V in every layer and
    # turns shared-prefix rows off
    cps = [p.context_parallel] if fixed else [1] + ([2, 4] if cfg.train.shared_prefix != "on" else [])
    vpp = p.virtual_pipeline if fixed else 1
    offloads = [cfg.optim.cpu_offload_fraction] if fixed or not colocate else [0.0, 0.25, 0.5, 0.75, 1.0]
    recomputes = [cfg.train.recompute] + (["full"] if choose and cfg.train.recompute != "full" else [])
    if learner is not None:
        _refused(spec, learner.tp, learner.pp, 1, 1, learner.first_stage_layers, learner.last_stage_layers,
                 learner.vpp)
        shapes = [(learner.tp, learner.pp, learner.first_stage_layers, learner.last_stage_layers)]
        cps, recomputes, vpp = [learner.cp], [learner.recompute], learner.vpp
    found = []
    for cp, recompute, offload in ((c, r, o) for c in cps for r in recomputes for o in offloads):
        for tp, pp, first, last in shapes:
            if learner_gpus % (tp * pp * cp) or not tp_divides_model(spec, tp) or tp > gpus_per_node:
                if fixed:
                    raise PlanError(f"parallel: TP={tp} x PP={pp} x CP={cp} does not fit {learner_gpus} learner "
                                    f"GPUs ({gpus_per_node} per node) or the model's head/layer counts")
                continue
            if moe is not None and not fixed:
                # as many experts apart as a node holds (the all-to-all stays on NVLink), or as the stage has
                span = learner_gpus // pp if experts_across_nodes else gpus_per_node
                ep = max(e for e in powers_of_two(min(moe.num_experts, span))
                         if (learner_gpus // pp) % e == 0 and moe.num_experts % e == 0)
            if moe is not None and ((learner_gpus // pp) % ep or moe.num_experts % ep):
                raise PlanError(f"parallel.expert_parallel: EP={ep} must divide num_experts={moe.num_experts} and "
                                f"the {learner_gpus // pp} learner GPUs of a pipeline stage")
            found.append(Candidate(tp, pp, first, last, cp, recompute, offload, ep, vpp))
    return found


def evaluate_learner(cfg: SpiceConfig, spec: ModelSpec, c: Candidate, learner_gpus: int, tokens: int) -> LearnerMemory:
    """A candidate's GiB per GPU with micro-batches of `tokens`: a rank runs 1/CP of each; the
    optimizer shards over data x context ranks."""
    flags = activation_flags(replace(cfg.parallel, tensor_parallel=c.tp), replace(cfg.train, recompute=c.recompute),
                             c.tp, on_gpu=True, transformer_engine=True)
    stage = max(pipeline_stage_layers(spec.num_layers, c.pp, c.first, c.last))
    return learner_memory(spec, c.tp, c.pp, learner_gpus // (c.tp * c.pp), -(-tokens // c.cp),
                          cfg.optim.use_distributed_optimizer, ep=c.ep, flags=flags, optimizer_offload=c.offload,
                          stage_layers=stage, vpp=c.vpp)


def first_fitting(cfg: SpiceConfig, spec: ModelSpec, candidates: list[Candidate], learner_gpus: int, tokens: int,
                  budget_gib: float) -> tuple[Candidate | None, LearnerMemory | None, list[str]]:
    """The first candidate within `budget_gib`, its memory, and what the first round tried (each
    layout at the first offload, recompute and CP) for the refusal to show."""
    tried, first = [], candidates[0] if candidates else None
    for c in candidates:
        mem = evaluate_learner(cfg, spec, c, learner_gpus, tokens)
        if mem.total <= budget_gib:
            return c, mem, tried
        if (c.offload, c.recompute, c.cp) == (first.offload, first.recompute, first.cp):
            tried.append(f"{c.describe()}: {mem.total:.1f} GiB (weights {mem.weights:.1f}, grads "
                         f"{mem.gradients:.1f}, optimizer {mem.optimizer:.1f}, activations {mem.activations:.1f}, "
                         f"logits {mem.logits:.1f})")
    return None, None, tried
