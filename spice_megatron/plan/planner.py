"""Layout planner: learner TP/PP/DP and rollout engines for a cluster, with a memory estimate.

The estimates (plan/memory.py) are the usual back-of-envelope ones for Megatron-Core mixed precision
(bf16 weights, fp32 gradient buffer, fp32 master weights and two Adam moments: 2 + 4 + 12 bytes per
parameter) and for vLLM (bf16 weights, paged KV cache in what gpu_memory_utilization leaves). A
layout that cannot fit is refused with the numbers, so the user sees which term is too large.

`step_time.estimate_step_time` turns a plan into seconds per SPICE iteration from stated throughput
assumptions (`Throughput`); it is a planning aid, not a measurement.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace

from spice_megatron.config import ClusterConfig, SpiceConfig
from spice_megatron.families import ModelSpec, model_spec_from_hf
from spice_megatron.plan.costs import (
    GiB,
)
from spice_megatron.plan.known_models import KNOWN_MODELS
from spice_megatron.plan.learner import (
    Candidate,
    LearnerLayout,
    PlanError,
    evaluate_learner,
    first_fitting,
    gpu_split,
    learner_candidates,
    powers_of_two,
)
from spice_megatron.plan.memory import (
    ENGINE_ASLEEP_GIB,
    LEARNER_RESIDENT_GIB,
    MIN_ENGINE_KV_TOKENS,
    EngineMemory,
    LearnerMemory,
    engine_memory,
)


def model_spec(model: str) -> ModelSpec:
    """The spec of a local HF directory, or of a known hub id."""
    if os.path.isdir(model) or model.endswith(".json"):
        return model_spec_from_hf(model)
    if model in KNOWN_MODELS:
        return model_spec_from_hf(KNOWN_MODELS[model])
    raise PlanError(f"run.model={model!r}: not a local HF directory and not one of the known models "
                    f"({', '.join(sorted(KNOWN_MODELS))}); pass the directory holding its config.json")


# ------------------------------------------------------------------------------------------ the plan


@dataclass
class LearnerPlan:
    """The learner: its GPUs, its layout and what it needs per GPU."""

    gpus: int
    tp: int
    pp: int
    dp: int
    memory: LearnerMemory
    ep: int = 1
    cp: int = 1  # parallel.context_parallel: each sequence over CP ranks (its activations split CP ways)
    vpp: int = 1  # parallel.virtual_pipeline: chunks per pipeline rank (the bubble divided by it)
    # uneven pipeline stages (parallel.first/last_stage_layers; 0: even)
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    recompute: str = "off"  # train.recompute as planned (chosen: "full" when nothing fits without it)
    optimizer_offload: float = 0.0  # optim.cpu_offload_fraction


@dataclass
class EnginePlan:
    """The rollout engines: their GPUs, how many of what TP, and what each holds per GPU."""

    gpus: int
    tp: int
    count: int
    memory: EngineMemory
    utilization: float = 0.0  # colocated: vLLM's gpu_memory_utilization, the engine's share of each GPU


@dataclass
class ColocatedPhases:
    """Colocated peaks per GPU (GiB): the step beside sleeping engines, the rollouts beside the
    learner's weights, the weight sync (engine weights awake, KV cache not yet)."""

    train_gib: float
    rollout_gib: float
    sync_gib: float


