"""Choosing among plans: each placement (colocated, disaggregated) with its chosen layout, the one
`spice plan --choose` takes, and every learner layout that fits ranked by planned throughput
(`spice plan --rank`). The plans and their step times are planner.py's."""
from __future__ import annotations

from spice_megatron.config import SpiceConfig
from spice_megatron.families import ModelSpec
from spice_megatron.plan.costs import Throughput
from spice_megatron.plan.learner import (
    LearnerLayout,
    PlanError,
    end_stage_layers,
    gpu_split,
    powers_of_two,
    tp_divides_model,
)
from spice_megatron.plan.planner import Plan, plan_layout
from spice_megatron.plan.step_time import estimate_step_time


def compare_placements(cfg: SpiceConfig, spec: ModelSpec, t: Throughput | None = None
                       ) -> dict[str, tuple[Plan, dict[str, float]] | str]:
    """The recipe's cluster planned both ways, each layout chosen: {"colocated": (plan, step time),
    "disaggregated": ...}, or the PlanError's message where a way does not fit. A mixture of experts'
    layout is the faster of its experts within a node and across a pipeline stage's nodes."""
    out: dict[str, tuple[Plan, dict[str, float]] | str] = {}
    for name, colocate in (("colocated", True), ("disaggregated", False)):
        tried: list[tuple[Plan, dict[str, float]]] = []
        for across in ([False, True] if spec.moe is not None else [False]):
            try:
                plan = plan_layout(cfg, spec, choose=True, colocate=colocate, experts_across_nodes=across)
            except PlanError as e:
                out.setdefault(name, str(e))
                continue
            tried.append((plan, estimate_step_time(plan, spec, cfg, t)))
        # experts across nodes where that is clearly faster (by more than the model's resolution, 5%)
        if tried:
            within = tried[0]
            out[name] = max(tried, key=lambda x: x[1]["tokens_per_s_per_gpu"] / (1.05 if x is not within else 1.0))
    return out


def rank_layouts(cfg: SpiceConfig, spec: ModelSpec, t: Throughput | None = None,
                 placements: tuple[bool, ...] = (True, False)) -> list[tuple[Plan, dict[str, float]]]:
    """Every learner layout the learner accepts that fits the cluster (TP within a node, PP in even
    or uneven stages, CP, VPP, the recipe's recompute or full, a mixture's experts within a node or
    across a stage's nodes), colocated and disaggregated, each with the rest chosen as --choose
    chooses it; fastest first (planned tokens/s/GPU on-policy). `--choose` takes the first layout
    that fits; this is what it would be measured against."""
    learner_gpus = {colocate: gpu_split(cfg.cluster, colocate)[0] for colocate in placements}
    recomputes = sorted({cfg.train.recompute, "full"})
    cps = [1] + ([2, 4] if cfg.train.shared_prefix != "on" else [])
    ranked, seen = [], set()
    for colocate in placements:
        for tp in (t_ for t_ in powers_of_two(min(8, cfg.cluster.gpus_per_node)) if tp_divides_model(spec, t_)):
            for pp in range(1, spec.num_layers + 1):
                stages = end_stage_layers(spec.num_layers, pp)
                if stages is None or learner_gpus[colocate] % (tp * pp):
                    continue
                vpps = [1, 2] if pp > 1 and stages == (0, 0) and spec.num_layers % (2 * pp) == 0 else [1]
                for cp, vpp, recompute, across in ((c, v, r, a) for c in cps for v in vpps for r in recomputes
                                                   for a in ([False, True] if spec.moe is not None else [False])):
                    if learner_gpus[colocate] % (tp * pp * cp):
                        continue
                    layout = LearnerLayout(tp, pp, *stages, cp=cp, vpp=vpp, recompute=recompute)
                    try:
                        plan = plan_layout(cfg, spec, choose=True, colocate=colocate, experts_across_nodes=across,
                                           learner=layout)
                    except PlanError:
                        continue
                    key = (colocate, layout, plan.learner.ep)
                    if key not in seen:
                        seen.add(key)
                        ranked.append((plan, estimate_step_time(plan, spec, cfg, t)))
    return sorted(ranked, key=lambda x: -x[1]["tokens_per_s_per_gpu"])


def choose_plan(cfg: SpiceConfig, both: dict[str, tuple[Plan, dict[str, float]] | str]) -> Plan:
    """`spice plan --choose`, from `compare_placements`: colocated when one node is all there is or
    when it is faster (tokens per second per GPU, on-policy), else disaggregated; PlanError when
    neither fits."""
    fits = {k: v for k, v in both.items() if not isinstance(v, str)}
    if not fits:
        raise PlanError("; ".join(f"{k}: {v}" for k, v in both.items()))
    if "colocated" in fits and (cfg.cluster.nodes == 1 or "disaggregated" not in fits or
                                fits["colocated"][1]["tokens_per_s_per_gpu"] >=
                                fits["disaggregated"][1]["tokens_per_s_per_gpu"]):
        return fits["colocated"][0]
    return fits["disaggregated"][0]
