"""`spice plan`'s report: the recipe's layout checked against a cluster (or the planner's choice),
its memory per GPU, the estimated seconds per iteration with the assumptions behind them, the
placements side by side, the ranked layouts, and the overrides that lay a run out that way."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

from spice_megatron.bridge.preflight import looks_like_local_path
from spice_megatron.config import GPU_PARTS
from spice_megatron.entry import require_dir


def _what_instead(args: argparse.Namespace, cfg) -> str:
    """What to run instead when the recipe's own layout does not fit the cluster asked about."""
    from recipes import recipe_names

    if args.choose:
        return ""
    one_node = f"{args.recipe}_1node"
    if cfg.cluster.nodes == 1 and one_node in recipe_names():
        return f"; on one node: --recipe {one_node} (learner and engines colocated), or --choose"
    return f"; or let the planner choose: spice plan --recipe {args.recipe} --nodes {cfg.cluster.nodes} --choose"


def plan_command(args: argparse.Namespace) -> int:
    """`spice plan`: check a recipe's layout against a cluster (or choose one), estimate its step
    time, and print the report (or --json)."""
    from recipes import resolve_recipe
    from spice_megatron.plan.choice import choose_plan, compare_placements, rank_layouts
    from spice_megatron.plan.planner import PlanError, model_spec, plan_layout
    from spice_megatron.plan.step_time import estimate_step_time
    from spice_megatron.policy.model import resolve_shared_prefix

    cfg = resolve_recipe(args.recipe, args.overrides)
    if args.nodes is not None and args.learner_nodes is None:
        cfg.cluster.learner_nodes = 0  # another node count: split it in half
    if args.gpu is not None:  # another part: its memory unless --gpu-memory-gib says otherwise
        cfg.cluster.gpu, cfg.cluster.gpu_memory_gib = args.gpu, GPU_PARTS[args.gpu][0]
    for name in ("nodes", "gpus_per_node", "gpu_memory_gib", "learner_nodes"):
        if getattr(args, name) is not None:
            setattr(cfg.cluster, name, getattr(args, name))
    cfg.cluster.validate()
    if args.model and looks_like_local_path(args.model):
        require_dir(args.model, "--model")
    cfg.run.model = args.model or cfg.run.model
    if not cfg.run.model:  # the CPU recipes name none: the model `spice train` would build or unpack
        from spice_megatron.data.offline_assets import default_cpu_model

        cfg.run.model = default_cpu_model(args.recipe)
    cfg.validate()  # a bad override is one line, as `spice train` says it
    spec = model_spec(cfg.run.model)
    placements = compare_placements(cfg, spec)  # both ways, each with its own chosen layout
    # the recipe's own layout: plan_layout refuses what the learner would, named by its field
    try:
        plan = choose_plan(cfg, placements) if args.choose else plan_layout(cfg, spec)
    except PlanError as e:
        raise PlanError(str(e) + _what_instead(args, cfg)) from None
    if plan.colocated != cfg.run.colocate:  # --choose switched placement: plan the rest with it
        cfg = replace(cfg, run=replace(cfg.run, colocate=plan.colocated),
                      train=replace(cfg.train, max_staleness=0) if plan.colocated else cfg.train)
    step = estimate_step_time(plan, spec, cfg)
    unshared = estimate_step_time(plan, spec, replace(cfg, train=replace(cfg.train, shared_prefix="off")))
    ranked = rank_layouts(cfg, spec) if args.rank else []
    if args.json:
        print(json.dumps({"plan": plan.as_dict(), "step_seconds": step, "step_seconds_unshared": unshared,
                          "placements": {k: v if isinstance(v, str) else {"plan": v[0].as_dict(), "step_seconds": v[1]}
                                         for k, v in placements.items()},
                          **({"ranked": [{"plan": p.as_dict(), "step_seconds": st} for p, st in ranked[:args.rank]]}
                             if args.rank else {})}, indent=2))
        return 0
    print(plan.describe())
    print(f"estimated seconds per iteration (B={cfg.selfplay.batch_docs}, G={cfg.selfplay.group_size}; "
          f"assumptions in spice_megatron/plan/costs.py:Throughput):")
    schedule = "streamed" if cfg.run.streamed else "phased"
    for k, v in step.items():
        if k in ("challenger_rollout", "reasoner_rollout", "rollout_phased", "rollout_streamed"):
            break  # the phased phases and both schedules: below
        print(f"  {k:20s} {v:8.1f}" + (f"   (run.streamed={str(cfg.run.streamed).lower()})" if k == "rollout" else ""))
    print(f"  rollouts phased {step['rollout_phased']:.1f} s (challenger {step['challenger_rollout']:.1f}, reasoner "
          f"{step['reasoner_rollout']:.1f}: each phase waits for the batch's longest sequence), streamed "
          f"{step['rollout_streamed']:.1f} s (each document's requests as soon as it can make them): "
          f"{step['rollout_phased'] / step['rollout_streamed']:.2f}x; this run: {schedule}")
    if step["old_logprobs_during_rollouts"]:
        print(f"  the learner's old-log-prob forward runs during the streamed rollouts: "
              f"{step['old_logprobs_during_rollouts']:.1f} s of its step hidden (train above is what remains)")
    print(f"  {cfg.run.iterations} iterations: {step['total'] * cfg.run.iterations / 3600:.1f} h")
    from spice_megatron.plan.calibration import PUBLISHED_RUNS
    from spice_megatron.plan.step_time import NEMO_RL_TOKENS_PER_S_PER_GPU as nemo

    off = "colocated: on-policy only" if plan.colocated else \
        f"{step['tokens_per_s_per_gpu_one_step_off']:,.0f} one step off (train.max_staleness=1)"
    same = next((r for r in PUBLISHED_RUNS.values() if r.model == cfg.run.model), None)
    published = (f"{same.tokens_per_s_per_gpu:,.1f} for GRPO on this model, {same.gpus} H100s" if same else
                 f"{nemo['synchronous']:,.0f} and {nemo['one step off']:,.0f} for GRPO on Llama-3.1-8B, 16 H100s")
    print(f"tokens/s/GPU (trained tokens, all {plan.gpus} GPUs): {step['tokens_per_s_per_gpu']:,.0f} on-policy, {off}; "
          f"NeMo-RL publishes {published} (other workload: its math prompts are short, SPICE's challenger reads "
          "~3,000-token documents; docs/layouts.md compares them)")
    shared = "on" if resolve_shared_prefix(spec, cfg.train, cfg.parallel.context_parallel).use_shared_prefix else "off"
    print(f"train.shared_prefix ({shared}): the learner runs {step['learner_tokens']:,.0f} tokens, "
          f"{step['train']:.1f} s, {step['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU on-policy; without it "
          f"{unshared['learner_tokens']:,.0f} tokens, {unshared['train']:.1f} s, "
          f"{unshared['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU")
    print(f"on the same {cfg.cluster.nodes} node(s), each placement with its own chosen layout (on-policy):")
    for name, value in placements.items():
        if isinstance(value, str):
            print(f"  {name:14s} does not fit: {value[:160]}")
            continue
        p, st = value
        lp = p.learner
        print(f"  {name:14s} {st['tokens_per_s_per_gpu']:7,.0f} tokens/s/GPU, {st['total']:6.1f} s per iteration on "
              f"{p.gpus} GPUs (learner TP={lp.tp} PP={lp.pp}{f' CP={lp.cp}' if lp.cp > 1 else ''} DP={lp.dp}"
              f"{f' EP={lp.ep}' if lp.ep > 1 else ''}, {p.engines.count} engines x TP={p.engines.tp})")
    if args.choose:
        print(f"to use it: {plan_overrides(plan, cfg)}")
    if args.rank:
        print(f"the {min(args.rank, len(ranked))} fastest of {len(ranked)} learner layouts that fit, both placements "
              "(planned on-policy; differences of a few percent are below the model's resolution: docs/layouts.md):")
        for i, (p, st) in enumerate(ranked[:args.rank], 1):
            print(f"  {i}. {st['tokens_per_s_per_gpu']:7,.0f} tokens/s/GPU, {st['total']:6.1f} s, learner "
                  f"{p.learner.memory.total:5.1f} GiB/GPU: {plan_overrides(p, cfg)}")
        if args.choose and ranked:
            print(choice_in_ranking(plan_overrides(plan, cfg), [(plan_overrides(p, cfg), st) for p, st in ranked]))
    return 0