@dataclass
class Plan:
    model: str
    params_billion: float
    active_params_billion: float
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    learner: LearnerPlan
    engines: EnginePlan
    colocated: bool = False  # run.colocate: learner and engines on the same GPUs, taking turns (colocation.py)
    phases: ColocatedPhases | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        """The job's GPUs (colocated, learner and engines share them)."""
        return self.learner.gpus if self.colocated else self.learner.gpus + self.engines.gpus

    def as_dict(self) -> dict:
        d = asdict(self)
        d["learner"]["memory"]["total"] = self.learner.memory.total
        d["gpus"] = self.gpus
        return d

    def describe(self) -> str:
        lp, ep = self.learner, self.engines
        m, e = lp.memory, ep.memory
        active = (f" ({self.active_params_billion:.2f}B active per token)"
                  if self.active_params_billion < self.params_billion else "")
        lines = [
            f"model {self.model}: {self.params_billion:.2f}B parameters{active}",
            f"cluster: {self.nodes} node(s) x {self.gpus_per_node} GPUs of {self.gpu_memory_gib:.0f} GiB",
            f"learner: {lp.gpus} GPUs, TP={lp.tp} PP={lp.pp}"
            + (f" VPP={lp.vpp}" if lp.vpp > 1 else "") + (f" CP={lp.cp}" if lp.cp > 1 else "")
            + f" DP={lp.dp}" + (f" EP={lp.ep}" if lp.ep > 1 else "")
            + (f", stages of {lp.first_stage_layers} / .. / {lp.last_stage_layers} layers"
               if lp.first_stage_layers else "")
            + (f", recompute {lp.recompute}" if lp.recompute != "off" else ""),
            f"  per GPU: weights {m.weights:.1f} + grads {m.gradients:.1f} + optimizer {m.optimizer:.1f} + activations "
            f"{m.activations:.1f} + logits {m.logits:.1f} + overhead {m.overhead:.1f} = {m.total:.1f} GiB "
            f"of {self.gpu_memory_gib:.0f}",
            *([f"  experts: {m.experts:.1f} GiB of those weights, grads and optimizer state; all-to-all "
               f"{m.all_to_all_gib:.2f} GiB sent per GPU per micro-batch"] if m.experts else []),
            f"rollout: {ep.count} vLLM engine(s) x TP={ep.tp} on {ep.gpus} GPUs"
            + (" (the learner's, colocated)" if self.colocated else ""),
            f"  per GPU: weights {e.weights:.1f} GiB, KV cache {e.kv_cache:.1f} GiB "
            f"({e.kv_bytes_per_token // 1024} KiB/token: {e.max_sequences} full-length sequences per engine)",
        ]
        if self.phases is not None:
            ph = self.phases
            lines += [
                f"colocated phases per GPU: step {ph.train_gib:.1f} GiB (engines asleep, "
                f"{ENGINE_ASLEEP_GIB:.1f} each), rollouts {ph.rollout_gib:.1f} GiB (learner weights "
                f"{m.weights:.1f} + {LEARNER_RESIDENT_GIB:.1f} resident beside the engine's "
                f"{ep.utilization:.2f} of the GPU), weight sync {ph.sync_gib:.1f} GiB",
                *([f"  optimizer: {lp.optimizer_offload:.0%} of its state and update on the host "
                   f"(optim.cpu_offload_fraction)"] if lp.optimizer_offload else [])]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def plan_layout(cfg: SpiceConfig, spec: ModelSpec | None = None, choose: bool = False, headroom: float = 0.9,
                min_engine_kv_tokens: int = MIN_ENGINE_KV_TOKENS, colocate: bool | None = None,
                experts_across_nodes: bool = False, learner: LearnerLayout | None = None) -> Plan:
    """Check the config's layout (cfg.parallel, cfg.rollout.engine_tensor_parallel) against the
    cluster, or with `choose` pick one; `colocate` (default: run.colocate) plans learner and engines
    on the same GPUs.

    Choosing, the learner takes the smallest TP x PP that fits `headroom` of a GPU (TP first, within
    a node: it needs the fastest links); the rest of the learner GPUs are data parallel. An engine
    takes the smallest TP whose KV cache holds `min_engine_kv_tokens` tokens and a full-length sequence.

    Colocated, every GPU holds a learner rank and a share of an engine, and three peaks must fit:
    the learner's step beside sleeping engines, the rollouts (the engine's gpu_memory_utilization
    share beside the learner's weights, its optimizer state on the host) and the weight sync (the
    engine's weights awake beside the learner's, and vLLM's IPC staging buffer). Choosing, the
    engine gets what the learner's weights leave, and if the step does not fit, a share of the
    optimizer moves to the host (optim.cpu_offload_fraction). A mixture of experts is spread over as
    many GPUs of a stage as a node holds, or with `experts_across_nodes` over as many as the stage
    has (fewer experts per GPU, the all-to-all over InfiniBand; compare_placements ranks both).
    With `learner` (and `choose`), the learner takes that layout and everything else is chosen."""
    cluster: ClusterConfig = cfg.cluster
    spec = spec or model_spec(cfg.run.model)
    colocate = cfg.run.colocate if colocate is None else colocate
    learner_gpus, rollout_gpus = gpu_split(cluster, colocate)
    if rollout_gpus < 1:
        raise PlanError(f"cluster: {cluster.nodes} node(s) x {cluster.gpus_per_node} GPUs leave no GPU for rollout "
                        "engines")
    budget = cluster.gpu_memory_gib * headroom
    found, mem, tokens, bound = fit_learner(cfg, spec, learner_gpus, rollout_gpus, budget, headroom, choose, colocate,
                                            learner, experts_across_nodes)
    resident = mem.weights + LEARNER_RESIDENT_GIB  # colocated: what the learner keeps during the rollouts
    utilization = engine_share(cfg, resident, budget, headroom, choose, colocate)
    etp, em = choose_engines(cfg, spec, rollout_gpus, utilization, choose, colocate, min_engine_kv_tokens)
    phases = colocated_phases(cfg, spec, mem, em, resident, utilization, budget) if colocate else None
    notes = plan_notes(cfg, found, etp, tokens, bound, colocate)
    learner_plan = LearnerPlan(learner_gpus, found.tp, found.pp, learner_gpus // (found.tp * found.pp * found.cp), mem,
                               found.ep, found.cp, found.vpp, found.first, found.last, found.recompute, found.offload)
    engines = EnginePlan(rollout_gpus, etp, rollout_gpus // etp, em, utilization if colocate else 0.0)
    return Plan(cfg.run.model, spec.num_parameters / 1e9, spec.active_parameters / 1e9, cluster.nodes,
                cluster.gpus_per_node, cluster.gpu_memory_gib, learner_plan, engines, colocate, phases, notes)


def fit_learner(cfg: SpiceConfig, spec: ModelSpec, learner_gpus: int, rollout_gpus: int, budget: float,
                headroom: float, choose: bool, colocate: bool, learner: LearnerLayout | None,
                experts_across_nodes: bool) -> tuple[Candidate, LearnerMemory, int, str]:
    """The first learner layout that fits (beside sleeping engines when colocated), upgraded to two
    virtual pipeline stages where they still fit; its memory; the tokens its activations are planned
    at and what bounds them."""
    from spice_megatron.selfplay.context_budget import longest_sequence

    cluster = cfg.cluster
    learner_budget = budget - (ENGINE_ASLEEP_GIB if colocate else 0.0)
    # a sequence longer than the budget is a micro-batch of its own: activations are planned at it
    longest, bound = longest_sequence(cfg)
    tokens = max(cfg.train.micro_batch_tokens, longest)
    candidates = learner_candidates(cfg, spec, learner_gpus, choose, colocate, learner, experts_across_nodes)
    found, mem, tried = first_fitting(cfg, spec, candidates, learner_gpus, tokens, learner_budget)
    if found is None:
        shown = "; ".join(tried[:4]) + (f"; ... {len(tried) - 4} more" if len(tried) > 4 else "")
        sleeping = rollout_gpus // max(1, cfg.rollout.engine_tensor_parallel)
        beside = f" beside {sleeping} sleeping engines" if colocate else ""
        ways = ["more learner nodes", *([] if cfg.optim.use_distributed_optimizer else
                                        ["optim.use_distributed_optimizer=true"]),
                "optim.cpu_offload_fraction", "a smaller train.micro_batch_tokens"]  # not what the recipe sets
        raise PlanError(f"learner: no layout fits {learner_budget:.1f} GiB per GPU ({headroom:.0%} of "
                        f"{cluster.gpu_memory_gib:.0f}{beside}) on {learner_gpus} GPUs: {shown}. Use "
                        + ", ".join(ways[:-1]) + " or " + ways[-1])
    if choose and learner is None and found.pp > 1 and not found.first and spec.num_layers % (2 * found.pp) == 0:
        # two virtual stages per rank halve the bubble for a few more micro-batches' activations in
        # flight: taken where they still fit
        interleaved = evaluate_learner(cfg, spec, replace(found, vpp=2), learner_gpus, tokens)
        if interleaved.total <= learner_budget:
            found, mem = replace(found, vpp=2), interleaved
    return found, mem, tokens, bound


def engine_share(cfg: SpiceConfig, resident: float, budget: float, headroom: float, choose: bool,
                 colocate: bool) -> float:
    """vLLM's gpu_memory_utilization: the recipe's, or colocated and choosing, what the learner's
    resident weights leave of the budget; refused when colocated engines do not fit beside them."""
    gpu = cfg.cluster.gpu_memory_gib
    utilization = cfg.rollout.gpu_memory_utilization
    if colocate and choose:
        utilization = round(math.floor((budget - resident) / gpu * 100) / 100, 2)
    if colocate and resident + utilization * gpu > budget:
        raise PlanError(f"rollout.gpu_memory_utilization={utilization}: colocated, the engine's {utilization:.2f} x "
                        f"{gpu:.0f} GiB beside the learner's resident {resident:.1f} GiB exceeds "
                        f"{budget:.1f} GiB ({headroom:.0%}); at most "
                        f"{(budget - resident) / gpu:.2f} (`spice plan --choose` picks it)")
    return utilization


def choose_engines(cfg: SpiceConfig, spec: ModelSpec, rollout_gpus: int, utilization: float, choose: bool,
                   colocate: bool, min_engine_kv_tokens: int) -> tuple[int, EngineMemory]:
    """The engines' TP and memory: the recipe's TP, or choosing, the smallest whose KV cache holds
    `min_engine_kv_tokens` and a full-length sequence. Engines inside a node first; then across up
    to four whole nodes (slurm/rollout_node.sh starts a leader and followers; their all-reduces over
    InfiniBand), never colocated (sleep mode and IPC stay in a node)."""
    cluster = cfg.cluster
    engine_tps = [cfg.rollout.engine_tensor_parallel] if not choose else [
        t for t in powers_of_two(min(4 * cluster.gpus_per_node, rollout_gpus)) if spec.num_heads % t == 0
        and (t <= cluster.gpus_per_node or not colocate and t % cluster.gpus_per_node == 0)]
    if colocate and engine_tps[-1] > cluster.gpus_per_node:
        raise PlanError(f"rollout: engine TP={engine_tps[-1]} spans nodes and colocated engines stay within a node of "
                        f"{cluster.gpus_per_node} GPUs; use the disaggregated placement (run.colocate=false) or "
                        f"rollout.engine_tensor_parallel <= {cluster.gpus_per_node}")
    for etp in engine_tps:
        em = engine_memory(spec, etp, cluster.gpu_memory_gib, utilization, cfg.rollout.max_model_len)
        if em.kv_tokens >= min_engine_kv_tokens and em.max_sequences >= 1 and rollout_gpus % etp == 0:
            return etp, em
    raise PlanError(f"rollout: with engine TP={engine_tps[-1]} the KV cache is {em.kv_cache:.1f} GiB per GPU "
                    f"(weights {em.weights:.1f} GiB of {cluster.gpu_memory_gib * utilization:.1f} "
                    f"usable): {em.kv_tokens:,} tokens ({em.max_sequences} sequences of "
                    f"{cfg.rollout.max_model_len}), "
                    f"fewer than {min_engine_kv_tokens:,} or than one sequence; raise "
                    "rollout.engine_tensor_parallel "
                    "or lower rollout.max_model_len" + (" (colocated: the learner's weights take their share "
                                                        "of every GPU)" if colocate else ""))


def colocated_phases(cfg: SpiceConfig, spec: ModelSpec, mem: LearnerMemory, em: EngineMemory, resident: float,
                     utilization: float, budget: float) -> ColocatedPhases:
    """Colocated, the three peaks per GPU: the step beside sleeping engines, the rollouts beside the
    learner's weights, the weight sync; refused when the sync's does not fit."""
    gpu = cfg.cluster.gpu_memory_gib
    largest = 2 * spec.vocab_size * spec.hidden_size / GiB  # the embedding, bf16: one whole tensor per rank
    staging = max(cfg.rollout.bucket_mb / 1024, largest)  # vLLM's packed IPC buffer (engine_weights.py)
    phases = ColocatedPhases(
        train_gib=mem.total + ENGINE_ASLEEP_GIB,
        rollout_gib=resident + utilization * gpu,
        # the engine's share minus its KV cache: its weights and overhead, awake before the KV;
        # the learner's staging buffer and largest gathered tensor; the engine's clone of a
        # received chunk (vLLM's packed IPC consumer copies each before loading it)
        sync_gib=resident + utilization * gpu - em.kv_cache + 2 * staging + largest)
    if phases.sync_gib > budget:
        raise PlanError(f"colocated weight sync: the engine's weights ({em.weights:.1f} GiB) beside the learner's "
                        f"{resident:.1f} GiB and the IPC buffers ({2 * staging + largest:.1f} GiB) exceed "
                        f"{budget:.1f} GiB; "
                        "raise rollout.engine_tensor_parallel")
    return phases


def plan_notes(cfg: SpiceConfig, found: Candidate, etp: int, tokens: int, bound: str, colocate: bool) -> list[str]:
    """What a reader of the plan should know about where it runs (Plan.notes)."""
    cluster, notes = cfg.cluster, []
    if colocate:
        notes.append("colocated: the phases run one after another on every GPU; on-policy only (train.max_staleness=0)")
    if cfg.selfplay.challenger == "model" and not cfg.rollout.challenger_engines:
        ctp = challenger_engine_tp(cfg)
        notes.append(f"a local fixed challenger engine ({cfg.selfplay.challenger_model}) takes {ctp} more GPU(s) "
                     f"on the learner's node: {check_challenger_engine(cfg).kv_tokens:,} tokens of KV cache")
    if cluster.nodes == 1 and not colocate:
        notes.append("one node: learner and engines share it (GPUs split in half)")
    if found.tp > 1 and cluster.nodes > 1:
        notes.append("TP stays within a node; PP and DP cross nodes")
    if etp > cluster.gpus_per_node:
        span = etp // cluster.gpus_per_node
        notes.append(f"engine TP={etp} spans {span} nodes: slurm/rollout_node.sh starts a leader and {span - 1} "
                     "follower(s) per engine (vLLM's multi-node serving; its all-reduces cross the inter-node fabric)")
    if found.ep > cluster.gpus_per_node:
        notes.append(f"EP={found.ep} spans nodes: the experts' all-to-all crosses the inter-node fabric")
    if tokens > cfg.train.micro_batch_tokens:
        notes.append(f"activations planned at {tokens:,} tokens, the longest sequence ({bound}), over "
                     f"train.micro_batch_tokens={cfg.train.micro_batch_tokens:,}")
    return notes


def challenger_engine_tp(cfg: SpiceConfig) -> int:
    return cfg.rollout.challenger_engine_tensor_parallel or cfg.rollout.engine_tensor_parallel


def check_challenger_engine(cfg: SpiceConfig) -> EngineMemory:
    """A local fixed challenger engine (selfplay.challenger=model without rollout.challenger_engines)
    must hold its model and a useful KV cache at its TP; PlanError with the numbers otherwise."""
    ro, cluster = cfg.rollout, cfg.cluster
    tp = challenger_engine_tp(cfg)
    spec = model_spec(cfg.selfplay.challenger_model)
    em = engine_memory(spec, tp, cluster.gpu_memory_gib, ro.gpu_memory_utilization, ro.max_model_len)
    if em.kv_tokens < MIN_ENGINE_KV_TOKENS or em.max_sequences < 1:
        usable = cluster.gpu_memory_gib * ro.gpu_memory_utilization
        raise PlanError(
            f"rollout.challenger_engine_tensor_parallel={tp}: a local challenger engine for "
            f"{cfg.selfplay.challenger_model} ({spec.num_parameters / 1e9:.1f}B parameters) holds {em.weights:.1f} GiB "
            f"of weights per GPU of {usable:.1f} usable ({cluster.gpu_memory_gib:.0f} GiB x "
            f"{ro.gpu_memory_utilization}), leaving {max(em.kv_cache, 0):.1f} GiB of KV cache: {em.kv_tokens:,} tokens "
            f"({em.max_sequences} sequences of {ro.max_model_len}), fewer than {MIN_ENGINE_KV_TOKENS:,}; raise "
            "rollout.challenger_engine_tensor_parallel or serve it on its own nodes (rollout.challenger_engines)")
    return em