def choice_in_ranking(chosen: str, ranked: list[tuple[str, dict]]) -> str:
    """Where --choose's layout stands in the ranking, and why it need not be first."""
    place = next((i for i, (overrides, _) in enumerate(ranked, 1) if overrides == chosen), None)
    best = ranked[0][1]["tokens_per_s_per_gpu"]
    if place == 1:
        return "--choose's layout is the fastest of the ranking (#1)"
    where = f"#{place} of the ranking" if place else "not in the ranking"
    gap = (f", {100 * (1 - ranked[place - 1][1]['tokens_per_s_per_gpu'] / best):.0f}% below #1" if place else "")
    return (f"--choose's layout is {where}{gap}: --choose takes the first layout that fits in its order (no "
            "optimizer offload, no full recompute and no context parallelism before they are needed, then the "
            "smallest TP x PP: docs/layouts.md), not the fastest planned; #1's overrides above are the planned "
            "fastest")


def plan_overrides(plan, cfg) -> str:
    """The recipe overrides that lay a run out as `plan` says."""
    lp = plan.learner
    return (f"parallel.tensor_parallel={lp.tp} parallel.pipeline_parallel={lp.pp} "
            + (f"parallel.first_stage_layers={lp.first_stage_layers} "
               f"parallel.last_stage_layers={lp.last_stage_layers} " if lp.first_stage_layers else "")
            + (f"train.recompute={lp.recompute} " if lp.recompute != cfg.train.recompute else "")
            + (f"parallel.expert_parallel={lp.ep} " if lp.ep > 1 else "")
            + (f"parallel.context_parallel={lp.cp} train.shared_prefix=off " if lp.cp > 1 else "")
            + (f"parallel.virtual_pipeline={lp.vpp} " if lp.vpp > 1 else "")
            + f"rollout.engine_tensor_parallel={plan.engines.tp}"
            + (f" run.colocate=true train.max_staleness=0 rollout.weight_transfer=ipc rollout.gpu_memory_utilization="
               f"{plan.engines.utilization}" if plan.colocated else " run.colocate=false")
            + (f" optim.cpu_offload_fraction={lp.optimizer_offload}" if lp.optimizer_offload else ""))
